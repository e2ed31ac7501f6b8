"""`tandem deploy kubernetes`: the Kubernetes manifests of a Tandem deployment across many nodes.

`kubernetes_objects(spec)` turns a `KubernetesSpec` into plain manifest dictionaries, one pure
function per component; `render_files` lays them out one file per component. infra/kubernetes/ is
the output for the default spec (tests/unit/test_kubernetes.py checks it, and validates every
object against the Kubernetes schemas). The seam for a Helm chart is `KubernetesSpec.from_values`:
its keys are the chart's values.yaml, so a chart can render its templates with this module.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

import yaml

from tandem.cli.topology import (
    DECODE,
    GATEWAY_HTTP_PORT,
    GATEWAY_PORT,
    PREFILL,
    SCHEDULER_METRICS_PORT,
    SCHEDULER_PORT,
    TANDEM_HOME,
    Role,
)

REDIS_IMAGE = "redis:7.4.1-alpine"
REDIS_PORT = 6379
TOKEN_SECRET, TOKEN_KEY = "tandem-internal", "token"
API_KEYS_SECRET, API_KEYS_KEY = "tandem-api-keys", "keys"
PART_OF = {"app.kubernetes.io/part-of": "tandem"}
UID = 10001  # the images' unprivileged user
# A worker loads the model before it reports SERVING; the startup probe allows it 10 minutes.
STARTUP_FAILURES, PROBE_PERIOD = 120, 5
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
# Each with its own replica count: the schedulers a StatefulSet (a stable name per replica), the rest Deployments.
ROLES = ("scheduler", "prefill", "decode", "gateway")


class Placement(StrEnum):
    """Where prefill and decode pods go relative to each other.

    share: prefer the same nodes (the KV hand-off then stays on the host); separate: never on the
    same node (each role's GPUs sized for its own bottleneck); any: no rule.
    """

    SHARE = "share"
    SEPARATE = "separate"
    ANY = "any"


class Profile(StrEnum):
    """gpu: each worker pod takes one `nvidia.com/gpu` and runs on cuda:0; cpu: no GPU, CPU requests."""

    GPU = "gpu"
    CPU = "cpu"


@dataclass(frozen=True, slots=True)
class KubernetesSpec:
    """Everything a deployment varies; each field is also a Helm value of the same name."""

    replicas: Mapping[str, int] = field(default_factory=lambda: {"gateway": 1, "scheduler": 1, "prefill": 1,
                                                                 "decode": 1})  # fmt: skip
    profile: Profile = Profile.GPU
    image: str | None = None  # none: tandem:gpu or tandem:cpu, after the profile
    placement: Placement = Placement.SHARE
    service_type: str = "ClusterIP"
    service_monitor: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.replicas) - set(ROLES)
        if unknown:
            raise ValueError(f"replicas: unknown roles {sorted(unknown)}; the roles are {list(ROLES)}")
        for role, count in self.replicas.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"replicas.{role} must be a whole number, at least 1, got {count!r}")
        if self.service_type not in SERVICE_TYPES:
            raise ValueError(f"service_type must be one of {SERVICE_TYPES}, got {self.service_type!r}")

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> KubernetesSpec:
        """A spec from a Helm-style values mapping (unknown keys are an error, not ignored)."""
        names = {f.name for f in fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown values {sorted(unknown)}; known: {sorted(names)}")
        given = dict(values)
        if "replicas" in given:
            if not isinstance(given["replicas"], Mapping):
                raise ValueError(f"replicas must map roles to counts, e.g. {{decode: 2}}; got {given['replicas']!r}")
            given["replicas"] = {**cls().replicas, **given["replicas"]}
        for key, kind in (("profile", Profile), ("placement", Placement)):
            if key in given:
                given[key] = kind(given[key])
        return cls(**given)

    def count(self, role: str) -> int:
        return self.replicas.get(role, 1)

    @property
    def container_image(self) -> str:
        return self.image or f"tandem:{self.profile}"


# --- Pieces every Tandem container shares ------------------------------------------------------


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": f"tandem-{component}", "app.kubernetes.io/component": component, **PART_OF}


def _metadata(component: str, **extra: Any) -> dict[str, Any]:
    return {"name": f"tandem-{component}", "labels": _labels(component), **extra}


def _grpc_probes(port: int) -> dict[str, Any]:
    """Kubelet's own gRPC health checks (grpc.health.v1, which answers without the token)."""
    grpc = {"port": port}
    return {
        "startupProbe": {"grpc": grpc, "periodSeconds": PROBE_PERIOD, "failureThreshold": STARTUP_FAILURES},
        "readinessProbe": {"grpc": grpc, "periodSeconds": PROBE_PERIOD, "failureThreshold": 2},
        "livenessProbe": {"grpc": grpc, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def _env(component: str) -> list[dict[str, Any]]:
    token = {"secretKeyRef": {"name": TOKEN_SECRET, "key": TOKEN_KEY}}
    return [
        {"name": "TANDEM_HOME", "value": TANDEM_HOME},
        {"name": "TANDEM_INTERNAL_TOKEN", "valueFrom": token},
        {"name": "OTEL_SERVICE_NAME", "value": f"tandem-{component}"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def _ports(**ports: int) -> list[dict[str, Any]]:
    return [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports.items()]


def _security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _container(spec: KubernetesSpec, component: str, args: list[str], ports: dict[str, int]) -> dict[str, Any]:
    return {
        "name": component,
        "image": spec.container_image,
        "args": args,
        "env": _env(component),
        "ports": _ports(**ports),
        **_grpc_probes(ports["grpc"]),
        "volumeMounts": [{"name": "model-cache", "mountPath": TANDEM_HOME}],
        "securityContext": _security(),
    }


def _model_init(spec: KubernetesSpec) -> dict[str, Any]:
    """Writes the default model into the pod's model cache before the service starts."""
    return {
        "name": "model-init",
        "image": spec.container_image,
        "args": ["model", "pull-default"],
        "env": [{"name": "TANDEM_HOME", "value": TANDEM_HOME}],
        "volumeMounts": [{"name": "model-cache", "mountPath": TANDEM_HOME}],
        "securityContext": _security(),
    }


def _pod(spec: KubernetesSpec, component: str, container: dict[str, Any], model: bool) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID},
        "terminationGracePeriodSeconds": 30,
        **({"initContainers": [_model_init(spec)]} if model else {}),
        "containers": [container],
        "volumes": [{"name": "model-cache", "emptyDir": {}}],
        "topologySpreadConstraints": [_spread(component)],
    }
    affinity = _affinity(spec.placement, component)
    if affinity:
        pod["affinity"] = affinity
    return pod


def _spread(component: str) -> dict[str, Any]:
    """Replicas of one role spread over nodes when they can (never blocks scheduling)."""
    return {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": _labels(component)},
    }


def _affinity(placement: Placement, component: str) -> dict[str, Any] | None:
    others = {PREFILL.name: DECODE.name, DECODE.name: PREFILL.name}
    if component not in others or placement is Placement.ANY:
        return None
    term = {"labelSelector": {"matchLabels": _labels(others[component])}, "topologyKey": "kubernetes.io/hostname"}
    if placement is Placement.SEPARATE:
        return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}}


def _workload(spec: KubernetesSpec, kind: str, component: str, pod: dict[str, Any], **settings: Any) -> dict[str, Any]:
    """A Deployment or StatefulSet of `spec.count(component)` copies of `pod`."""
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": _metadata(component),
        "spec": {
            "replicas": spec.count(component),
            **settings,
            "selector": {"matchLabels": _labels(component)},
            "template": {"metadata": {"labels": _labels(component)}, "spec": pod},
        },
    }


