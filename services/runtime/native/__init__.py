"""Tandem's C++ CPU kernels: every `*.cpp` in this package, compiled together into one extension.

Each source registers its ops with `TORCH_LIBRARY_FRAGMENT(tandem, m)`; Python calls them as
`torch.ops.tandem.<op>`. The build is keyed by a hash of the sources and headers, the torch version, the
compiler flags and the CPU's feature flags (it compiles with `-march=native`), and lives under
`$TANDEM_HOME/native/<key>/`, so it is built once per machine and rebuilt when any of these change.

A serving process never compiles (a compile takes a minute or more): `loaded()` loads a prebuilt
build when there is one, else says so once in the log, with the command that builds it, and the
callers keep their pure-torch path, which is also the reference the tests hold the ops to.
`python -m services.runtime.native` builds (`make setup` runs it). `TANDEM_NATIVE=0` keeps a
process on the torch path even with a build present (for side-by-side benchmarks).

Flags: `-O3 -march=native -fopenmp -ffp-contract=off`. Floating-point contraction is off so
element-wise kernels round exactly as torch's do (a*b+c stays two roundings); kernels that want
fused multiply-adds use intrinsics (`_mm512_fmadd_ps`), which the flag does not touch.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

from services.common.paths import tandem_home

log = logging.getLogger(__name__)

EXTENSION = "tandem_native"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
BUILD_COMMAND = "python -m services.runtime.native"
_PACKAGE_DIR = Path(__file__).resolve().parent


def sources() -> list[Path]:
    """Every C++ source of the extension, in a stable order."""
    return sorted(_PACKAGE_DIR.glob("*.cpp"))


def build_dir() -> Path:
    """Where this machine's build of the current sources lives."""
    return tandem_home() / "native" / _build_key()


def library_path() -> Path:
    return build_dir() / f"{EXTENSION}.so"


def build(verbose: bool = False) -> Path:
    """Compiles the extension (a no-op when the build is current), loads it into this process and
    returns the shared library's path. Raises what the compiler raised."""
    from torch.utils import cpp_extension

    _put_interpreter_tools_on_path()
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=EXTENSION, sources=[str(s) for s in sources()], build_directory=str(directory),
        extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=verbose,
    )
    loaded.cache_clear()
    return library_path()


@functools.cache
def loaded() -> bool:
    """Whether the ops are in this process: loads a prebuilt library, never compiles. Decided (and
    logged) once per process."""
    if os.environ.get("TANDEM_NATIVE", "1") == "0":
        log.info("native kernels: off (TANDEM_NATIVE=0); the torch path runs")
        return False
    if not sources():
        return False
    path = library_path()
    if not path.exists():
        log.warning("native kernels: no build for these sources at %s; the torch path runs. Build it "
                    "with `%s` (make setup does)", path, BUILD_COMMAND)
        return False
    torch.ops.load_library(str(path))  # a library build() loaded already is not loaded twice
    log.info("native kernels: loaded %s", path)
    return True


def active(device: torch.device) -> bool:
    """The one switch the callers check: the kernels run where their build is loaded and the tensors
    are on the CPU (they are CPU kernels)."""
    return device.type == "cpu" and loaded()


def _put_interpreter_tools_on_path() -> None:
    """torch runs `ninja` from PATH; pip installs it (a dependency) beside this interpreter, whose
    directory is not on PATH when a virtualenv's python runs without being activated (`make setup`)."""
    tools = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if tools not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join((tools, path)) if path else tools


def _build_key() -> str:
    digest = hashlib.sha256()
    for source in sorted(_PACKAGE_DIR.glob("*.[ch]*")):  # the sources and the headers they include
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    for part in (torch.__version__, platform.machine(), " ".join(CFLAGS), _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), or "" where /proc has none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(("flags", "Features"))), "")
