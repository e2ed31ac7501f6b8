"""infra/docker-compose.yml run as local processes: its commands, environment and health checks.

Every service starts from the compose file's own `command` and `environment`, in its
`depends_on` order, on the network of tests/integration/compose_network.py: as root, its own
network namespace, where the compose names resolve and its arguments run unmodified; otherwise
loopback ports. The model-cache volume is the local model cache, GPU reservations are ignored and
`--device cuda:N` runs on the CPU; a stand-in OTLP collector plays Jaeger. Variables are
interpolated from the env file, as compose does, and configs become local files. This proves the
flags, variables and health checks written in the compose file are the ones the services accept.
Each test runs on the checked-in file and on `tandem deploy compose --schedulers 2`'s (two scheduler
replicas sharing the Redis, every gateway and worker listing both).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
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

from tandem.cli import deploy
from tandem.cli.topology import Topology
from tests.compose_env import interpolate
from tests.integration.compose_network import LISTEN_FLAGS, ComposeNetwork, open_network
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "infra" / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "infra" / ".env.example"
TANDEM = Path(sys.executable).parent / "tandem"
# Sized for a 2-core CI machine; the compose file leaves these at the services' defaults.
LOCAL_SETTINGS = {"TANDEM_THREADS": "1", "TANDEM_KV_MEMORY": "256MiB", "OTEL_BSP_SCHEDULE_DELAY": "200"}
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # two KV blocks to transfer
# Prompts of other first tokens: the gateway chooses a request's scheduler by its leading prefix
# (services/gateway/replica_choice.py), and these reach each replica of --schedulers 2.
SPREAD_PROMPTS = [", ".join(str(k) for k in range(start, start + 10)) + "," for start in range(11, 90, 10)]
MAX_TOKENS = 16

pytestmark = pytest.mark.slow


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


def volume_mounts(services: dict[str, Any], volumes: dict[str, Path]) -> dict[str, dict[str, Path]]:
    """service -> container path -> the local directory that plays its named volume."""
    return {
        name: {target: volumes[source] for source, target in (v.split(":", 1) for v in svc.get("volumes", []))}
        for name, svc in services.items()
    }


def config_files(document: dict[str, Any], directory: Path) -> dict[str, dict[str, Path]]:
    """service -> container path -> a local file holding the config mounted there (inline `content`)."""
    directory.mkdir(parents=True, exist_ok=True)
    mounts: dict[str, dict[str, Path]] = {}
    for name, service in document["services"].items():
        for config in service.get("configs", []):
            path = directory / config["source"]
            path.write_text(document["configs"][config["source"]]["content"])
            mounts.setdefault(name, {})[config["target"]] = path
    return mounts


@dataclass(slots=True)
class LocalCompose:
    """The compose file's services as processes on this machine, started in dependency order."""

    services: dict[str, Any]
    network: ComposeNetwork
    mounts: dict[str, dict[str, Path]]
    env_file: dict[str, str]
    workdir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def rewrite(self, service: str, text: str) -> str:
        """A command argument or variable of `service`, with its paths and addresses made local."""
        for target, local in self.mounts[service].items():
            if text == target or text.startswith(target + "/"):
                text = str(local) + text[len(target):]
        return self.network.rewrite(service, text)

    def command(self, service: str, args: list[str]) -> list[str]:
        local = [self.rewrite(service, arg) for arg in args]
        for i, arg in enumerate(args[:-1]):
            if arg in LISTEN_FLAGS:
                local[i + 1] = str(self.network.port(service, int(args[i + 1])))
            elif arg == "--device" and args[i + 1].startswith("cuda"):
                local[i + 1] = "cpu"  # GPU reservations are ignored here
        return local

    def command_argv(self, service: str) -> list[str]:
        """What the container runs: a Tandem image's command goes to its ENTRYPOINT, `tandem`."""
        command = self.services[service]["command"]
        return self.exec_argv(service, ["tandem", *command] if "build" in self.services[service] else command)

    def exec_argv(self, service: str, args: list[str]) -> list[str]:
        """`args` as exec'd in the service's container, run here (a health check, a command)."""
        program, *rest = self.command(service, args)
        if program == "tandem":
            argv = [str(TANDEM), *rest]
        elif program == "redis-server":  # as the redis image runs it: every interface, protected mode off
            bind = self.rewrite(service, "0.0.0.0")
            argv = [program, *rest, "--port", self._redis_port(service), "--bind", bind, "--protected-mode", "no"]
        elif program == "redis-cli":
            argv = [program, "-p", self._redis_port(service), *rest]
        else:
            raise ValueError(f"{service}: no local stand-in for {program!r}")
        return [*self.network.exec_prefix(service), *argv]

    def _redis_port(self, service: str) -> str:
        return str(self.network.port(service, 6379))

    def environment(self, service: str) -> dict[str, str]:
        spec = self.services[service]
        outer = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "OTEL_"))}
        env = {**outer, **LOCAL_SETTINGS, "TANDEM_RUN_DIR": str(self.workdir / "run" / service)}
        if "env_file" in spec:
            env |= self.env_file
        env |= {key: self.rewrite(service, str(value)) for key, value in spec.get("environment", {}).items()}
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
    """An OTLP/gRPC trace receiver on a loopback port that counts the spans of each service.name."""

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


