"""Generate the Python stubs of protos/tandem/v1 into tandem/v1 (message, typing and gRPC modules).

The stubs are committed; tests/unit/test_protos_fresh.py regenerates them into a
temporary directory and fails when they differ. Run after editing a .proto:
`python scripts/gen_protos.py`.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = Path("tandem") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The .proto files of the package, relative to PROTO_ROOT, in a stable order."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generated_files(root: Path) -> list[Path]:
    """Generated stub files under root/tandem/v1, relative to root."""
    package = root / PACKAGE_DIR
    return sorted(p.relative_to(root) for p in package.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every proto into out_dir (stubs land in out_dir/tandem/v1); return the files written."""
    include = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_ROOT / PACKAGE_DIR}; see its messages above")
    return generated_files(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
