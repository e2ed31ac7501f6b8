"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

One forward runs a flattened varlen batch (see `attention.BatchMetadata`) and computes logits
only at the rows that are sampled. q/k/v and gate/up projections are fused at load time so
each layer runs three matrix products instead of seven. Activations, norms' outputs and the KV
cache take the model's dtype; norms compute in float32 as HF's do, and logits come out float32.
Projections are `quantization.Linear`s: dense, or int8/int4 weights. With quantized weights the
LM head is int8 (as llama.cpp keeps its output layer above 4 bits: an int4 head, though twice as
fast, cut bf16+int4's top-1 agreement with fp32 from 0.991 to 0.959); the embedding stays dense.
The operations between the projections (norms, residual adds, RoPE with the KV write, SiLU) are
`layer_ops`': one C++ call each where the native build is loaded (`native.active`), else ATen's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.runtime import native
from services.runtime.attention import AttentionBackend, BatchMetadata
from services.runtime.kv_cache import PagedKVCache
from services.runtime.layer_ops import LayerOps, NativeOps, TorchOps, rms_norm
from services.runtime.loader import WeightReader
from services.runtime.lora import LoraBatch
from services.runtime.precision import Precision
from services.runtime.quantization import DenseLinear, Linear, SplitLinear, make_linear
from services.common.model_config import ModelConfig


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class CausalLM:
    """Weights plus the forward pass; holds no per-request state (that lives in the KV cache)."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: Linear,
        backend: AttentionBackend,
        precision: Precision = Precision(),
        native_ops: bool = False,
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.backend = backend
        self.precision = precision
        self.ops = NativeOps if native_ops else TorchOps
        self.scale = config.head_dim**-0.5
        freqs = torch.outer(torch.arange(config.max_position_embeddings).float(), rope_inv_freq(config))
        table = torch.cat((freqs, freqs), dim=-1).to(embed.device)
        self.cos = table.cos().to(embed.dtype)
        self.sin = (table.sin() * torch.cat((-torch.ones_like(freqs), torch.ones_like(freqs)), dim=-1)).to(embed.dtype)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        backend: AttentionBackend,
        precision: Precision = Precision(),
        device: torch.device | str = "cpu",
    ) -> CausalLM:
        config = ModelConfig.from_model_dir(model_dir)
        reader = WeightReader(model_dir)
        weights = _Weights(reader, precision, torch.device(device))
        embed = weights.dense("model.embed_tokens.weight", config.vocab_size, config.hidden_size)
        layers = [_load_layer(weights, config, i) for i in range(config.num_layers)]
        final_norm = weights.dense("model.norm.weight", config.hidden_size)
        tied = config.tie_word_embeddings or not reader.has("lm_head.weight")
        lm_head = _lm_head(weights, config, DenseLinear(embed) if tied else None)
        return cls(config, embed, layers, final_norm, lm_head, backend, precision, native.active(torch.device(device)))

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, cache: PagedKVCache,
                lora: LoraBatch | None = None, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Runs the batch, writing its K/V into `cache`; returns logits `[len(logits_indices), vocab]`.
        `lora` adds each row's adapter update to its projections; `after_layer(i)` runs once layer
        `i`'s K/V is in `cache`. Each layer's residual add is left to the next norm
        (`ops.norm(hidden, delta, ...)` adds, then normalizes), one call either way."""
        hidden = F.embedding(input_ids, self.embed)  # a new tensor, so the residual adds may run in place
        ops = self.ops(self.cos, self.sin, meta)
        eps = self.config.rms_norm_eps
        delta = None
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = cache.layer(index)
            project = _Projections(layer, index, lora)
            attended = self._attention(ops.norm(hidden, delta, layer.input_norm, eps), project, layer, ops,
                                       k_cache, v_cache, meta)
            if after_layer is not None:
                after_layer(index)
            delta = project("down", ops.silu_mul(project("gate_up", ops.norm(hidden, attended, layer.post_norm, eps))))
        hidden += delta
        sampled = ops.norm(hidden[meta.logits_indices], None, self.final_norm, eps)
        return self.lm_head(sampled).float()

    def _attention(self, x, project: _Projections, layer: LayerWeights, ops: LayerOps, k_cache, v_cache,
                   meta: BatchMetadata):
        cfg = self.config
        qkv = project("qkv", x).view(-1, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            _norm_qk(qkv, layer, cfg)
        q, k, v = ops.rope_write_kv(qkv, cfg.num_heads, k_cache, v_cache)
        out = self.backend.attend(q, k, v, k_cache, v_cache, meta, self.scale)
        return project("o_proj", out.reshape(x.shape[0], cfg.num_heads * cfg.head_dim))


def _norm_qk(qkv: torch.Tensor, layer: LayerWeights, cfg: ModelConfig) -> None:
    """Qwen3's per-head RMSNorm of queries and keys, before RoPE, in place in `qkv`."""
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    qkv[:, :heads] = rms_norm(qkv[:, :heads], layer.q_norm, cfg.rms_norm_eps)
    qkv[:, heads:heads + kv_heads] = rms_norm(qkv[:, heads:heads + kv_heads], layer.k_norm, cfg.rms_norm_eps)


class _Projections:
    """One layer's projections by fused name (qkv, o_proj, gate_up, down), each plus its rows'
    adapter updates when the batch has adapters."""

    __slots__ = ("layer", "index", "lora")

    def __init__(self, layer: LayerWeights, index: int, lora: LoraBatch | None) -> None:
        self.layer, self.index, self.lora = layer, index, lora

    def __call__(self, fused: str, x: torch.Tensor) -> torch.Tensor:
        out = getattr(self.layer, fused)(x)
        delta = self.lora.delta(self.index, fused, x) if self.lora is not None else None
        return out if delta is None else out + delta


class _Weights:
    """Named tensors from the reader, shape-checked, as dense tensors or as linear layers in the
    model's precision (fused matrices are concatenated before they are quantized)."""

    def __init__(self, reader: WeightReader, precision: Precision, device: torch.device) -> None:
        self.reader = reader
        self.precision = precision
        self.device = device

    def dense(self, name: str, *shape: int) -> torch.Tensor:
        return self.reader.take(name, shape).to(device=self.device, dtype=self.precision.dtype)

    def linear(self, names: list[str], shapes: list[tuple[int, ...]], biases: list[str] | None = None,
               quantization: str | None = None) -> Linear:
        weight = _joined([self.reader.take(n, s) for n, s in zip(names, shapes)])
        bias = None
        if biases is not None:
            bias = _joined([self.reader.take(n, s[:1]) for n, s in zip(biases, shapes)])
        quantization = quantization or self.precision.quantization
        groups = self.reader.int4_groups(names, shapes) if quantization == "int4" else None
        return make_linear(weight, bias, quantization, self.precision.dtype, self.device,
                           self.precision.dense_from_rows, groups)


def _lm_head(weights: _Weights, config: ModelConfig, tied: DenseLinear | None) -> Linear:
    """The output layer: int8 under quantized weights, dense otherwise; a tied head shares the
    embedding's tensor wherever it is dense."""
    shape = [(config.vocab_size, config.hidden_size)]
    precision = weights.precision
    if tied is None:
        quantization = "none" if precision.quantization == "none" else "int8"
        return weights.linear(["lm_head.weight"], shape, quantization=quantization)
    if precision.quantization == "none":
        return tied
    int8 = make_linear(weights.reader.take("model.embed_tokens.weight", shape[0]), None, "int8", precision.dtype)
    return int8 if precision.dense_from_rows is None else SplitLinear(int8, tied, precision.dense_from_rows)


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One tensor stays the memory-mapped original (no copy when its dtype is kept)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _load_layer(weights: _Weights, config: ModelConfig, index: int) -> LayerWeights:
    prefix = f"model.layers.{index}."
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    attn = prefix + "self_attn."
    qkv_names = [attn + "q_proj.", attn + "k_proj.", attn + "v_proj."]
    qkv_shapes = [(q_size, hidden), (kv_size, hidden), (kv_size, hidden)]
    return LayerWeights(
        input_norm=weights.dense(prefix + "input_layernorm.weight", hidden),
        qkv=weights.linear([n + "weight" for n in qkv_names], qkv_shapes,
                           [n + "bias" for n in qkv_names] if config.qkv_bias else None),
        q_norm=weights.dense(attn + "q_norm.weight", head_dim) if config.qk_norm else None,
        k_norm=weights.dense(attn + "k_norm.weight", head_dim) if config.qk_norm else None,
        o_proj=weights.linear([attn + "o_proj.weight"], [(hidden, q_size)]),
        post_norm=weights.dense(prefix + "post_attention_layernorm.weight", hidden),
        gate_up=weights.linear([prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"],
                               [(inter, hidden), (inter, hidden)]),
        down=weights.linear([prefix + "mlp.down_proj.weight"], [(hidden, inter)]),
    )