def _service(component: str, ports: dict[str, int], **extra: Any) -> dict[str, Any]:
    service_ports = [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in ports.items()]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(component),
        "spec": {"selector": _labels(component), "ports": service_ports, **extra},
    }


# --- The components ----------------------------------------------------------------------------


def _redis() -> list[dict[str, Any]]:
    """Soft state only (registry, prefix index); its password, the internal token, comes by file."""
    token = {"name": "TANDEM_INTERNAL_TOKEN", "valueFrom": {"secretKeyRef": {"name": TOKEN_SECRET, "key": TOKEN_KEY}}}
    config = {"name": "config", "mountPath": "/config"}
    write_config = {
        "name": "config",
        "image": REDIS_IMAGE,
        "command": ["sh", "-c", 'printf "requirepass %s\\n" "$TANDEM_INTERNAL_TOKEN" > /config/redis.conf'],
        "env": [token],
        "volumeMounts": [config],
        "securityContext": _security(),
    }
    ping = {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5}
    server = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "command": ["redis-server", "/config/redis.conf", "--save", "", "--appendonly", "no"],
        "env": [{"name": "REDISCLI_AUTH", "valueFrom": token["valueFrom"]}],
        "ports": _ports(redis=REDIS_PORT),
        "readinessProbe": ping,
        "livenessProbe": {**ping, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [config],
        "securityContext": _security(),
    }
    pod = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 999, "runAsGroup": 999},
        "initContainers": [write_config],
        "containers": [server],
        "volumes": [{"name": "config", "emptyDir": {"medium": "Memory"}}],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata("redis"),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": _labels("redis")},
            "template": {"metadata": {"labels": _labels("redis")}, "spec": pod},
        },
    }
    return [deployment, _service("redis", {"redis": REDIS_PORT})]


