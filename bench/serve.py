"""Serving benchmark against peers: Tandem's `tandem up` configurations and any OpenAI-compatible
server (llama.cpp's llama-server, vLLM, ...) under the same load, through the same client, in one run.

One server at a time (they share the cores) gets every scenario of bench/loadgen.py: 100-word prompts
at concurrency 1 and 8, the long-prompt mix (every 4th prompt 1,000 words) at concurrency 16 and as
Poisson arrivals, 64 output tokens each. For each server and scenario it reports TTFT p50/p99, ITL
p50/p99, output tokens/s and goodput under the SLOs, then each Tandem configuration's ratios to each
peer and each Tandem configuration listed before it (hybrid against colocated and disaggregated,
by default). `--plot DIR` writes one PNG per scenario with the TTFT and ITL CDFs of every server. It prints
its command line, the CPU, and the load average around each server: other work on the machine moves
the figures, so compare only servers measured in the same run.
Bounded: every scenario sends a fixed number of requests and waits at most `--time-limit-s`.
Run: `.venv/bin/python bench/serve.py --start-peer llama.cpp [--peer-url URL --peer-name NAME] [--plot DIR]`
(`scripts/build_llama_cpp.sh` builds llama-server; `--tandem NAME='UP ARGS'` picks the Tandem setups).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ContextManager
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loadgen import (  # noqa: E402
    RequestResult, Scenario, ScenarioStats, Slo, default_scenarios, percentile, run_scenario, served_model,
    summarize,
)
from services.common.model_store import find_default_gguf  # noqa: E402
from services.common.paths import tandem_home  # noqa: E402
from tandem.cli.ports import free_port  # noqa: E402
from tests.mesh import Mesh  # noqa: E402

DEFAULT_TANDEM = ("colocated=--mode colocated", "disaggregated=--mode disaggregated --prefill 1 --decode 1",
                  "hybrid=--mode hybrid --prefill 1 --decode 1")
RATIO_METRICS = ("output_tokens_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p99_ms", "goodput_rps")
WARM_UP = Scenario("warm-up", requests=2, concurrency=1, short_words=16, output_tokens=4, seed=99)
LLAMA_START_TIMEOUT_S = 120


@dataclass(frozen=True, slots=True)
class Server:
    name: str
    is_tandem: bool
    command: str  # how to start it by hand (PORT: any free port; "" for a server already running)
    open: Callable[[], ContextManager[str]]  # yields its base URL while it runs


@dataclass(slots=True)
class Measured:
    stats: ScenarioStats
    results: list[RequestResult]


@contextlib.contextmanager
def tandem_up(up_args: list[str], keep_in: Path | None = None) -> Iterator[str]:
    """`tandem up` with these flags for the block; its run directory (every service's log and spans) is
    `keep_in` when given (kept), else a temporary one."""
    if keep_in is not None:
        keep_in.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(str(keep_in)) if keep_in is not None else tempfile.TemporaryDirectory() as run_dir:
        mesh = Mesh.start(*up_args, run_dir=Path(run_dir))
        try:
            yield mesh.http_url
        finally:
            mesh.stop()
            for line in applied_policies(Path(run_dir)):
                print(line, file=sys.stderr, flush=True)


POLICY_LOG = "applying the scheduler's batch policy "


def applied_policies(run_dir: Path) -> list[str]:
    """Each worker's last batching policy under SLOs and its step-cost fit then, from its log
    (services/worker/runtime.py logs every change): what the scheduler made of the run."""
    lines = []
    for log in sorted(run_dir.rglob("*.log")):
        applied = [line for line in log.read_text(errors="replace").splitlines() if POLICY_LOG in line]
        if applied:
            lines.append(f"{log.stem}: {len(applied)} policy change(s), the last "
                         f"{applied[-1].split(POLICY_LOG, 1)[1]}")
    return lines


def llama_server_command(binary: Path, gguf: Path, port: int | str, args: argparse.Namespace) -> list[str]:
    """llama-server on loopback with `--llama-slots` parallel slots of `--llama-ctx` tokens each and all
    the cores, as `tandem up` gives its workers."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.llama_threads), "-tb", str(args.llama_threads), "-np", str(args.llama_slots),
            "-c", str(args.llama_slots * args.llama_ctx), "--no-webui"]


