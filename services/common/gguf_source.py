"""Which GGUF file a converted model directory came from, and where each of its tensors lies there.

`model_store` writes `gguf_source.json` beside the weights it converts from a GGUF; the runtime
(services/runtime/gguf_weights.py) reads it to take int4 groups straight from the file's Q4_1
blocks instead of quantizing the dequantized safetensors again. Parsing a GGUF's header costs
seconds in the `gguf` package (its tokenizer arrays), so the record keeps each tensor's type, byte
range and shape, and a load only maps the file. The `gguf` package is imported inside `describe_gguf`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SOURCE_FILE = "gguf_source.json"
# HF's GGUF conversion for these architectures permutes the q/k rows back from llama.cpp's RoPE
# layout (transformers' LlamaTensorProcessor); other architectures keep the file's row order.
ROPE_PERMUTED_ARCHITECTURES = ("llama",)


class GgufSourceError(ValueError):
    """A GGUF file or a model directory's gguf_source.json cannot be read as expected."""


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor of the file, under its HF name in the record."""

    gguf_name: str  # e.g. "blk.0.attn_q.weight"
    type: str  # GGML type name: "Q4_1", "Q8_0", "F32", ...
    offset: int  # absolute byte offset of its data in the file
    nbytes: int
    shape: tuple[int, ...]  # HF's order: [out, in] for a matrix
    rope_heads: int | None  # where HF's conversion permuted its rows: the head count of that permutation


@dataclass(frozen=True, slots=True)
class GgufSource:
    """The GGUF file a model directory was converted from, and its tensors by HF name."""

    path: Path
    size: int  # the file's size in bytes when the record was written
    architecture: str
    tensors: dict[str, GgufTensor]

    def count(self, type_name: str) -> int:
        return sum(1 for t in self.tensors.values() if t.type == type_name)


def describe_gguf(path: Path, hf_names: Iterable[str]) -> GgufSource:
    """The record of `path` for the tensors named (HF names) in the converted model; a name the
    file does not hold is left out."""
    import gguf

    reader = gguf.GGUFReader(path)
    architecture = _field(reader, gguf.Keys.General.ARCHITECTURE)
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == architecture), None)
    if arch is None:
        raise GgufSourceError(f"{path}: architecture {architecture!r} is unknown to the gguf package")
    blocks = int(_field(reader, f"{architecture}.block_count"))
    heads = _rope_heads(reader, architecture)
    names = gguf.get_tensor_name_map(arch, blocks)
    by_gguf_name = {t.name: t for t in reader.tensors}
    tensors = {}
    for hf_name in hf_names:
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        found = by_gguf_name.get(gguf_name) if gguf_name else None
        if found is not None:
            tensors[hf_name] = GgufTensor(
                gguf_name=found.name, type=found.tensor_type.name, offset=int(found.data_offset),
                nbytes=int(found.n_bytes), shape=tuple(int(d) for d in reversed(found.shape.tolist())),
                rope_heads=heads.get(gguf_name.split(".")[-2]))
    return GgufSource(path=path.resolve(), size=path.stat().st_size, architecture=architecture, tensors=tensors)


def write_source(model_dir: Path, source: GgufSource) -> None:
    """Writes the record into `model_dir` (a temporary file renamed into place: whole or absent)."""
    data: dict[str, Any] = {"path": str(source.path), "size": source.size, "architecture": source.architecture,
                            "tensors": {name: asdict(t) for name, t in source.tensors.items()}}
    staging = model_dir / f".{SOURCE_FILE}.tmp"
    staging.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(staging, model_dir / SOURCE_FILE)


def read_source(model_dir: Path) -> GgufSource | None:
    """The directory's record, or None where it was not converted from a GGUF."""
    path = model_dir / SOURCE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        tensors = {name: GgufTensor(**{**t, "shape": tuple(t["shape"])}) for name, t in data["tensors"].items()}
        return GgufSource(Path(data["path"]), int(data["size"]), str(data["architecture"]), tensors)
    except (ValueError, KeyError, TypeError) as exc:
        raise GgufSourceError(f"{path}: not a valid record ({exc}); delete it, and `tandem model pull-default` "
                              "writes it again for the default model") from exc


def _field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise GgufSourceError(f"{reader.data.filename}: metadata key {key!r} is missing")
    return field.contents()


def _rope_heads(reader: Any, architecture: str) -> dict[str, int]:
    """The head count HF's conversion permutes each of attn_q's and attn_k's rows by (none where it
    keeps the file's order): the query heads for attn_q, the KV heads for attn_k."""
    if architecture not in ROPE_PERMUTED_ARCHITECTURES:
        return {}
    heads = int(_field(reader, f"{architecture}.attention.head_count"))
    kv_field = reader.get_field(f"{architecture}.attention.head_count_kv")
    return {"attn_q": heads, "attn_k": heads if kv_field is None else int(kv_field.contents())}


def weights_line(model_dir: Path) -> str:
    """Where a model directory's weights come from, as `tandem up` prints it."""
    source = read_source(model_dir)
    if source is None:
        return f"{model_dir} (safetensors)"
    return (f"{model_dir} (safetensors converted from {source.path.name}; int4 takes the groups of its "
            f"{source.count('Q4_1')} Q4_1 tensors from the file as shipped)")
