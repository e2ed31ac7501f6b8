"""infra/docker-compose.yml run as local processes: its commands, environment and health checks.

Every service starts from the compose file's own `command` and `environment`, in its
`depends_on` order, with each compose name and port mapped to a free loopback port, the
model-cache volume mapped to the local model cache, GPU reservations ignored and `--device cuda:N`
run on the CPU. A stand-in OTLP collector plays Jaeger. This proves the flags, variables and
health checks written in the compose file are the ones the services accept.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "infra" / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "infra" / ".env.example"
TANDEM = Path(sys.executable).parent / "tandem"
LISTEN_FLAGS = ("--port", "--http-port", "--metrics-port")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0")
ADDRESS = re.compile(r"(?<![\w.-])([A-Za-z0-9][\w.-]*):(\d+)\b")
# Sized for a 2-core CI machine; the compose file leaves these at the services' defaults.
LOCAL_SETTINGS = {"TANDEM_THREADS": "1", "TANDEM_KV_MEMORY": "256MiB", "OTEL_BSP_SCHEDULE_DELAY": "200"}
PROMPTS = ["1, 2, 3, 4, 5,", "The quick brown fox"]
MAX_TOKENS = 16

pytestmark = [
    pytest.mark.skipif(
        not (ROOT / "services" / "gateway" / "main.py").exists(),
        reason="the services have not landed yet (services/gateway/main.py is missing)",
    ),
    pytest.mark.slow,
]


# --- Mapping compose names, ports and volumes onto this machine ---------------------------------


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all sockets held open until every port is chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _strings(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    check = service.get("healthcheck", {}).get("test", [])
    return [*command, *check, *map(str, service.get("environment", {}).values())]


def _endpoints(services: dict[str, Any]) -> set[tuple[str, int]]:
    """Every (service, container port) the file listens on or refers to."""
    endpoints: set[tuple[str, int]] = set()
    for name, service in services.items():
        command = service.get("command", [])
        endpoints |= {(name, int(command[i + 1])) for i, arg in enumerate(command[:-1]) if arg in LISTEN_FLAGS}
        for text in _strings(service):
            for host, port in ADDRESS.findall(text):
                if host in LOOPBACK_HOSTS:
                    endpoints.add((name, int(port)))
                elif host in services:
                    endpoints.add((host, int(port)))
    return endpoints


@dataclass(slots=True)
class LocalMap:
    """Where a compose (service, container port) and a container path live on this machine."""

    ports: dict[tuple[str, int], int]
    mounts: dict[str, dict[str, Path]]  # service -> container path -> local directory

    @classmethod
    def build(cls, services: dict[str, Any], volumes: dict[str, Path]) -> LocalMap:
        endpoints = sorted(_endpoints(services))
        ports = dict(zip(endpoints, free_ports(len(endpoints))))
        mounts = {
            name: {target: volumes[source] for source, target in (v.split(":", 1) for v in svc.get("volumes", []))}
            for name, svc in services.items()
        }
        return cls(ports, mounts)

    def port(self, service: str, port: int) -> int:
        if (service, port) not in self.ports:
            raise KeyError(f"nothing in the compose file listens on {service}:{port}")
        return self.ports[(service, port)]

    def rewrite(self, service: str, text: str) -> str:
        """A command argument or variable of `service`, with addresses and paths made local."""
        for target, local in self.mounts[service].items():
            if text == target or text.startswith(target + "/"):
                text = str(local) + text[len(target):]
        if text == "0.0.0.0":
            return "127.0.0.1"

        def local_address(match: re.Match[str]) -> str:
            host, port = match.group(1), int(match.group(2))
            owner = service if host in LOOPBACK_HOSTS else host
            return f"127.0.0.1:{self.port(owner, port)}" if (owner, port) in self.ports else match.group(0)

        return ADDRESS.sub(local_address, text)

    def command(self, service: str, args: list[str]) -> list[str]:
        local = [self.rewrite(service, arg) for arg in args]
        for i, arg in enumerate(args[:-1]):
            if arg in LISTEN_FLAGS:
                local[i + 1] = str(self.port(service, int(args[i + 1])))
            elif arg == "--device" and args[i + 1].startswith("cuda"):
                local[i + 1] = "cpu"  # GPU reservations are ignored here
        return local


# --- Running the services -----------------------------------------------------------------------


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def _read_env_file(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def start_order(services: dict[str, Any]) -> list[str]:
    """Services sorted so that each comes after everything it depends on."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise ValueError(f"depends_on cycle: {' -> '.join((*path, name))}")
        if name not in order:
            for dep in services[name].get("depends_on", {}):
                visit(dep, (*path, name))
            order.append(name)

    for name in services:
        visit(name, ())
    return order