@contextlib.contextmanager
def running(command: list[str], url: str) -> Iterator[str]:
    """Runs a server process until the block ends; ready once its GET /health answers 200."""
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_healthy(url, process, log)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(url: str, process: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + LLAMA_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}:\n{log.read()[-3000:].decode()}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError):
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(0.2)
    raise RuntimeError(f"{process.args[0]} did not answer {url}/health with 200 within {LLAMA_START_TIMEOUT_S} s")


def servers_of(args: argparse.Namespace) -> list[Server]:
    servers = []
    for spec in ([] if args.no_tandem else args.tandem or list(DEFAULT_TANDEM)):
        name, _, up_args = spec.partition("=")
        argv = shlex.split(up_args)
        keep_in = args.run_dir / name if args.run_dir else None
        servers.append(Server(f"tandem {name}", True, shlex.join(["tandem", "up", *argv]),
                              lambda argv=argv, keep_in=keep_in: tandem_up(argv, keep_in)))
    for spec in args.start_peer:
        servers.append(_llama_peer(spec, args))
    names = args.peer_name + [urlparse(url).netloc for url in args.peer_url[len(args.peer_name):]]
    for name, url in zip(names, args.peer_url):
        servers.append(Server(name, False, "", lambda url=url.rstrip("/"): contextlib.nullcontext(url)))
    return servers


def _llama_peer(spec: str, args: argparse.Namespace) -> Server:
    kind, _, gguf = spec.partition("=")
    if kind != "llama.cpp":
        raise SystemExit(f"--start-peer {spec}: the peer this script starts is llama.cpp (or llama.cpp=GGUF)")
    binary = Path(args.llama_cpp_bin) / "llama-server"
    if not binary.is_file():
        raise SystemExit(f"{binary}: missing; build it with scripts/build_llama_cpp.sh or pass --llama-cpp-bin DIR")
    path = Path(gguf) if gguf else find_default_gguf()

    def start() -> ContextManager[str]:
        port = free_port()  # picked at its turn: the port must still be free when it starts
        return running(llama_server_command(binary, path, port, args), f"http://127.0.0.1:{port}")

    return Server(f"llama.cpp {path.stem.rsplit('.', 1)[-1]}", False,
                  shlex.join(llama_server_command(binary, path, "PORT", args)), start)


def measure(server: Server, scenarios: list[Scenario], slo: Slo, time_limit_s: float,
            say: Callable[[str], None]) -> list[Measured]:
    measured = []
    with server.open() as url:
        model = asyncio.run(_model_of(url))
        asyncio.run(run_scenario(url, model, WARM_UP, time_limit_s))
        for scenario in scenarios:
            results, wall_s = asyncio.run(run_scenario(url, model, scenario, time_limit_s))
            measured.append(Measured(summarize(server.name, scenario.name, results, wall_s, slo), results))
            say(_row(measured[-1].stats))
    return measured


async def _model_of(url: str) -> str:
    async with httpx.AsyncClient() as client:
        return await served_model(client, url)


def ratios(stats: list[ScenarioStats], servers: list[Server]) -> list[dict[str, object]]:
    """Each Tandem configuration against each peer and each Tandem configuration listed before it,
    scenario by scenario (its figure over the other's)."""
    by_key = {(s.server, s.scenario): s for s in stats}
    peers = [s.name for s in servers if not s.is_tandem]
    tandems = [s.name for s in servers if s.is_tandem]
    return [{"tandem": mine.server, "peer": peer, "scenario": mine.scenario,
             **{metric: _ratio(getattr(mine, metric), getattr(by_key[peer, mine.scenario], metric))
                for metric in RATIO_METRICS}}
            for mine in stats if mine.server in tandems
            for peer in peers + tandems[:tandems.index(mine.server)] if (peer, mine.scenario) in by_key]