COMPOSE_FILES = {
    "checked-in": COMPOSE.read_text,
    "schedulers-2": lambda: deploy.render_compose(Topology(schedulers=2)),
}


@pytest.fixture(scope="module", params=list(COMPOSE_FILES))
def deployment(
    request: pytest.FixtureRequest, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    # infra/.env as a user writes it: .env.example with the secrets filled in.
    api_key = secrets.token_hex(16)
    env_file = _read_env_file(ENV_EXAMPLE) | {"TANDEM_API_KEYS": api_key, "TANDEM_INTERNAL_TOKEN": secrets.token_hex(8)}
    document = interpolate(yaml.safe_load(COMPOSE_FILES[request.param]()), env_file)
    services = document["services"]
    workdir = tmp_path_factory.mktemp("compose")
    # The model-cache volume is this machine's model cache, where the default model already is.
    mounts = volume_mounts(services, {"model-cache": default_model_dir.parents[1]})
    for service, files in config_files(document, workdir / "configs").items():
        mounts[service] |= files
    network = open_network(services)
    compose = LocalCompose(services, network, mounts, env_file, workdir)
    collector: SpanCollector | None = None
    try:
        collector = SpanCollector(network.serve_here("jaeger", 4317))
        compose.up(stand_ins={"jaeger": collector})
        compose.wait_healthy("gateway")
        gateway_port = int(services["gateway"]["command"][services["gateway"]["command"].index("--port") + 1])
        yield Deployment(compose, collector, network.publish("gateway", gateway_port), api_key)
    finally:
        compose.down()
        if collector is not None:
            collector.stop()
        network.close()


def generate(deployment: Deployment, prompt: str) -> list[Any]:
    from tandem.v1 import gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerateRequest(prompt=prompt, sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0})
    with grpc.insecure_channel(deployment.gateway) as channel:
        stub = gateway_pb2_grpc.GenerateServiceStub(channel)
        metadata = [("authorization", f"Bearer {deployment.api_key}")]
        return list(stub.Generate(request, metadata=metadata, timeout=120))


@pytest.fixture(scope="module")
def greedy_run(deployment: Deployment) -> list[Any]:
    return generate(deployment, PROMPT)


def test_every_health_check_in_the_file_passes(deployment: Deployment) -> None:
    compose = deployment.compose
    assert compose.processes["model-init"].returncode == 0
    for service, process in compose.processes.items():
        if "test" in compose.services[service]["healthcheck"]:
            assert process.poll() is None, f"{service} exited\n{compose.log_tail(service)}"
            result = compose.health_check(service)
            assert result.returncode == 0, f"{service}: {result.stdout}{result.stderr}\n{compose.log_tail(service)}"


def test_greedy_generation_through_the_gateway_matches_hf(default_model_dir: Path, greedy_run: list[Any]) -> None:
    import torch
    from transformers import AutoTokenizer

    from tests.hf_reference import assert_matches, reference_outputs

    torch.set_num_threads(1)
    prompt_ids = AutoTokenizer.from_pretrained(default_model_dir)(PROMPT)["input_ids"]
    (reference,) = reference_outputs(default_model_dir, [prompt_ids], MAX_TOKENS)
    tokens = [token for response in greedy_run for token in response.token_ids]
    assert_matches(tokens, reference, label=PROMPT)
    assert greedy_run[-1].usage.prompt_tokens == len(prompt_ids)


def test_the_api_key_from_the_env_file_is_enforced(deployment: Deployment) -> None:
    from tandem.v1 import gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerateRequest(prompt="Hello", sampling={"max_tokens": 1})
    with grpc.insecure_channel(deployment.gateway) as channel:
        stub = gateway_pb2_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, metadata=[("authorization", "Bearer wrong")], timeout=30))
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_every_scheduler_places_requests_and_every_service_traces_under_its_own_name(
    deployment: Deployment, greedy_run: list[Any]
) -> None:
    services = deployment.compose.services
    schedulers = [name for name, service in services.items() if service.get("command", [""])[0] == "scheduler"]
    # One prompt, one replica: greedy and alike; the other prompts reach the other replicas.
    tokens = [token for response in greedy_run for token in response.token_ids]
    assert [token for response in generate(deployment, PROMPT) for token in response.token_ids] == tokens
    for prompt in SPREAD_PROMPTS:
        assert generate(deployment, prompt)[-1].usage.completion_tokens > 0
    expected = {
        service["environment"]["OTEL_SERVICE_NAME"]
        for name, service in services.items()
        if "build" in service and name != "model-init"
    }
    assert len(expected) == len(schedulers) + 3
    wait_until(lambda: expected <= deployment.collector.span_counts.keys(),
               f"spans from every service of {sorted(expected)}")
