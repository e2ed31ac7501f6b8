"""The model's shape, read from an HF `config.json` (torch-free: the gateway reads it too).

Owns the one place where the supported architectures and their config quirks are named:
Llama 2/3 (llama3 rope scaling), Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class ModelLoadError(ValueError):
    """The model directory cannot be loaded as it is; the message names the file and what to change."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 frequency-dependent rope scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing; a model directory needs an HF config.json")
        return cls.from_dict(json.loads(path.read_text()), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} is not supported; "
                f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = _required(raw, "num_attention_heads", source)
        hidden_size = _required(raw, "hidden_size", source)
        theta, scaling = _rope(raw, source)
        return cls(
            model_type=model_type,
            vocab_size=_required(raw, "vocab_size", source),
            hidden_size=hidden_size,
            intermediate_size=_required(raw, "intermediate_size", source),
            num_layers=_required(raw, "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _required(raw: dict[str, Any], key: str, source: str) -> int:
    if key not in raw:
        raise ModelLoadError(f"{source}: missing required field {key!r}")
    return int(raw[key])


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """Reads rope settings from either the transformers 5 `rope_parameters` or the older keys."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(f"{source}: rope_type {rope_type!r} is not supported; expected default or llama3")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