@dataclass(slots=True)
class LocalCompose:
    """The compose file's services as processes on this machine, started in dependency order."""

    services: dict[str, Any]
    local: LocalMap
    env_file: dict[str, str]
    workdir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def command_argv(self, service: str) -> list[str]:
        """What the container runs: a Tandem image's command goes to its ENTRYPOINT, `tandem`."""
        command = self.services[service]["command"]
        return self.exec_argv(service, ["tandem", *command] if "build" in self.services[service] else command)

    def exec_argv(self, service: str, args: list[str]) -> list[str]:
        """`args` as exec'd in the service's container, run here (a health check, a command)."""
        program, *rest = self.local.command(service, args)
        if program == "tandem":
            return [str(TANDEM), *rest]
        if program == "redis-server":
            return [program, *rest, "--port", str(self.local.port(service, 6379)), "--bind", "127.0.0.1"]
        if program == "redis-cli":
            return [program, "-p", str(self.local.port(service, 6379)), *rest]
        raise ValueError(f"{service}: no local stand-in for {program!r}")

    def environment(self, service: str) -> dict[str, str]:
        spec = self.services[service]
        outer = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "OTEL_"))}
        env = {**outer, **LOCAL_SETTINGS, "TANDEM_RUN_DIR": str(self.workdir / "run" / service)}
        if "env_file" in spec:
            env |= self.env_file
        env |= {key: self.local.rewrite(service, str(value)) for key, value in spec.get("environment", {}).items()}
        return env

    def start(self, service: str) -> None:
        log = open(self.workdir / f"{service}.log", "wb")
        self.processes[service] = subprocess.Popen(
            self.command_argv(service),
            env=self.environment(service), stdout=log, stderr=subprocess.STDOUT,
            cwd=self.workdir, start_new_session=True,
        )  # fmt: skip
        log.close()

    def log_tail(self, service: str, lines: int = 40) -> str:
        text = (self.workdir / f"{service}.log").read_text(errors="replace")
        return f"--- {service} log ---\n" + "\n".join(text.splitlines()[-lines:])

    def health_check(self, service: str) -> subprocess.CompletedProcess[str]:
        kind, *args = self.services[service]["healthcheck"]["test"]
        if kind != "CMD":
            raise ValueError(f"{service}: only CMD health checks are run here, got {kind}")
        timeout = _seconds(self.services[service]["healthcheck"].get("timeout", "30s"))
        return subprocess.run(self.exec_argv(service, args), env=self.environment(service),
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip

    def wait_healthy(self, service: str) -> None:
        check = self.services[service]["healthcheck"]
        # Compose gives up after start_period plus `retries` failed checks `interval` apart.
        patience = _seconds(check.get("start_period", "0s")) + int(check.get("retries", 3)) * _seconds(check["interval"])
        deadline = time.monotonic() + patience
        while (result := self.health_check(service)).returncode != 0:
            process = self.processes[service]
            assert process.poll() is None, f"{service} exited with {process.returncode}\n{self.log_tail(service)}"
            assert time.monotonic() < deadline, f"{service} not healthy: {result.stderr}\n{self.log_tail(service)}"
            time.sleep(0.5)

    def wait_completed(self, service: str) -> None:
        code = self.processes[service].wait(timeout=900)
        assert code == 0, f"{service} exited with {code}\n{self.log_tail(service)}"

    def wait_for(self, service: str, condition: str) -> None:
        waits = {"service_healthy": self.wait_healthy, "service_completed_successfully": self.wait_completed,
                 "service_started": lambda _: None}  # fmt: skip
        waits[condition](service)

    def up(self, stand_ins: dict[str, Any]) -> None:
        for service in start_order(self.services):
            for dep, spec in self.services[service].get("depends_on", {}).items():
                if dep not in stand_ins:
                    self.wait_for(dep, spec["condition"])
            if service not in stand_ins:
                self.start(service)

    def down(self) -> None:
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


# --- Jaeger's stand-in --------------------------------------------------------------------------


class SpanCollector:
    """An OTLP/gRPC trace receiver on a loopback port that records each span's service.name."""

    def __init__(self, port: int) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        collector = self

        class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
                for spans in request.resource_spans:
                    attributes = {a.key: a.value.string_value for a in spans.resource.attributes}
                    count = sum(len(scope.spans) for scope in spans.scope_spans)
                    name = attributes.get("service.name", "")
                    collector.span_counts[name] = collector.span_counts.get(name, 0) + count
                return trace_service_pb2.ExportTraceServiceResponse()

        self.span_counts: dict[str, int] = {}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)


