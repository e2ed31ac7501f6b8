"""`tandem deploy compose` and `tandem deploy kubernetes`; the compose writer lives here.

infra/docker-compose.yml and infra/docker-compose.cpu.yml are this module's output for one worker
of each role (tests/unit/test_infra.py checks), so the deployment has one source of truth. The
Kubernetes writer is tandem/cli/kubernetes.py; both take their roles and ports from topology.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.common.config import parse_count
from tandem.cli import kubernetes
from tandem.cli.topology import (
    DECODE,
    GATEWAY_HTTP_PORT,
    GATEWAY_PORT,
    PREFILL,
    SCHEDULER_METRICS_PORT,
    SCHEDULER_PORT,
    TANDEM_HOME,
    Role,
    Topology,
)

REDIS_IMAGE = "redis:7.4.1-alpine"
JAEGER_IMAGE = "jaegertracing/all-in-one:1.62.0"
PROMETHEUS_IMAGE = "prom/prometheus:v2.55.1"
GRAFANA_IMAGE = "grafana/grafana:11.3.0"
DASHBOARDS = "/var/lib/grafana/dashboards"
GPU_IMAGE = "${TANDEM_IMAGE:-tandem:gpu}"
CPU_IMAGE = "${TANDEM_CPU_IMAGE:-tandem:cpu}"
# The internal token, interpolated by compose from infra/.env: `docker compose up` stops with this
# message when it is unset or empty. It is also Redis's password.
INTERNAL_TOKEN = "${TANDEM_INTERNAL_TOKEN:?set TANDEM_INTERNAL_TOKEN in infra/.env}"
REDIS_CONFIG = "/usr/local/etc/redis/tandem.conf"


@dataclass(frozen=True, slots=True)
class Worker:
    """One worker container: the `index`-th of its role, holding host GPU `gpu`."""

    role: Role
    index: int
    gpu: int

    @property
    def service(self) -> str:
        return f"{self.role.name}-{self.index}"

    def command(self, device: str, schedulers: str) -> list[str]:
        port = str(self.role.port)
        return [
            self.role.name, "--host", "0.0.0.0", "--port", port,
            "--advertise", f"{self.service}:{port}", "--scheduler", schedulers,
            "--device", device, "--metrics-port", str(self.role.metrics_port),
        ]  # fmt: skip


def scheduler_addresses(topology: Topology) -> str:
    """What every gateway and worker is given as --scheduler: each replica's service, comma-separated."""
    return ",".join(f"{name}:{SCHEDULER_PORT}" for name in topology.scheduler_names)


def worker_containers(topology: Topology) -> list[Worker]:
    """The worker containers of `topology`: prefill workers take the first GPUs, decode the next."""
    prefill = [Worker(PREFILL, i, i) for i in range(topology.prefill)]
    decode = [Worker(DECODE, i, topology.prefill + i) for i in range(topology.decode)]
    return prefill + decode


# --- YAML writing: anchors with chosen names, merge keys, flow lists, compose's !reset ----------


class _Anchored(dict):
    """A mapping written once under `&anchor` and as `*anchor` wherever it is used again."""

    def __init__(self, anchor: str, items: dict[Any, Any]) -> None:
        super().__init__(items)
        self.anchor = anchor


class _Flow(list):
    """A list written on one line: [a, b, c]."""


class _Literal(str):
    """A multi-line string written as a `|` block, as a person would write a config file inline."""


class _MergeKey:
    """The YAML merge key `<<`: the mapping it names supplies the keys this one leaves out."""


class _Reset:
    """Compose's `!reset` tag: an override file removes the attribute from the base file."""


MERGE = _MergeKey()
RESET = _Reset()


class _Dumper(yaml.SafeDumper):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.anchor_names: dict[yaml.Node, str] = {}

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)  # indent list items under their key

    def ignore_aliases(self, data: Any) -> bool:
        return isinstance(data, (_MergeKey, _Reset)) or super().ignore_aliases(data)

    def generate_anchor(self, node: yaml.Node) -> str:
        if node not in self.anchor_names:
            raise ValueError("a mapping or list is shared without an anchor name; use _Anchored")
        return self.anchor_names[node]


