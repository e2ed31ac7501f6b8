"""Reads a model directory's weights: memory-mapped safetensors only, one file or sharded.

Pickle checkpoints are refused (loading them runs arbitrary code). Every error names the file
and what was expected.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.model_config import ModelLoadError

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