def scheduler_addresses(spec: KubernetesSpec) -> str:
    """What every gateway and worker is given as --scheduler: each replica's stable DNS name
    (pod `tandem-scheduler-i` of the StatefulSet, under its headless Service), comma-separated."""
    return ",".join(f"tandem-scheduler-{i}.tandem-scheduler:{SCHEDULER_PORT}" for i in range(spec.count("scheduler")))


def _scheduler(spec: KubernetesSpec) -> list[dict[str, Any]]:
    """The replicas share Redis (registry and prefix index); the gateways and workers call each by
    its own name, so the Service is headless and publishes a replica's name before it is ready
    (its callers skip a replica they cannot reach)."""
    ports = {"grpc": SCHEDULER_PORT, "metrics": SCHEDULER_METRICS_PORT}
    args = ["scheduler", "--host", "0.0.0.0", "--port", str(SCHEDULER_PORT),
            "--metrics-port", str(SCHEDULER_METRICS_PORT)]  # fmt: skip
    container = _container(spec, "scheduler", args, ports)
    # Kubernetes expands $(TANDEM_INTERNAL_TOKEN) from the variable defined before it.
    redis_url = f"redis://:$(TANDEM_INTERNAL_TOKEN)@tandem-redis:{REDIS_PORT}/0"
    container["env"].append({"name": "TANDEM_REDIS_URL", "value": redis_url})
    container["resources"] = {"requests": {"cpu": "500m", "memory": "512Mi"}}
    pod = _pod(spec, "scheduler", container, model=False)
    # Pods tandem-scheduler-0, -1, ... start together (Parallel): none waits for another's readiness.
    workload = _workload(spec, "StatefulSet", "scheduler", pod, serviceName="tandem-scheduler",
                         podManagementPolicy="Parallel")
    return [workload, _service("scheduler", ports, clusterIP="None", publishNotReadyAddresses=True)]


def _worker(spec: KubernetesSpec, role: Role) -> list[dict[str, Any]]:
    ports = {"grpc": role.port, "metrics": role.metrics_port}
    device = "cuda:0" if spec.profile is Profile.GPU else "cpu"
    args = [role.name, "--host", "0.0.0.0", "--port", str(role.port), "--advertise", f"$(POD_IP):{role.port}",
            "--scheduler", scheduler_addresses(spec), "--device", device,
            "--metrics-port", str(role.metrics_port)]  # fmt: skip
    container = _container(spec, role.name, args, ports)
    container["resources"] = _worker_resources(spec.profile)
    # Headless: peers reach a worker by the pod address it registers; the Service is for scraping.
    service = _service(role.name, ports, clusterIP="None")
    return [_workload(spec, "Deployment", role.name, _pod(spec, role.name, container, model=True)), service]