def _represent_anchored(dumper: _Dumper, data: _Anchored) -> yaml.Node:
    node = dumper.represent_dict(data)
    dumper.anchor_names[node] = data.anchor
    return node


_Dumper.add_representer(_Anchored, _represent_anchored)
_Dumper.add_representer(_Flow, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, True))
_Dumper.add_representer(_Literal, lambda d, data: d.represent_scalar("tag:yaml.org,2002:str", data, style="|"))
_Dumper.add_representer(_MergeKey, lambda d, _: d.represent_scalar("tag:yaml.org,2002:merge", "<<"))
_Dumper.add_representer(_Reset, lambda d, _: d.represent_mapping("!reset", {}))


def _dump(header: str, document: dict[str, Any]) -> str:
    text = yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=100)
    return header + "\n" + _space_out(text)


def _space_out(text: str) -> str:
    """A blank line before each top-level key and each service, for the reader's eye."""
    lines: list[str] = []
    in_services = False
    for line in text.splitlines():
        top_level = not line.startswith(" ")
        if top_level:
            in_services = line == "services:"
        service = in_services and line.startswith("  ") and not line.startswith("   ")
        if (top_level or service) and lines and lines[-1] != "services:":
            lines.append("")
        lines.append(line)
    return "\n".join(lines) + "\n"


# --- The compose file --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Anchors:
    """The x- extensions that every Tandem service merges in."""

    service: _Anchored
    worker: _Anchored
    environment: _Anchored
    healthcheck: _Anchored


def _anchors(topology: Topology) -> _Anchors:
    service = _Anchored("tandem", {
        "image": GPU_IMAGE,
        "build": {"context": "..", "dockerfile": "infra/docker/Dockerfile"},
        "init": True,
        "env_file": ".env",
        "volumes": [f"model-cache:{TANDEM_HOME}"],
        "networks": ["internal"],
        "restart": "unless-stopped",
        "stop_grace_period": "30s",
    })  # fmt: skip
    worker = _Anchored("tandem-worker", {
        MERGE: service,
        "depends_on": {
            "model-init": {"condition": "service_completed_successfully"},
            **{name: {"condition": "service_healthy"} for name in topology.scheduler_names},
        },
    })  # fmt: skip
    environment = _Anchored("tandem-environment", {
        "TANDEM_HOME": TANDEM_HOME,
        "TANDEM_INTERNAL_TOKEN": INTERNAL_TOKEN,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317",
    })  # fmt: skip
    # start_period covers loading the model onto the GPU; a service is healthy at its first pass.
    healthcheck = _Anchored(
        "tandem-healthcheck", {"interval": "5s", "timeout": "5s", "retries": 12, "start_period": "120s"}
    )
    return _Anchors(service, worker, environment, healthcheck)


def _tandem_service(anchors: _Anchors, base: _Anchored, name: str, command: list[str], port: int) -> dict:
    return {
        MERGE: base,
        "command": _Flow(command),
        "environment": {MERGE: anchors.environment, "OTEL_SERVICE_NAME": f"tandem-{name}"},
        "healthcheck": {MERGE: anchors.healthcheck, "test": _Flow(["CMD", "tandem", "health", f"127.0.0.1:{port}"])},
    }


def _gpu_reservation(gpu: int) -> dict:
    device = {"driver": "nvidia", "device_ids": _Flow([str(gpu)]), "capabilities": _Flow(["gpu"])}
    return {"resources": {"reservations": {"devices": [device]}}}


def _redis() -> dict:
    return {
        "image": REDIS_IMAGE,
        # Soft state only (worker registry, prefix index): workers re-announce it after a restart.
        # The password comes in a config file, not as an argument, which the host's `ps` would show.
        "command": _Flow(["redis-server", REDIS_CONFIG, "--save", "", "--appendonly", "no"]),
        "configs": [{"source": "redis-password", "target": REDIS_CONFIG}],
        "environment": {"REDISCLI_AUTH": INTERNAL_TOKEN},  # for the health check's redis-cli
        "networks": ["internal"],
        "restart": "unless-stopped",
        "healthcheck": {"test": _Flow(["CMD", "redis-cli", "ping"]), "interval": "5s", "timeout": "3s", "retries": 12},
    }


