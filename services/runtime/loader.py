"""Reads a model directory's weights: memory-mapped safetensors only, one file or sharded.

Pickle checkpoints are refused (loading them runs arbitrary code). Every error names the file
and what was expected. Where the directory was converted from a GGUF, int4 layers take their groups
from the file's Q4_1 blocks instead (services/runtime/gguf_weights.py).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.model_config import ModelLoadError
from services.runtime.gguf_weights import GgufGroups, dequantized, joined_rows
from services.runtime.quantization import Int4Groups

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the model's weights, in a stable order."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(f"{root}: model directory not found")
    index = root / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (root / name).is_file()]
        if missing:
            raise ModelLoadError(f"{index}: lists shard {missing[0]} which is missing from {root}")
        return [root / name for name in shards]
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{root / pickles[0]}: pickle checkpoints are refused because loading them can run code; "
            "convert the weights to safetensors (e.g. `save_pretrained(dir, safe_serialization=True)`)"
        )
    raise ModelLoadError(f"{root}: no *.safetensors weights found")


def load_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the model by name, memory-mapped from disk (no copy until used)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


class WeightReader:
    """Hands out named tensors, checking each one's shape; remembers which file held it."""

    def __init__(self, model_dir: str | Path) -> None:
        self._dir = Path(model_dir)
        self._tensors = load_tensors(model_dir)
        self._gguf_stale = False  # the source GGUF's weights turned out not to be these
        self.gguf_tensors = 0  # how many tensors `int4_groups` took from the source GGUF

    def has(self, name: str) -> bool:
        return name in self._tensors

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._tensors:
            raise ModelLoadError(f"{self._dir}: tensor {name!r} is missing from the safetensors files")
        tensor = self._tensors[name]
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{self._dir}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} from config.json"
            )
        return tensor

    def int4_groups(self, names: list[str], shapes: list[tuple[int, ...]]) -> Int4Groups | None:
        """The int4 groups of these tensors joined by rows, straight from the directory's source GGUF,
        or None where it has none or stores any of them in another type (the caller quantizes the
        safetensors weights). The first tensor taken must dequantize to its safetensors weight bit
        for bit, else the record is stale and the file is not used."""
        source = None if self._gguf_stale else self._gguf
        if source is None:
            return None
        parts = [source.int4_groups(name, shape) for name, shape in zip(names, shapes)]
        if any(part is None for part in parts):
            return None
        if self.gguf_tensors == 0 and not self._matches(source, names[0], parts[0]):
            self._gguf_stale = True
            return None
        self.gguf_tensors += len(parts)
        return joined_rows(parts)

    @functools.cached_property
    def _gguf(self) -> GgufGroups | None:
        groups = GgufGroups.open(self._dir)
        if groups is not None:
            log.info("weights: int4 groups from %s's Q4_1 blocks, as shipped", groups.source.path)
        return groups

    def _matches(self, source: GgufGroups, name: str, groups: Int4Groups) -> bool:
        if torch.equal(dequantized(groups), self.take(name, tuple(groups.codes.shape))):
            return True
        log.warning("weights: %s's %s does not dequantize to %s's; its record (gguf_source.json) is stale, so "
                    "int4 weights are quantized from the safetensors", source.source.path, name, self._dir)
        return False
