"""`tandem health HOST:PORT`: ask a service's grpc.health.v1 endpoint whether it is SERVING.

Exit status 0 when SERVING, 1 otherwise (with the reason on stderr). Also the helpers that
launchers and tests use to wait until a service is up.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = "SERVING"


def check(address: str, service: str = "", timeout: float = 2.0) -> str:
    """The serving status name of `service` ("" = the whole server) at address, e.g. "SERVING".

    Raises grpc.RpcError when the server cannot be reached or does not know the service.
    """
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def wait_until_serving(address: str, timeout: float, service: str = "", interval: float = 0.1) -> None:
    """Poll until the service is SERVING; TimeoutError saying the last status seen otherwise."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            last = check(address, service, timeout=min(1.0, max(deadline - time.monotonic(), 0.05)))
        except grpc.RpcError as error:
            last = f"{error.code().name}: {error.details()}"
        if last == SERVING:
            return
        time.sleep(interval)
    raise TimeoutError(f"{address} not SERVING after {timeout:.1f} s (last: {last})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", metavar="HOST:PORT", help="the service's gRPC address")
    parser.add_argument("--service", default="", help="service name to check, e.g. tandem.v1.GenerateService "
                        "(default: the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer (default 2)")


def main(args: argparse.Namespace) -> int:
    target = f"{args.address} {args.service}".strip()
    try:
        status = check(args.address, args.service, args.timeout)
    except grpc.RpcError as error:
        reason = "unknown service" if error.code() == grpc.StatusCode.NOT_FOUND else "unreachable"
        print(f"{target}: {reason} ({error.code().name}: {error.details()})", file=sys.stderr)
        return 1
    if status != SERVING:
        print(f"{target}: {status}", file=sys.stderr)
        return 1
    print(f"{target}: {status}")
    return 0


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="tandem health", description=__doc__.splitlines()[0])
    add_arguments(cli)
    sys.exit(main(cli.parse_args()))
