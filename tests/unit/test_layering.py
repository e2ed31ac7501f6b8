"""DESIGN.md's dependency rules, checked on the source: imports point one way, from the commands
down through the services to the plumbing and the wire.

- `services/` takes nothing from `tandem` but the stubs (`tandem.v1`);
- `tandem/` outside `tandem/cli/` (the SDK and the stubs) never imports `services`;
- `services/common` imports no service; `services/runtime` imports no service above it;
- the gateway and the scheduler never import torch or `services.runtime`: not in any of their
  modules (not even inside a function), and not through a module they load at import time.

Each failure lists every offending import as `MODULE:LINE imports TARGET`.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[2]


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # the importing module, e.g. services.gateway.main
    line: int
    target: str  # the imported module, e.g. tandem.v1.gateway_pb2
    at_load: bool  # runs when the module is imported (not inside a function)

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {
    _module_name(path): path for package in ("services", "tandem") for path in sorted((ROOT / package).rglob("*.py"))
}


def within(name: str, *packages: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def modules_in(*packages: str) -> list[str]:
    return [name for name in MODULES if within(name, *packages)]


def imports_of(module: str) -> list[Import]:
    """Every absolute import of `module`; `from a import b` names `a.b` too when that is a module."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    in_functions = {
        id(node) for function in ast.walk(tree) if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{module}:{node.lineno}: relative import; write it absolute"
            submodules = (f"{node.module}.{alias.name}" for alias in node.names)
            targets = [node.module, *(name for name in submodules if name in MODULES)]
        else:
            continue
        found += [Import(module, node.lineno, target, id(node) not in in_functions) for target in targets]
    return found


def offenders(modules: list[str], forbidden: Callable[[str], bool]) -> list[str]:
    return [str(found) for module in modules for found in imports_of(module) if forbidden(found.target)]


def load_chain(module: str, forbidden: Callable[[str], bool]) -> list[str]:
    """The import chain by which loading `module` reaches a forbidden import ([] when none does)."""
    chains = {module: [module]}
    todo = [module]
    while todo:
        current = todo.pop(0)
        for found in imports_of(current):
            if not found.at_load:
                continue
            if forbidden(found.target):
                return [*chains[current], found.target]
            parts = found.target.split(".")
            for name in (".".join(parts[:end]) for end in range(1, len(parts) + 1)):
                if name in MODULES and name not in chains:
                    chains[name] = [*chains[current], name]
                    todo.append(name)
    return []


def assert_none(found: list[str]) -> None:
    assert found == [], "imports against DESIGN.md's dependency rules:\n  " + "\n  ".join(found)


def test_services_take_only_the_stubs_from_tandem():
    assert_none(offenders(modules_in("services"), lambda t: within(t, "tandem") and not within(t, "tandem.v1")))


def test_the_sdk_and_the_stubs_never_import_services():
    sdk = [name for name in modules_in("tandem") if not within(name, "tandem.cli")]
    assert "tandem.client.sync" in sdk and "tandem.v1.errors" in sdk
    assert_none(offenders(sdk, lambda target: within(target, "services")))


def test_common_imports_no_service():
    assert_none(offenders(modules_in("services.common"),
                          lambda t: within(t, "services") and not within(t, "services.common")))


def test_runtime_imports_no_service_above_it():
    assert_none(offenders(modules_in("services.runtime"),
                          lambda t: within(t, "services") and not within(t, "services.common", "services.runtime")))


def test_gateway_and_scheduler_never_import_torch_or_the_runtime():
    control_plane = modules_in("services.gateway", "services.scheduler")
    assert "services.gateway.main" in control_plane and "services.scheduler.main" in control_plane

    def heavy(target: str) -> bool:
        return within(target, "torch", "services.runtime")

    assert_none(offenders(control_plane, heavy))
    assert_none([" -> ".join(chain) for module in control_plane if (chain := load_chain(module, heavy))])
