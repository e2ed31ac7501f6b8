"""`tandem health HOST:PORT`: ask a service's grpc.health.v1 endpoint whether it is SERVING.

Exit status 0 when SERVING, 1 otherwise (with the reason on stderr). Also the helpers that
launchers and tests use to wait until a service is up. A service whose internal plane runs on
mutual TLS (the scheduler, the workers) is asked over it: give the --internal-tls-* files.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tls import MutualTLS, TLSConfigError, mutual_tls

SERVING = "SERVING"


def channel(address: str, tls: MutualTLS | None = None) -> grpc.Channel:
    """A blocking channel to a Tandem service: plaintext, or over the internal plane's mutual TLS."""
    if tls is None:
        return grpc.insecure_channel(address)
    options = (("grpc.ssl_target_name_override", tls.server_name),) if tls.server_name else ()
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def check(address: str, service: str = "", timeout: float = 2.0, tls: MutualTLS | None = None) -> str:
    """The serving status name of `service` ("" = the whole server) at address, e.g. "SERVING";
    asked over mutual TLS when `tls` is given (a service of the internal plane that requires it).

    Raises grpc.RpcError when the server cannot be reached or does not know the service.
    """
    with channel(address, tls) as channel_:
        stub = health_pb2_grpc.HealthStub(channel_)
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
    for name, what in (("ca", "the CA that signed the service's certificate"), ("cert", "this client's certificate"),
                       ("key", "the private key of --internal-tls-cert")):
        parser.add_argument(f"--internal-tls-{name}", type=Path, metavar="PEM",
                            help=f"ask over mutual TLS (a service of the internal plane that requires it): {what}")
    parser.add_argument("--internal-tls-server-name", metavar="NAME",
                        help="the name the service's certificate is checked against instead of the host dialled")


def main(args: argparse.Namespace) -> int:
    target = f"{args.address} {args.service}".strip()
    try:
        tls = mutual_tls(args.internal_tls_ca, args.internal_tls_cert, args.internal_tls_key,
                         args.internal_tls_server_name)
    except TLSConfigError as exc:
        print(f"tandem health: {exc}", file=sys.stderr)
        return 2
    try:
        status = check(args.address, args.service, args.timeout, tls)
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
