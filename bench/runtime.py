"""Runtime benchmark: the Tandem engine against HF transformers `generate` in fp32, same model, same run.

Measures decode latency at batch 1, decode throughput at batch 32 and prefill throughput of a
512-token prompt for HF and each precision of `--variants` (`auto` is what the start-up probe picks
on this machine; services/runtime/precision.py), interleaved: `--rounds` rounds, in each one every
figure is taken from every runner in turn, the order rotated from round to round, and each variant's
ratio to HF is taken within the round. The table gives the medians over the rounds and, for each
ratio, its range, so that a load that comes and goes slows both sides of a ratio alike or moves one
round of several. Also one decode step's time at batch 1, 8 and 32 (100-token prompts; `--steps-only`
measures just that, without HF), and peak resident memory of the Tandem variants. `--json` prints
it all. `--llama-bench PATH` adds llama.cpp's own `llama-bench` figures for the GGUF the default
model ships as (or `--gguf FILE`). `--clock cpu` times by the process's CPU time instead of the wall
clock (with `--threads 1`, a figure that holds while other work loads the machine).
Run: `.venv/bin/python bench/runtime.py [--model DIR] [--threads 2] [--variants auto,float32] [--rounds 5] [--json]`.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.model_config import ModelConfig  # noqa: E402
from services.common.model_store import ensure_default_model, find_default_gguf  # noqa: E402
from services.runtime.engine import Engine, EngineConfig  # noqa: E402
from services.runtime.precision import Choice, resolve  # noqa: E402
from services.runtime.sampler import SamplingParams  # noqa: E402

TARGETS = {"decode_b1_ms_per_token": 2.0, "decode_b32_tokens_per_s": 3.0, "prefill_tokens_per_s": 2.0}
VARIANTS = "auto,float32,bfloat16,bfloat16+int8,bfloat16+int4"
PREFILL_ROWS = 512
STEP_BATCHES = (1, 8, 32)
HF = "hf generate fp32"


def prompt(length: int, offset: int = 0) -> list[int]:
    return [(1000 + offset * 7 + i * 13) % 40000 + 100 for i in range(length)]


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class HfRunner:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts)
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


class TandemRunner:
    def __init__(self, model_dir: Path, choice: Choice) -> None:
        config = EngineConfig(kv_memory_bytes=2 << 30, precision=choice.precision)
        self.engine = Engine.from_model_dir(model_dir, config)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        self.engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))

    def decode_step_ms(self, batch: int, steps: int) -> dict[str, float]:
        """Median and fastest wall time of one engine step decoding `batch` sequences (100-token prompts,
        prefilled in one step first; contexts grow from 102 to 101 + steps tokens), and the median CPU
        time of the stepping thread: with `--threads 1` torch computes on that thread, so this figure
        holds steady while other work loads the machine and stretches the wall times."""
        params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            self.engine.add_request(f"step-{batch}-{i}", prompt(100, i), params)
        self.engine.step()  # the prefill
        self.engine.step()  # warm-up
        times, cpu_times = [], []
        for _ in range(steps):
            cpu_start = time.thread_time()
            times.append(timed(self.engine.step))
            cpu_times.append(time.thread_time() - cpu_start)
        while self.engine.has_unfinished():
            self.engine.step()
        times.sort()
        cpu_times.sort()
        return {"p50": times[steps // 2] * 1000, "min": times[0] * 1000, "cpu_p50": cpu_times[steps // 2] * 1000}


def step_times(runner: TandemRunner, steps: int) -> dict[str, dict[str, float]]:
    return {f"decode_step_b{batch}_ms": runner.decode_step_ms(batch, steps) for batch in STEP_BATCHES}


@dataclass(frozen=True, slots=True)
class Figures:
    """How each figure is taken from a runner; TARGETS names them. A round's batch-32 prompts and its
    prefill's are its own, so no runner's prefix cache holds them."""
    batch32_tokens: int
    clock: Callable[[], float]

    def warm_up(self, runner) -> None:
        runner.generate([prompt(16)], 4)  # the long prefill's shapes too (another prompt: no cache hit)
        runner.generate([prompt(512, 99)], 1)

    def decode_b1_ms_per_token(self, runner, _round: int) -> float:
        whole = timed(lambda: runner.generate([prompt(16)], 65), self.clock)
        return (whole - timed(lambda: runner.generate([prompt(16)], 1), self.clock)) / 64 * 1000

    def decode_b32_tokens_per_s(self, runner, round_: int) -> float:
        batch = [prompt(16, 1000 + 32 * round_ + i) for i in range(32)]
        return 32 * self.batch32_tokens / timed(lambda: runner.generate(batch, self.batch32_tokens), self.clock)

    def prefill_tokens_per_s(self, runner, round_: int) -> float:
        return 512 / timed(lambda: runner.generate([prompt(512, 100 + round_)], 1), self.clock)


def interleaved(runners: dict[str, object], figures: Figures, rounds: int) -> list[dict[str, dict[str, float]]]:
    """Per round, each runner's figures; within a round each figure is taken from every runner in turn,
    starting from another runner each round."""
    names = list(runners)
    taken: list[dict[str, dict[str, float]]] = []
    for index in range(rounds):
        turn = index % len(names)
        order = names[turn:] + names[:turn]
        one: dict[str, dict[str, float]] = {name: {} for name in names}
        for key in TARGETS:
            for name in order:
                one[name][key] = getattr(figures, key)(runners[name], index)
        taken.append(one)
    return taken


def summarize(rounds: list[dict[str, dict[str, float]]], baseline: str) -> dict[str, dict[str, object]]:
    """Per runner, the median of each figure over the rounds; per runner but `baseline`, also the
    median of its per-round ratios over `baseline` (above 1: faster) and their range."""
    summary: dict[str, dict[str, object]] = {}
    for name in rounds[0]:
        figures: dict[str, object] = {key: statistics.median(r[name][key] for r in rounds) for key in TARGETS}
        if name != baseline:
            by_round = [ratios(r[name], r[baseline]) for r in rounds]
            figures["ratio_over_hf"] = {key: statistics.median(r[key] for r in by_round) for key in TARGETS}
            figures["ratio_range"] = {key: [min(r[key] for r in by_round), max(r[key] for r in by_round)]
                                      for key in TARGETS}
        summary[name] = figures
    return summary


def variant_choice(variant: str, model_dir: Path) -> Choice:
    """`auto`, a dtype, or dtype+quantization (as precision names print), resolved for this machine."""
    dtype, _, quantization = variant.partition("+")
    if dtype == "auto":
        quantization = "auto"
    return resolve(dtype, quantization or "none", "cpu", ModelConfig.from_model_dir(model_dir), PREFILL_ROWS)


def llama_bench(binary: Path, gguf: Path, threads: int) -> dict[str, float]:
    """llama.cpp's prefill (512 tokens) and decode (64 tokens) rates on the same threads."""
    done = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-p", "512", "-n", "64", "-o", "json"],
                          capture_output=True, text=True, timeout=600, check=True)
    rows = json.loads(done.stdout)
    rate = {("prefill" if row["n_prompt"] else "decode"): row["avg_ts"] for row in rows}
    return {"decode_b1_ms_per_token": 1000 / rate["decode"], "prefill_tokens_per_s": rate["prefill"]}


