"""`python -m services.runtime.native`: builds the native kernels for this machine and says where."""

from __future__ import annotations

import sys

from services.runtime import native


def main() -> int:
    print(f"building {native.EXTENSION} from {len(native.sources())} sources into {native.build_dir()} ...",
          flush=True)
    path = native.build()
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
