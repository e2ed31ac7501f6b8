"""Runtime benchmark: the Tandem engine against HF transformers `generate`, same model, same run.

Measures decode latency at batch 1, decode throughput at batch 32, prefill throughput of one
512-token prompt, and peak resident memory; prints a table (or `--json`) with Tandem/HF ratios.
Run: `.venv/bin/python bench/runtime.py [--model DIR] [--threads 2] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.model_store import ensure_default_model  # noqa: E402
from services.runtime.engine import Engine, EngineConfig  # noqa: E402
from services.runtime.sampler import SamplingParams  # noqa: E402

TARGETS = {"decode_b1_ms_per_token": 2.0, "decode_b32_tokens_per_s": 2.0, "prefill_tokens_per_s": 1.0}


def prompt(length: int, offset: int = 0) -> list[int]:
    return [(1000 + offset * 7 + i * 13) % 40000 + 100 for i in range(length)]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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
    def __init__(self, model_dir: Path) -> None:
        self.engine = Engine.from_model_dir(model_dir, EngineConfig(kv_memory_bytes=2 << 30))

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        self.engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))


def measure(runner, batch32_tokens: int) -> dict[str, float]:
    runner.generate([prompt(16)], 4)  # warm-up
    b1 = timed(lambda: runner.generate([prompt(16)], 65)) - timed(lambda: runner.generate([prompt(16)], 1))
    b32 = timed(lambda: runner.generate([prompt(16, i) for i in range(32)], batch32_tokens))
    prefill = timed(lambda: runner.generate([prompt(512)], 1))
    return {
        "decode_b1_ms_per_token": b1 / 64 * 1000,
        "decode_b32_tokens_per_s": 32 * batch32_tokens / b32,
        "prefill_tokens_per_s": 512 / prefill,
    }


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
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or ensure_default_model()
    # Tandem first: peak RSS is a high-water mark, so its figure excludes HF's model.
    tandem = measure(TandemRunner(model_dir), args.batch32_tokens)
    tandem_rss = peak_rss_mb()
    hf = measure(HfRunner(model_dir), args.batch32_tokens)
    result = {"tandem": tandem, "hf": hf, "ratio_tandem_over_hf": ratios(tandem, hf),
              "targets": TARGETS, "peak_rss_mb": {"tandem": tandem_rss, "tandem_plus_hf": peak_rss_mb()},
              "threads": args.threads}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'metric':28} {'tandem':>10} {'hf':>10} {'ratio':>7} {'target':>7}")
    for key, target in TARGETS.items():
        print(f"{key:28} {tandem[key]:10.1f} {hf[key]:10.1f} {result['ratio_tandem_over_hf'][key]:6.2f}x {target:6.1f}x")
    print(f"peak RSS: tandem {tandem_rss:.0f} MB, tandem+hf {result['peak_rss_mb']['tandem_plus_hf']:.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