def _jaeger() -> dict:
    return {
        "image": JAEGER_IMAGE,
        "environment": {"COLLECTOR_OTLP_ENABLED": "true", "MEMORY_MAX_TRACES": "100000"},
        "ports": ["127.0.0.1:16686:16686"],
        "networks": ["internal", "public"],
        "restart": "unless-stopped",
        "healthcheck": {
            "test": _Flow(["CMD", "wget", "-q", "--spider", "http://127.0.0.1:14269/"]),
            "interval": "5s",
            "timeout": "3s",
            "retries": 12,
        },
    }


def _model_init(anchors: _Anchors) -> dict:
    return {
        MERGE: anchors.service,
        "command": _Flow(["model", "pull-default"]),
        "environment": {MERGE: anchors.environment, "OTEL_SERVICE_NAME": "tandem-model-init"},
        "restart": "no",
        "healthcheck": {"disable": True},
    }


def _scheduler(anchors: _Anchors, name: str) -> dict:
    command = ["scheduler", "--host", "0.0.0.0", "--port", str(SCHEDULER_PORT),
               "--metrics-port", str(SCHEDULER_METRICS_PORT)]  # fmt: skip
    service = _tandem_service(anchors, anchors.service, name, command, SCHEDULER_PORT)
    # By environment, not argument: the URL carries Redis's password. Every replica shares the one
    # Redis (the worker registry and the prefix index), which is what lets there be several.
    service["environment"]["TANDEM_REDIS_URL"] = f"redis://:{INTERNAL_TOKEN}@redis:6379/0"
    service["depends_on"] = {"redis": {"condition": "service_healthy"}}
    return service


def _worker(anchors: _Anchors, worker: Worker, schedulers: str) -> dict:
    command = worker.command("cuda:0", schedulers)
    service = _tandem_service(anchors, anchors.worker, worker.service, command, worker.role.port)
    service["deploy"] = _gpu_reservation(worker.gpu)
    return service


def _gateway(anchors: _Anchors, topology: Topology, workers: list[Worker]) -> dict:
    command = ["gateway", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT),
               "--http-port", str(GATEWAY_HTTP_PORT), "--scheduler", scheduler_addresses(topology)]  # fmt: skip
    service = _tandem_service(anchors, anchors.service, "gateway", command, GATEWAY_PORT)
    service["ports"] = [f"{GATEWAY_PORT}:{GATEWAY_PORT}", f"{GATEWAY_HTTP_PORT}:{GATEWAY_HTTP_PORT}"]
    service["networks"] = ["internal", "public"]
    service["depends_on"] = {
        "model-init": {"condition": "service_completed_successfully"},
        **{name: {"condition": "service_healthy"} for name in topology.scheduler_names},
        **{w.service: {"condition": "service_healthy"} for w in workers},
    }
    return service


def compose_document(topology: Topology) -> dict[str, Any]:
    """The compose file as data, anchors included (what `render_compose` writes)."""
    anchors = _anchors(topology)
    workers = worker_containers(topology)
    schedulers = scheduler_addresses(topology)
    services = {"redis": _redis(), "jaeger": _jaeger(), "model-init": _model_init(anchors)}
    services.update({name: _scheduler(anchors, name) for name in topology.scheduler_names})
    services.update({w.service: _worker(anchors, w, schedulers) for w in workers})
    services["gateway"] = _gateway(anchors, topology, workers)
    return {
        "name": "tandem",
        "x-tandem": anchors.service,
        "x-tandem-worker": anchors.worker,
        "x-tandem-environment": anchors.environment,
        "x-tandem-healthcheck": anchors.healthcheck,
        "services": services,
        "networks": {"internal": {"internal": True}, "public": {}},
        "volumes": {"model-cache": {}},
        "configs": {"redis-password": {"content": f"requirepass {INTERNAL_TOKEN}"}},
    }