def _worker_resources(profile: Profile) -> dict[str, Any]:
    if profile is Profile.GPU:
        return {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"nvidia.com/gpu": 1}}
    return {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}


def _gateway(spec: KubernetesSpec) -> list[dict[str, Any]]:
    ports = {"grpc": GATEWAY_PORT, "http": GATEWAY_HTTP_PORT}
    args = ["gateway", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT), "--http-port", str(GATEWAY_HTTP_PORT),
            "--scheduler", scheduler_addresses(spec)]  # fmt: skip
    container = _container(spec, "gateway", args, ports)
    keys = {"secretKeyRef": {"name": API_KEYS_SECRET, "key": API_KEYS_KEY, "optional": True}}
    container["env"].append({"name": "TANDEM_API_KEYS", "valueFrom": keys})
    container["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}}
    service = _service("gateway", ports, type=spec.service_type)
    return [_workload(spec, "Deployment", "gateway", _pod(spec, "gateway", container, model=True)), service]


def _service_monitor() -> dict[str, Any]:
    """For the Prometheus Operator: scrapes the `metrics` port of every Tandem Service, the gateway's `http`."""
    endpoints = [{"port": port, "path": "/metrics", "interval": "15s"} for port in ("metrics", "http")]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "tandem", "labels": dict(PART_OF)},
        "spec": {"selector": {"matchLabels": dict(PART_OF)}, "endpoints": endpoints},
    }


def token_secret(token: str | None = None) -> dict[str, Any]:
    """The internal token's Secret, with a fresh random token unless one is given."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": TOKEN_SECRET, "labels": dict(PART_OF)},
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token or secrets.token_hex(32)},
    }


def kubernetes_objects(spec: KubernetesSpec) -> dict[str, list[dict[str, Any]]]:
    """The manifests by file name (without `.yaml`), in the order `kubectl apply` should see them."""
    objects = {
        "redis": _redis(),
        "scheduler": _scheduler(spec),
        "prefill": _worker(spec, PREFILL),
        "decode": _worker(spec, DECODE),
        "gateway": _gateway(spec),
    }
    if spec.service_monitor:
        objects["servicemonitor"] = [_service_monitor()]
    return objects


# --- Files and the command ---------------------------------------------------------------------

MONITORING_FILE = "monitoring/servicemonitor.yaml"


def _file_name(component: str) -> str:
    return MONITORING_FILE if component == "servicemonitor" else f"{component}.yaml"


def command_line(spec: KubernetesSpec) -> str:
    """The `tandem deploy kubernetes` invocation that renders `spec` (written into each file)."""
    flags = [f"--{role} {spec.count(role)}" for role in ("gateway", "prefill", "decode")]
    if spec.count("scheduler") > 1:
        flags.append(f"--schedulers {spec.count('scheduler')}")
    defaults = KubernetesSpec()
    for name in ("profile", "image", "placement", "service_type"):
        value = getattr(spec, name)
        if value != getattr(defaults, name):
            flags.append(f"--{name.replace('_', '-')} {value}")
    if not spec.service_monitor:
        flags.append("--no-service-monitor")
    return " ".join(["tandem deploy kubernetes", *flags])


def render_files(spec: KubernetesSpec) -> dict[str, str]:
    """File name (relative to the output directory) -> its YAML, one file per component."""
    header = (
        f"# Generated by `{command_line(spec)} -o DIR`:\n"
        "# change tandem/cli/kubernetes.py and regenerate instead of editing by hand.\n"
        "# See infra/kubernetes/README.md.\n"
    )
    return {_file_name(name): header + dump_all(objects) for name, objects in kubernetes_objects(spec).items()}


def render_stream(spec: KubernetesSpec) -> str:
    """All the manifests as one multi-document stream (for `kubectl apply -f -` or a Helm post-renderer)."""
    return dump_all([obj for objects in kubernetes_objects(spec).values() for obj in objects])


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # every object written out in full: manifests are read by people and kubectl


def dump_all(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=110, explicit_start=True)
