"""Where Tandem keeps its files on this machine.

`TANDEM_HOME` (default ~/.cache/tandem) holds models and the run directory; `TANDEM_RUN_DIR`
overrides the run directory, where services write their logs and local span files.
"""

from __future__ import annotations

import os
from pathlib import Path


def tandem_home() -> Path:
    """The root of Tandem's cache: `$TANDEM_HOME`, else ~/.cache/tandem."""
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem").expanduser()


def run_dir() -> Path:
    """The run directory: `$TANDEM_RUN_DIR`, else `$TANDEM_HOME/run`. Not created here."""
    override = os.environ.get("TANDEM_RUN_DIR")
    return Path(override).expanduser() if override else tandem_home() / "run"