def cpu_override_document(topology: Topology) -> dict[str, Any]:
    """The override that runs the same services on the CPU image, without GPU reservations."""
    cpu = _Anchored("tandem-cpu", {
        "image": CPU_IMAGE,
        "build": {"context": "..", "dockerfile": "infra/docker/Dockerfile.cpu"},
    })  # fmt: skip
    services: dict[str, Any] = {"model-init": {MERGE: cpu}}
    services.update({name: {MERGE: cpu} for name in topology.scheduler_names})
    schedulers = scheduler_addresses(topology)
    for worker in worker_containers(topology):
        command = _Flow(worker.command("cpu", schedulers))
        services[worker.service] = {MERGE: cpu, "command": command, "deploy": RESET}
    services["gateway"] = {MERGE: cpu}
    return {"x-tandem-cpu": cpu, "services": services}


def _scrape_targets(topology: Topology) -> list[str]:
    """Every service's /metrics: the gateway's HTTP port, the others' metrics ports."""
    schedulers = [f"{name}:{SCHEDULER_METRICS_PORT}" for name in topology.scheduler_names]
    workers = [f"{w.service}:{w.role.metrics_port}" for w in worker_containers(topology)]
    return [f"gateway:{GATEWAY_HTTP_PORT}", *schedulers, *workers]


def _prometheus_config(topology: Topology) -> str:
    config = {
        "global": {"scrape_interval": "15s"},
        "scrape_configs": [{"job_name": "tandem", "static_configs": [{"targets": _scrape_targets(topology)}]}],
    }
    return yaml.safe_dump(config, sort_keys=False)


