"""What the gateway -> scheduler transport costs per request, apart from routing: a scheduler process
whose every request is placed at once and ends OK (no workers, no routing), driven with `--requests`
requests at `--concurrency` either as a Submit call each (`calls`) or as submissions on one
Submissions stream (`stream`), the two interleaved `--rounds` times. Reports the server's and the
client's CPU milliseconds per request (from /proc/<pid>/stat), the number to compare.

Run: `.venv/bin/python bench/submissions.py [--requests 4000] [--concurrency 48] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from services.common.grpc_server import create_server  # noqa: E402
from services.gateway.submissions import SchedulerSubmissions  # noqa: E402
from services.scheduler import submissions  # noqa: E402
from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402

PROMPT = list(range(64))


class PlacingAtOnce(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Each request: its Placement, then the end (OK)."""

    async def Submit(self, request, context) -> AsyncIterator[scheduler_pb2.SubmitEvent]:
        yield scheduler_pb2.SubmitEvent(placement=scheduler_pb2.Placement(attempt_id=request.request_id))

    def Submissions(self, request_iterator, context) -> AsyncIterator[scheduler_pb2.SubmitUpdates]:
        return submissions.serve(self.Submit, request_iterator, context)


async def serve(port_file: Path) -> None:
    server = create_server("127.0.0.1", 0)
    server.add_service("tandem.v1.SchedulerService", scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                       PlacingAtOnce())
    await server.start()
    port_file.write_text(str(server.port))
    await asyncio.Event().wait()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(channel: grpc.aio.Channel, mode: str, requests: int, concurrency: int) -> None:
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    stream = SchedulerSubmissions(stub)
    gate = asyncio.Semaphore(concurrency)

    async def one(n: int) -> None:
        request = scheduler_pb2.SubmitRequest(request_id=f"{mode}-{n}", model="m", token_ids=PROMPT,
                                              sampling=common_pb2.SamplingParams(max_tokens=16))
        async with gate:
            call = (stub.Submit(request, timeout=30) if mode == "calls"
                    else stream.submit(request, timeout=30, metadata=()))
            while await call.read() is not grpc.aio.EOF:
                pass

    await asyncio.gather(*(one(n) for n in range(requests)))
    stream.close()


async def measure(address: str, server_pid: int, mode: str, requests: int, concurrency: int) -> tuple[float, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        await drive(channel, mode, concurrency, concurrency)  # warm up the connection and both sides
        server0, client0 = cpu_s(server_pid), time.process_time()
        await drive(channel, mode, requests, concurrency)
        return (cpu_s(server_pid) - server0) * 1000 / requests, (time.process_time() - client0) * 1000 / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    port_file = Path(f"/tmp/bench-submissions-{os.getpid()}.port")
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)])
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the bench's scheduler did not start")
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text()}"
        print(f"load average {Path('/proc/loadavg').read_text().split(' ', 3)[:3]}")
        print("mode    server CPU ms/request   client CPU ms/request")
        for _ in range(args.rounds):
            for mode in ("calls", "stream"):
                server_ms, client_ms = asyncio.run(measure(address, server.pid, mode, args.requests,
                                                           args.concurrency))
                print(f"{mode:7} {server_ms:21.3f} {client_ms:23.3f}", flush=True)
        print(f"load average {Path('/proc/loadavg').read_text().split(' ', 3)[:3]}")
    finally:
        server.kill()
        server.wait()
        port_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