def _ratio(mine: float, theirs: float) -> float | None:
    return mine / theirs if theirs else None


HEADER = (f"{'server':28} {'scenario':13} {'tok/s':>7} {'ITL p50':>8} {'p99':>8} {'TTFT p50':>9} {'p99':>8} "
          f"{'goodput':>8} {'SLO':>4} {'failed':>6}")


def _row(s: ScenarioStats) -> str:
    return (f"{s.server:28} {s.scenario:13} {s.output_tokens_per_s:7.1f} {s.itl_p50_ms:8.1f} {s.itl_p99_ms:8.1f} "
            f"{s.ttft_p50_ms:9.0f} {s.ttft_p99_ms:8.0f} {s.goodput_rps:8.2f} {'yes' if s.slo_met else 'no':>4} "
            f"{s.failed:6d}" + (f"  first error: {s.first_error}" if s.first_error else ""))


def _ratio_row(r: dict[str, object]) -> str:
    cells = " ".join(f"{r[m]:7.2f}x" if r[m] is not None else f"{'-':>8}" for m in RATIO_METRICS)
    return f"{r['tandem'] + ' / ' + r['peer']:45} {r['scenario']:13} {cells}"


def plot(measured: list[Measured], out_dir: Path) -> list[Path]:
    """One PNG per scenario: the TTFT and the ITL CDF of every server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for scenario in dict.fromkeys(m.stats.scenario for m in measured):
        figure, (ttft_axis, itl_axis) = plt.subplots(1, 2, figsize=(11, 4))
        for m in (m for m in measured if m.stats.scenario == scenario):
            streamed = [r for r in m.results if r.ttft_s is not None]
            _cdf(ttft_axis, [r.ttft_s * 1000 for r in streamed], m.stats.server)
            _cdf(itl_axis, [g * 1000 for r in streamed for g in r.gaps_s], m.stats.server)
        for axis, title in ((ttft_axis, "time to first token (ms)"), (itl_axis, "inter-token latency (ms)")):
            axis.set_xscale("log")
            axis.set_xlabel(title)
            axis.set_ylabel("fraction of samples")
            axis.grid(True, which="both", alpha=0.3)
            if axis.lines:
                axis.legend(fontsize=8)
        figure.suptitle(f"scenario {scenario}")
        figure.tight_layout()
        path = out_dir / f"serve-{scenario}-cdf.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def _cdf(axis, values: list[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        axis.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=label)


def per_request_rows(m: Measured, slo: Slo) -> Iterator[dict[str, object]]:
    """One row per request of a measured scenario: what decides whether it counts toward goodput."""
    for index, r in enumerate(m.results):
        yield {"server": m.stats.server, "scenario": m.stats.scenario, "index": index, "prompt_words": r.prompt_words,
               "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1000, 1),
               "itl_p99_ms": round(percentile(r.gaps_s, 0.99) * 1000, 1),
               "longest_gap_ms": round(max(r.gaps_s, default=0.0) * 1000, 1),
               "output_tokens": r.output_tokens, "meets_slo": r.meets(slo), "error": r.error}


def write_per_request(measured: list[Measured], slo: Slo, path: Path) -> None:
    with path.open("w") as out:
        for m in measured:
            for row in per_request_rows(m, slo):
                out.write(json.dumps(row) + "\n")


def cpu_description() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    marks = [flag for flag in ("avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if flag in flags]
    return f"{model}, {os.cpu_count()} cores ({', '.join(marks) or 'no AVX-512'})"


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tandem", action="append", default=[], metavar="NAME='UP ARGS'",
                        help="a Tandem setup to measure: a name and the `tandem up` flags; repeatable "
                             f"(default: {'; '.join(DEFAULT_TANDEM)})")
    parser.add_argument("--no-tandem", action="store_true", help="measure only the peers")
    parser.add_argument("--peer-url", action="append", default=[], help="an OpenAI-compatible server already "
                        "running (base URL, without /v1); repeatable")
    parser.add_argument("--peer-name", action="append", default=[], help="the name of each --peer-url, in order")
    parser.add_argument("--start-peer", action="append", default=[], metavar="llama.cpp[=GGUF]",
                        help="start llama-server on 127.0.0.1 with this GGUF (default: the default model's "
                             "Q4_1 file) for its turn; repeatable")
    parser.add_argument("--llama-cpp-bin", default=str(tandem_home() / "peers" / "llama.cpp" / "bin"),
                        help="directory of llama-server (scripts/build_llama_cpp.sh installs it there)")
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--llama-slots", type=int, default=16, help="llama-server's parallel slots")
    parser.add_argument("--llama-ctx", type=int, default=2048, help="context tokens of each slot")
    parser.add_argument("--scenario", action="append", default=[], choices=list(default_scenarios(1.0)),
                        help="scenarios to run, in order; repeatable (default: all)")
    parser.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second (poisson-long)")
    parser.add_argument("--requests-scale", type=float, default=1.0, help="multiply every scenario's request count")
    parser.add_argument("--time-limit-s", type=float, default=180.0, help="the longest one scenario may run")
    parser.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=200.0)
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write TTFT and ITL CDF PNGs here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    parser.add_argument("--run-dir", type=Path, metavar="DIR",
                        help="keep each Tandem setup's run directory (its services' logs and spans) in DIR/NAME "
                             "(none: a temporary one, removed)")
    parser.add_argument("--per-request", type=Path, metavar="FILE",
                        help="write every request's figures (prompt words, TTFT, its own ITL p99 and longest gap, "
                             "whether it met both SLOs) here as JSON lines, in sending order")
    args = parser.parse_args(argv)
    if len(args.peer_name) > len(args.peer_url):
        parser.error("more --peer-name than --peer-url: give one name per URL, in the same order")
    return args


def chosen_scenarios(args: argparse.Namespace) -> list[Scenario]:
    every = default_scenarios(args.rate)
    return [dataclasses.replace(every[name], requests=max(1, round(every[name].requests * args.requests_scale)))
            for name in args.scenario or list(every)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    servers, scenarios = servers_of(args), chosen_scenarios(args)
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    say = (lambda _: None) if args.json else (lambda line: print(line, flush=True))
    say(f"command: {shlex.join([sys.executable, *sys.argv])}\ncpu: {cpu_description()}")
    say(f"SLO: TTFT <= {slo.ttft_ms:.0f} ms, ITL p99 <= {slo.itl_ms:.0f} ms\n{HEADER}")
    measured, loads = [], {}
    for server in servers:
        before = loadavg()
        say(f"{server.name}: {server.command or 'already running'} (loadavg before: {before})")
        measured += measure(server, scenarios, slo, args.time_limit_s, say)
        loads[server.name] = {"before": before, "after": loadavg()}
    stats = [m.stats for m in measured]
    if args.per_request:
        write_per_request(measured, slo, args.per_request)
    report = {"command": shlex.join([sys.executable, *sys.argv]), "cpu": cpu_description(), "slo": asdict(slo),
              "servers": {s.name: s.command for s in servers}, "loadavg": loads,
              "results": [asdict(s) for s in stats], "ratios": ratios(stats, servers),
              "plots": [str(p) for p in plot(measured, args.plot)] if args.plot else []}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\n{HEADER}\n" + "\n".join(_row(s) for s in stats))
    print(f"\n{'Tandem / peer':45} {'scenario':13} {'tok/s':>8} {'ITL p50':>8} {'ITL p99':>8} {'TTFT p99':>8} "
          f"{'goodput':>8}")
    print("\n".join(_ratio_row(r) for r in report["ratios"]))
    print("\n".join(f"plot: {p}" for p in report["plots"]))
    print("loadavg (1, 5, 15 min) around each server: " + "; ".join(
        f"{name}: {load['before'].split()[0]} -> {load['after'].split()[0]}" for name, load in loads.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