def monitoring_document(topology: Topology) -> dict[str, Any]:
    """The override that adds Prometheus (scraping every service) and Grafana with the dashboard."""
    datasources = {"apiVersion": 1, "datasources": [{
        "name": "Prometheus", "uid": "prometheus", "type": "prometheus", "access": "proxy",
        "url": "http://prometheus:9090", "isDefault": True}]}  # fmt: skip
    dashboards = {"apiVersion": 1, "providers": [{"name": "tandem", "type": "file", "options": {"path": DASHBOARDS}}]}
    prometheus = {
        "image": PROMETHEUS_IMAGE,
        "configs": [{"source": "prometheus", "target": "/etc/prometheus/prometheus.yml"}],
        "networks": ["internal"],
        "restart": "unless-stopped",
        "healthcheck": {"test": _Flow(["CMD", "wget", "-q", "--spider", "http://127.0.0.1:9090/-/ready"]),
                        "interval": "5s", "timeout": "3s", "retries": 12},
    }  # fmt: skip
    grafana = {
        "image": GRAFANA_IMAGE,
        "environment": {"GF_AUTH_ANONYMOUS_ENABLED": "true", "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
                        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": f"{DASHBOARDS}/tandem.json"},
        "configs": [
            {"source": "grafana-datasources", "target": "/etc/grafana/provisioning/datasources/tandem.yml"},
            {"source": "grafana-dashboards", "target": "/etc/grafana/provisioning/dashboards/tandem.yml"},
            {"source": "grafana-dashboard", "target": f"{DASHBOARDS}/tandem.json"},
        ],
        "ports": ["127.0.0.1:3000:3000"],
        "networks": ["internal", "public"],
        "restart": "unless-stopped",
        "depends_on": {"prometheus": {"condition": "service_healthy"}},
    }  # fmt: skip
    return {
        "services": {"prometheus": prometheus, "grafana": grafana},
        "configs": {
            "prometheus": {"content": _Literal(_prometheus_config(topology))},
            "grafana-datasources": {"content": _Literal(yaml.safe_dump(datasources, sort_keys=False))},
            "grafana-dashboards": {"content": _Literal(yaml.safe_dump(dashboards, sort_keys=False))},
            "grafana-dashboard": {"file": "grafana/tandem.json"},
        },
    }


def render_monitoring(topology: Topology) -> str:
    header = f"""\
# Prometheus scraping every Tandem service, and Grafana with the Tandem dashboard
# (infra/grafana/tandem.json) at http://127.0.0.1:3000. Layer it on the base file:
#
#   docker compose -f infra/docker-compose.yml -f infra/docker-compose.monitoring.yml up -d
#
# Generated by `{_command_line(topology, cpu=False)} --monitoring`.
"""
    return _dump(header, monitoring_document(topology))


def _command_line(topology: Topology, cpu: bool) -> str:
    flags = f" --schedulers {topology.schedulers}" if topology.schedulers > 1 else ""
    flags += " --cpu" if cpu else ""
    return f"tandem deploy compose --prefill {topology.prefill} --decode {topology.decode}{flags}"


def render_compose(topology: Topology) -> str:
    workers = "worker" if topology.num_gpus == 2 else "workers"
    schedulers = f"{topology.schedulers} schedulers sharing redis" if topology.schedulers > 1 else "the scheduler"
    header = f"""\
# Tandem with docker compose: redis, jaeger, {schedulers}, the gateway, {topology.prefill} prefill and
# {topology.decode} decode {workers}, one GPU each ({topology.num_gpus} GPUs). See infra/README.md.
#
#   cp infra/.env.example infra/.env     # then set the secrets in infra/.env
#   docker compose -f infra/docker-compose.yml up -d
#
# Generated by `{_command_line(topology, cpu=False)}`: change tandem/cli/deploy.py and
# regenerate instead of editing by hand (tests/unit/test_infra.py checks the two agree).
#
# GPUs: each worker reserves one host GPU by device_ids. The NVIDIA runtime shows a container only
# the GPUs it reserved, numbered from 0, so inside every worker its own GPU is cuda:0 and every
# worker passes --device cuda:0 whichever host GPU it holds.
"""
    return _dump(header, compose_document(topology))


def render_cpu_override(topology: Topology) -> str:
    header = f"""\
# Tandem without GPUs (laptops, CI): the same services on the CPU image. Layer it on the GPU file:
#
#   docker compose -f infra/docker-compose.yml -f infra/docker-compose.cpu.yml up -d
#
# Generated by `{_command_line(topology, cpu=True)}`. `!reset` drops the GPU
# reservations (docker compose 2.24.4 or later).
"""
    return _dump(header, cpu_override_document(topology))


# --- The command -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    targets = parser.add_subparsers(dest="deploy_target", metavar="TARGET", required=True)
    compose = targets.add_parser(
        "compose",
        help="write a docker compose file for N prefill and M decode workers, one GPU each",
        description="Write a docker compose file for N prefill and M decode workers, one GPU each "
        "(prefill workers take GPUs 0..N-1, decode workers the next M).",
    )
    compose.add_argument("--prefill", type=parse_count, default=1, metavar="N", help="prefill workers (default 1)")
    compose.add_argument("--decode", type=parse_count, default=1, metavar="M", help="decode workers (default 1)")
    compose.add_argument("--schedulers", type=parse_count, default=1, metavar="N",
                         help="scheduler replicas sharing the Redis; every gateway and worker lists them all "
                              "(default 1)")
    compose.add_argument(
        "--cpu",
        action="store_true",
        help="write the CPU override for this topology instead (use it as a second -f)",
    )
    compose.add_argument(
        "--monitoring",
        action="store_true",
        help="write the override that adds Prometheus and Grafana (with the dashboard) instead",
    )
    compose.add_argument("--output", "-o", type=Path, metavar="FILE", help="file to write (default: standard output)")
    _add_kubernetes_arguments(targets.add_parser(
        "kubernetes",
        help="write Kubernetes manifests: per-role replicas, GPU or CPU profile, probes, ServiceMonitor",
        description="Write the Kubernetes manifests of a deployment, one file per component "
        "(see infra/kubernetes/README.md). Flags override --values.",
    ))  # fmt: skip


def _add_kubernetes_arguments(parser: argparse.ArgumentParser) -> None:
    for role in ("gateway", "prefill", "decode"):
        parser.add_argument(f"--{role}", type=parse_count, metavar="N", help=f"{role} replicas (default 1)")
    parser.add_argument("--schedulers", type=parse_count, metavar="N",
                        help="scheduler replicas (default 1): a StatefulSet sharing the Redis, each replica named "
                        "tandem-scheduler-I.tandem-scheduler, every gateway and worker given them all")
    parser.add_argument("--profile", choices=[p.value for p in kubernetes.Profile],
                        help="gpu: one nvidia.com/gpu per worker pod (default); cpu: workers on the CPU")
    parser.add_argument("--image", help="the Tandem image, in a registry the cluster can pull from "
                        "(default tandem:gpu or tandem:cpu)")
    parser.add_argument("--placement", choices=[p.value for p in kubernetes.Placement],
                        help="prefill and decode pods: share nodes when they can (default), "
                        "separate (never on one node), or any")
    parser.add_argument("--service-type", choices=kubernetes.SERVICE_TYPES,
                        help="the gateway Service's type (default ClusterIP)")
    parser.add_argument("--no-service-monitor", dest="service_monitor", action="store_false", default=None,
                        help=f"leave out {kubernetes.MONITORING_FILE} (Prometheus Operator)")
    parser.add_argument("--values", type=Path, metavar="FILE",
                        help="a YAML file of the same settings (replicas: {prefill: 2}, profile: cpu, ...)")
    parser.add_argument("--with-secret", action="store_true",
                        help="also write secret.yaml, the internal token's Secret with a fresh random token "
                        "(keep it out of version control)")
    parser.add_argument("--output", "-o", type=Path, metavar="DIR",
                        help="directory to write the files to (default: one stream on standard output)")


def kubernetes_spec(args: argparse.Namespace) -> kubernetes.KubernetesSpec:
    """The spec from --values, then the flags given on the command line."""
    values: dict[str, Any] = {}
    if args.values is not None:
        values = yaml.safe_load(args.values.read_text(encoding="utf-8")) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{args.values}: expected a mapping of settings, got {type(values).__name__}")
    replicas = {role: getattr(args, role) for role in ("gateway", "prefill", "decode") if getattr(args, role)}
    if args.schedulers:
        replicas["scheduler"] = args.schedulers
    values["replicas"] = {**values.get("replicas", {}), **replicas}
    for name in ("profile", "image", "placement", "service_type", "service_monitor"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return kubernetes.KubernetesSpec.from_values(values)


def _main_kubernetes(args: argparse.Namespace) -> int:
    try:
        spec = kubernetes_spec(args)
    except (ValueError, TypeError, OSError, yaml.YAMLError) as exc:
        print(f"tandem deploy kubernetes: {exc}", file=sys.stderr)
        return 2
    secret = [kubernetes.token_secret()] if args.with_secret else []
    if args.output is None:
        sys.stdout.write(kubernetes.render_stream(spec) + (kubernetes.dump_all(secret) if secret else ""))
        return 0
    files = kubernetes.render_files(spec)
    for name, text in files.items():
        path = args.output / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if secret:
        path = args.output / "secret.yaml"
        path.write_text(kubernetes.dump_all(secret), encoding="utf-8")
        path.chmod(0o600)
    print(f"wrote {len(files) + len(secret)} files to {args.output} ({kubernetes.command_line(spec)})", file=sys.stderr)
    return 0


def main(args: argparse.Namespace) -> int:
    if args.deploy_target == "kubernetes":
        return _main_kubernetes(args)
    topology = Topology(args.prefill, args.decode, args.schedulers)
    if args.cpu and args.monitoring:
        print("tandem deploy compose: --cpu and --monitoring write different files; give one", file=sys.stderr)
        return 2
    render = render_cpu_override if args.cpu else render_monitoring if args.monitoring else render_compose
    text = render(topology)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    args.output.write_text(text, encoding="utf-8")
    uses = "no GPU" if args.cpu or args.monitoring else f"GPUs 0-{topology.num_gpus - 1}"
    replicas = f", {topology.schedulers} schedulers" if topology.schedulers > 1 else ""
    print(f"wrote {args.output} ({topology.prefill} prefill + {topology.decode} decode{replicas}, {uses})",
          file=sys.stderr)
    return 0