def ratios(tandem: dict[str, float], hf: dict[str, float]) -> dict[str, float]:
    return {
        "decode_b1_ms_per_token": hf["decode_b1_ms_per_token"] / tandem["decode_b1_ms_per_token"],
        "decode_b32_tokens_per_s": tandem["decode_b32_tokens_per_s"] / hf["decode_b32_tokens_per_s"],
        "prefill_tokens_per_s": tandem["prefill_tokens_per_s"] / hf["prefill_tokens_per_s"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch32-tokens", type=int, default=64)
    parser.add_argument("--variants", default=VARIANTS, help=f"comma-separated precisions (default {VARIANTS})")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the table gives their medians")
    parser.add_argument("--llama-bench", type=Path, metavar="PATH", help="llama.cpp's llama-bench binary")
    parser.add_argument("--gguf", type=Path, help="the GGUF llama-bench runs; default: the one the default model ships as")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed at each of batch 1, 8 and 32")
    parser.add_argument("--steps-only", action="store_true", help="only the decode step times; no HF, no ratios")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="cpu: the process's CPU time, not wall time: with --threads 1 it holds steady while "
                             "other work loads the machine")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    model_dir = args.model or ensure_default_model()
    figures = Figures(args.batch32_tokens, CLOCKS[args.clock])
    result: dict[str, object] = {"threads": args.threads, "clock": args.clock, "rounds": args.rounds,
                                 "targets": TARGETS, "variants": {}}
    runners: dict[str, object] = {}
    for variant in args.variants.split(","):
        choice = variant_choice(variant, model_dir)
        runners[variant] = TandemRunner(model_dir, choice)
        if not args.steps_only:
            figures.warm_up(runners[variant])
        result["variants"][variant] = {"precision": choice.line(), **step_times(runners[variant], args.steps)}  # type: ignore[index]
    if not args.steps_only:
        # Before HF loads: peak RSS is a high-water mark, so this figure (all variants loaded) excludes HF's model.
        result["peak_rss_mb_tandem"] = peak_rss_mb()
        runners[HF] = HfRunner(model_dir)
        figures.warm_up(runners[HF])
        summary = summarize(interleaved(runners, figures, args.rounds), HF)
        result["hf_fp32"] = summary.pop(HF)
        for variant, measured in summary.items():
            result["variants"][variant].update(measured)  # type: ignore[index]
        if args.llama_bench:
            result["llama_bench"] = llama_bench(args.llama_bench, args.gguf or find_default_gguf(), args.threads)
    result["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(steps_table(result) if args.steps_only else full_table(result))
    return 0


def steps_table(result: dict) -> str:
    header = "".join(f"{f'batch {b}: p50 / min / cpu p50':>32}" for b in STEP_BATCHES)
    lines = [f"{'decode step, ms':24}{header}"]
    for name, figures in result["variants"].items():
        steps = [figures[f"decode_step_b{b}_ms"] for b in STEP_BATCHES]
        lines.append(f"{name:24}" + "".join(f"{s['p50']:16.2f} / {s['min']:6.2f} / {s['cpu_p50']:6.2f}" for s in steps))
        lines.append(f"{'':24}  = {figures['precision']}")
    lines.append(f"threads {result['threads']}, {result['clock']} clock; load average {' '.join(result['loadavg'])}; "
                 f"wall {result['wall_s']} s")
    return "\n".join(lines)


def full_table(result: dict) -> str:
    keys = list(TARGETS)
    lines = [f"{'':24}" + "".join(f"{k:>36}" for k in keys)]
    for name, figures in result["variants"].items():
        ratio, spread = figures["ratio_over_hf"], figures["ratio_range"]
        lines.append(f"{name:24}" + "".join(
            f"{figures[k]:13.1f} ({ratio[k]:5.2f}x, {spread[k][0]:.2f}-{spread[k][1]:.2f})" for k in keys))
        lines.append(f"{'':24}  = {figures['precision']}")
    lines.append(f"{HF:24}" + "".join(f"{result['hf_fp32'][k]:36.1f}" for k in keys))
    if "llama_bench" in result:
        llama = result["llama_bench"]
        lines.append(f"{'llama-bench':24}" + "".join(f"{llama[k]:36.1f}" if k in llama else f"{'-':>36}" for k in keys))
    lines.append(f"{'target (auto over hf)':24}" + "".join(f"{t:35.1f}x" for t in TARGETS.values()))
    lines.append(f"medians of {result['rounds']} interleaved rounds (ratio over HF: median, range over the rounds)")
    lines.append(steps_table(result))
    lines.append(f"peak RSS of the Tandem variants (all loaded) {result['peak_rss_mb_tandem']:.0f} MB")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