# --- Fixtures and tests -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Deployment:
    compose: LocalCompose
    collector: SpanCollector
    gateway: str
    api_key: str


@pytest.fixture(scope="module")
def deployment(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    document = yaml.safe_load(COMPOSE.read_text())
    services = document["services"]
    workdir = tmp_path_factory.mktemp("compose")
    # The model-cache volume is this machine's model cache, where the default model already is.
    local = LocalMap.build(services, {"model-cache": default_model_dir.parents[1]})
    # infra/.env as a user writes it: .env.example with the secrets filled in.
    api_key = secrets.token_hex(16)
    env_file = _read_env_file(ENV_EXAMPLE) | {"TANDEM_API_KEYS": api_key, "TANDEM_INTERNAL_TOKEN": secrets.token_hex(8)}
    compose = LocalCompose(services, local, env_file, workdir)
    collector = SpanCollector(local.port("jaeger", 4317))
    try:
        compose.up(stand_ins={"jaeger": collector})
        compose.wait_healthy("gateway")
        gateway_port = int(services["gateway"]["command"][services["gateway"]["command"].index("--port") + 1])
        yield Deployment(compose, collector, f"127.0.0.1:{local.port('gateway', gateway_port)}", api_key)
    finally:
        compose.down()
        collector.stop()


def generate(deployment: Deployment, prompt: str) -> list[Any]:
    from tandem.v1 import gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerateRequest(prompt=prompt, sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0})
    with grpc.insecure_channel(deployment.gateway) as channel:
        stub = gateway_pb2_grpc.GenerateServiceStub(channel)
        metadata = [("authorization", f"Bearer {deployment.api_key}")]
        return list(stub.Generate(request, metadata=metadata, timeout=120))


@pytest.fixture(scope="module")
def greedy_runs(deployment: Deployment) -> dict[str, list[Any]]:
    return {prompt: generate(deployment, prompt) for prompt in PROMPTS}


def test_every_health_check_in_the_file_passes(deployment: Deployment) -> None:
    compose = deployment.compose
    assert compose.processes["model-init"].returncode == 0
    for service, process in compose.processes.items():
        if "test" in compose.services[service]["healthcheck"]:
            assert process.poll() is None, f"{service} exited\n{compose.log_tail(service)}"
            result = compose.health_check(service)
            assert result.returncode == 0, f"{service}: {result.stdout}{result.stderr}\n{compose.log_tail(service)}"


def test_greedy_generation_through_the_gateway_matches_hf(
    default_model_dir: Path, greedy_runs: dict[str, list[Any]]
) -> None:
    import torch
    from transformers import AutoTokenizer

    from tests.hf_reference import assert_matches, reference_outputs

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    for prompt, reference in zip(PROMPTS, reference_outputs(default_model_dir, prompt_ids, MAX_TOKENS)):
        responses = greedy_runs[prompt]
        tokens = [token for response in responses for token in response.token_ids]
        assert_matches(tokens, reference, label=prompt)
        assert responses[-1].usage.prompt_tokens == len(reference.prompt_ids)


def test_the_api_key_from_the_env_file_is_enforced(deployment: Deployment) -> None:
    from tandem.v1 import gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerateRequest(prompt="Hello", sampling={"max_tokens": 1})
    with grpc.insecure_channel(deployment.gateway) as channel:
        stub = gateway_pb2_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, metadata=[("authorization", "Bearer wrong")], timeout=30))
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_every_service_traces_to_jaeger_under_its_own_name(
    deployment: Deployment, greedy_runs: dict[str, list[Any]]
) -> None:
    services = deployment.compose.services
    expected = {
        services[name]["environment"]["OTEL_SERVICE_NAME"]
        for name in ("gateway", "scheduler", "prefill-0", "decode-0")
    }
    deadline = time.monotonic() + 15
    while not expected <= deployment.collector.span_counts.keys() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert expected <= deployment.collector.span_counts.keys(), deployment.collector.span_counts
