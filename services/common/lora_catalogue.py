"""Which LoRA adapters a deployment serves, by name, and how a request names one: `BASE:NAME`.

Torch-free, so the gateway lists and resolves adapters with the workers' own rules: every
adapter directory under $TANDEM_HOME/loras, then each `--lora NAME=DIR`.
"""

from __future__ import annotations

from pathlib import Path

from services.common.paths import tandem_home

ADAPTER_CONFIG = "adapter_config.json"


class LoraCatalogueError(ValueError):
    """A --lora flag that cannot be read; the message says what to write instead."""


def lora_sources(named: tuple[str, ...] | list[str], home: Path | None = None) -> dict[str, Path]:
    """Adapters by served name: every directory under $TANDEM_HOME/loras, then each NAME=DIR flag."""
    root = (home or tandem_home()) / "loras"
    sources = {d.name: d for d in sorted(root.iterdir()) if (d / ADAPTER_CONFIG).is_file()} if root.is_dir() else {}
    for item in named:
        name, sep, directory = item.partition("=")
        if not sep or not name or not directory or ":" in name:
            raise LoraCatalogueError(f"--lora takes NAME=DIR with a NAME without ':', got {item!r}")
        sources[name] = Path(directory).expanduser()
    return sources


def split_model(name: str) -> tuple[str, str]:
    """'BASE:NAME' -> ('BASE', 'NAME'); a name without ':' is a base model alone ('' adapter)."""
    base, _, adapter = name.partition(":")
    return base, adapter
