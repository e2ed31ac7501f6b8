"""`tandem deploy kubernetes`: every manifest validated against the Kubernetes schemas.

kubernetes-validate bundles the schemas of each Kubernetes release; strict mode refuses unknown
fields, so a misspelt key fails as `kubectl apply --validate=strict` would. The ServiceMonitor is a
Prometheus Operator CRD with no bundled schema: its shape is checked field by field instead.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tandem.cli import deploy, kubernetes
from tandem.cli.kubernetes import KubernetesSpec, Placement, Profile

ROOT = Path(__file__).resolve().parents[2]
RENDERED = ROOT / "infra" / "kubernetes"
# The oldest release these manifests target (gRPC probes are GA since 1.27) and the newest bundled.
VERSIONS = ["1.30", kubernetes_validate.latest_version()]
SPECS = [
    KubernetesSpec(),
    KubernetesSpec(replicas={"gateway": 2, "scheduler": 3, "prefill": 3, "decode": 5}, placement=Placement.SEPARATE),
    KubernetesSpec(profile=Profile.CPU, placement=Placement.ANY, service_type="LoadBalancer", service_monitor=False),
]


def objects(spec: KubernetesSpec) -> list[dict[str, Any]]:
    return [obj for group in kubernetes.kubernetes_objects(spec).values() for obj in group]


def by_kind(spec: KubernetesSpec, *kinds: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects(spec) if o["kind"] in kinds}


def workloads(spec: KubernetesSpec) -> dict[str, dict[str, Any]]:
    return by_kind(spec, "Deployment", "StatefulSet")


def validate(obj: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# --- One source of truth ------------------------------------------------------------------------


def test_infra_kubernetes_is_the_generators_output() -> None:
    expected = kubernetes.render_files(KubernetesSpec())
    found = {str(p.relative_to(RENDERED)): p.read_text() for p in RENDERED.rglob("*.yaml")}
    assert found == expected, "infra/kubernetes differs from the generator: run `tandem deploy kubernetes -o infra/kubernetes`"


def test_the_command_writes_one_file_per_component_and_a_secret_on_request(tmp_path: Path) -> None:
    args = _parser().parse_args(["kubernetes", "--prefill", "2", "--decode", "3", "--with-secret", "-o", str(tmp_path)])
    assert deploy.main(args) == 0
    spec = KubernetesSpec(replicas={"gateway": 1, "scheduler": 1, "prefill": 2, "decode": 3})
    written = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*.yaml")}
    secret = yaml.safe_load(written.pop("secret.yaml"))
    assert written == kubernetes.render_files(spec)
    assert (tmp_path / "secret.yaml").stat().st_mode & 0o777 == 0o600
    assert secret["metadata"]["name"] == "tandem-internal" and len(secret["stringData"]["token"]) == 64
    validate(secret, VERSIONS[-1])


def test_values_file_and_flags_make_one_spec(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("replicas: {prefill: 4, decode: 2, scheduler: 2}\nprofile: cpu\nplacement: separate\n")
    args = _parser().parse_args(["kubernetes", "--values", str(values), "--decode", "6", "--image", "r.io/tandem:1",
                                 "--schedulers", "3"])  # fmt: skip
    assert deploy.kubernetes_spec(args) == KubernetesSpec(
        replicas={"gateway": 1, "scheduler": 3, "prefill": 4, "decode": 6},
        profile=Profile.CPU, image="r.io/tandem:1", placement=Placement.SEPARATE,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicas": {"prefil": 2}}, "replicas: unknown roles ['prefil']"),
        ({"replicas": {"decode": 0}}, "replicas.decode must be a whole number, at least 1, got 0"),
        ({"replicas": {"decode": "two"}}, "replicas.decode must be a whole number, at least 1, got 'two'"),
        ({"replicas": {"redis": 2}}, "replicas: unknown roles ['redis']"),
        ({"replicas": 3}, "replicas must map roles to counts"),
        ({"replicas": {"scheduler": 0}}, "replicas.scheduler must be a whole number, at least 1, got 0"),
        ({"service_type": "Ingress"}, "service_type must be one of"),
        ({"gpus": 2}, "unknown values ['gpus']"),
        ({"profile": "tpu"}, "'tpu' is not a valid Profile"),
    ],
)
def test_bad_values_are_refused_with_what_to_fix(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as error:
        KubernetesSpec.from_values(values)
    assert message in str(error.value)


def test_a_bad_values_file_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("replicas: {decode: 0}\n")
    assert deploy.main(_parser().parse_args(["kubernetes", "--values", str(values)])) == 2
    assert capsys.readouterr().err == "tandem deploy kubernetes: replicas.decode must be a whole number, at least 1, got 0\n"


@pytest.mark.parametrize(
    ("option", "value"), [("--prefill", "0"), ("--gateway", "x"), ("--placement", "near"), ("--schedulers", "0")]
)
def test_bad_flags_exit_2(option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["kubernetes", option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem deploy")
    deploy.add_arguments(parser)
    return parser


# --- The Kubernetes schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("spec", SPECS, ids=["default", "scaled", "cpu"])
def test_every_manifest_follows_the_kubernetes_schema(spec: KubernetesSpec, version: str) -> None:
    checked = [o for o in objects(spec) if o["kind"] != "ServiceMonitor"]
    for obj in checked:
        validate(obj, version)
    assert sorted(o["kind"] for o in checked) == ["Deployment"] * 4 + ["Service"] * 5 + ["StatefulSet"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["spec"].__setitem__("replica", 2), "'replica' was unexpected"),
        (lambda d: d["spec"].__setitem__("replicas", "two"), "'two' is not of type 'integer'"),
        (lambda d: container(d)["readinessProbe"]["grpc"].__setitem__("port", "grpc"), "'grpc' is not of type 'integer'"),
        (lambda d: container(d)["env"][0].__setitem__("value", 5), "5 is not of type 'string'"),
        (lambda d: d["spec"]["template"]["spec"].pop("containers"), "'containers' is a required property"),
    ],
    ids=["misspelt-key", "wrong-type", "probe-port-by-name", "env-value-not-a-string", "missing-required"],
)
def test_a_broken_manifest_fails_validation(mutate: Any, message: str) -> None:
    deployment = copy.deepcopy(by_kind(KubernetesSpec(), "Deployment")["tandem-decode"])
    validate(deployment, VERSIONS[-1])
    mutate(deployment)
    with pytest.raises(kubernetes_validate.ValidationError) as error:
        validate(deployment, VERSIONS[-1])
    assert message in error.value.message


# --- What the manifests say ---------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=["default", "scaled", "cpu"])
def test_replicas_per_role(spec: KubernetesSpec) -> None:
    assert {name: d["spec"]["replicas"] for name, d in workloads(spec).items()} == {
        "tandem-redis": 1, **{f"tandem-{role}": count for role, count in spec.replicas.items()}
    }


def test_every_tandem_service_listens_on_all_interfaces_and_is_probed_on_grpc_health() -> None:
    for name, deployment in workloads(KubernetesSpec()).items():
        main = container(deployment)
        if name == "tandem-redis":
            assert main["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
            continue
        port = int(flag(main["args"], "--port"))
        assert flag(main["args"], "--host") == "0.0.0.0", name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["grpc"] == {"port": port}, (name, probe)


def test_the_internal_token_comes_from_the_secret_everywhere() -> None:
    ref = {"secretKeyRef": {"name": "tandem-internal", "key": "token"}}
    for name, deployment in workloads(KubernetesSpec()).items():
        pod = deployment["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            env = {e["name"]: e for e in c["env"]}
            token = env.get("TANDEM_INTERNAL_TOKEN") or env.get("REDISCLI_AUTH")
            if c["name"] != "model-init":
                assert token["valueFrom"] == ref, (name, c["name"])
            assert all(ref["secretKeyRef"]["key"] not in str(e.get("value", "")) for e in c["env"])
    scheduler = {e["name"]: e for e in container(workloads(KubernetesSpec())["tandem-scheduler"])["env"]}
    assert scheduler["TANDEM_REDIS_URL"]["value"] == "redis://:$(TANDEM_INTERNAL_TOKEN)@tandem-redis:6379/0"


@pytest.mark.parametrize(("profile", "device", "gpus"), [(Profile.GPU, "cuda:0", 1), (Profile.CPU, "cpu", None)])
def test_workers_take_one_gpu_each_in_the_gpu_profile(profile: Profile, device: str, gpus: int | None) -> None:
    deployments = workloads(KubernetesSpec(profile=profile))
    for role, port in (("prefill", 50061), ("decode", 50071)):
        main = container(deployments[f"tandem-{role}"])
        assert main["image"] == f"tandem:{profile}"
        assert flag(main["args"], "--device") == device
        assert flag(main["args"], "--advertise") == f"$(POD_IP):{port}"
        assert main["resources"]["limits"].get("nvidia.com/gpu") == gpus
    for other in ("gateway", "scheduler"):
        assert "nvidia.com/gpu" not in str(container(deployments[f"tandem-{other}"])["resources"])


@pytest.mark.parametrize("placement", list(Placement))
def test_placement_of_prefill_and_decode(placement: Placement) -> None:
    deployments = by_kind(KubernetesSpec(placement=placement), "Deployment")
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        affinity = deployments[f"tandem-{role}"]["spec"]["template"]["spec"].get("affinity")
        term = {"labelSelector": {"matchLabels": kubernetes._labels(other)}, "topologyKey": "kubernetes.io/hostname"}
        expected = {
            Placement.SHARE: {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "podAffinityTerm": term}]}},
            Placement.SEPARATE: {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}},
            Placement.ANY: None,
        }[placement]  # fmt: skip
        assert affinity == expected
    assert "affinity" not in deployments["tandem-gateway"]["spec"]["template"]["spec"]


def test_service_monitor_scrapes_every_metrics_port() -> None:
    (monitor,) = by_kind(KubernetesSpec(), "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = {port for e in monitor["spec"]["endpoints"] for port in [e["port"]] if e["path"] == "/metrics"}
    for name, service in by_kind(KubernetesSpec(), "Service").items():
        labels = service["metadata"]["labels"]
        assert selector.items() <= labels.items(), name
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert name == "tandem-redis" or ports & scraped, name
    assert by_kind(KubernetesSpec(service_monitor=False), "ServiceMonitor") == {}
    assert kubernetes.MONITORING_FILE not in kubernetes.render_files(KubernetesSpec(service_monitor=False))


def test_the_gateway_is_the_only_service_with_a_type() -> None:
    services = by_kind(KubernetesSpec(service_type="LoadBalancer"), "Service")
    assert {n: s["spec"].get("type") for n, s in services.items()} == {
        "tandem-redis": None, "tandem-scheduler": None, "tandem-prefill": None, "tandem-decode": None,
        "tandem-gateway": "LoadBalancer",
    }  # fmt: skip
    assert services["tandem-prefill"]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("count", [1, 3])
def test_schedulers_are_a_stateful_set_each_replica_named_and_listed_by_every_gateway_and_worker(count: int) -> None:
    spec = KubernetesSpec.from_values({"replicas": {"scheduler": count, "prefill": 2}})
    scheduler = by_kind(spec, "StatefulSet")["tandem-scheduler"]
    assert scheduler["spec"]["replicas"] == count
    assert scheduler["spec"]["serviceName"] == "tandem-scheduler"
    assert scheduler["spec"]["podManagementPolicy"] == "Parallel"
    service = by_kind(spec, "Service")["tandem-scheduler"]["spec"]
    assert (service["clusterIP"], service["publishNotReadyAddresses"]) == ("None", True)
    assert service["selector"] == scheduler["spec"]["template"]["metadata"]["labels"]
    env = {e["name"]: e.get("value") for e in container(scheduler)["env"]}
    assert env["TANDEM_REDIS_URL"] == "redis://:$(TANDEM_INTERNAL_TOKEN)@tandem-redis:6379/0"
    names = ",".join(f"tandem-scheduler-{i}.tandem-scheduler:50052" for i in range(count))
    clients = {name: flag(container(w)["args"], "--scheduler") for name, w in workloads(spec).items()
               if "--scheduler" in container(w).get("args", [])}  # fmt: skip
    assert clients == {"tandem-prefill": names, "tandem-decode": names, "tandem-gateway": names}
    assert ("--schedulers" in kubernetes.command_line(spec)) == (count > 1)
