"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

One forward runs a flattened varlen batch (see `attention.BatchMetadata`) and computes logits
only at the rows that are sampled. q/k/v and gate/up projections are fused at load time so
each layer runs three matrix products instead of seven. Activations, norms' outputs and the KV
cache take the model's dtype; norms compute in float32 as HF's do, and logits come out float32.
Projections are `quantization.Linear`s: dense, or int8/int4 weights. With quantized weights the
LM head is int8 (as llama.cpp keeps its output layer above 4 bits: an int4 head, though twice as
fast, cut bf16+int4's top-1 agreement with fp32 from 0.991 to 0.959); the embedding stays dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.runtime.attention import AttentionBackend, BatchMetadata
from services.runtime.kv_cache import PagedKVCache
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operations as HF's LlamaRMSNorm (float32 inside), so fp32 results agree bit for bit; the
    # intermediates are updated in place (same values, fewer allocations).
    x32 = x.float()
    scale = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return weight * (x32 * scale).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `x` [tokens, heads, head_dim], queries and keys at once: HF's x * cos + rotate_half(x) * sin
    in four operations, as `sin` comes with its first half negated (`CausalLM.sin`), so the halves
    swap by a flip: rotate_half(x) * sin = flip(x) * sin_signed, to the bit."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return (x * cos).add_(swapped.mul_(sin))


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
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.backend = backend
        self.precision = precision
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
        return cls(config, embed, layers, final_norm, lm_head, backend, precision)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, cache: PagedKVCache,
                lora: LoraBatch | None = None) -> torch.Tensor:
        """Runs the batch, writing its K/V into `cache`; returns logits `[len(logits_indices), vocab]`.
        `lora` adds each row's adapter update to its projections."""
        hidden = F.embedding(input_ids, self.embed)  # a new tensor, so the residual adds may run in place
        cos = self.cos[meta.positions].unsqueeze(1)
        sin = self.sin[meta.positions].unsqueeze(1)
        eps = self.config.rms_norm_eps
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = cache.layer(index)
            project = _Projections(layer, index, lora)
            hidden += self._attention(rms_norm(hidden, layer.input_norm, eps), project, layer, cos, sin,
                                      k_cache, v_cache, meta)
            hidden += self._mlp(rms_norm(hidden, layer.post_norm, eps), project)
        sampled = rms_norm(hidden[meta.logits_indices], self.final_norm, eps)
        return self.lm_head(sampled).float()

    def _attention(self, x, project: _Projections, layer: LayerWeights, cos, sin, k_cache, v_cache,
                   meta: BatchMetadata):
        cfg = self.config
        q_size = cfg.num_heads * cfg.head_dim
        heads = (cfg.num_heads, cfg.num_kv_heads)
        qkv = project("qkv", x).view(-1, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        qk, v = qkv.split((sum(heads), cfg.num_kv_heads), dim=1)
        if layer.q_norm is not None:
            q, k = qk.split(heads, dim=1)
            qk = torch.cat((rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)), 1)
        q, k = rotate(qk, cos, sin).split(heads, dim=1)
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return project("o_proj", out.reshape(x.shape[0], q_size))

    @staticmethod
    def _mlp(x, project: _Projections):
        gate, up = project("gate_up", x).chunk(2, dim=-1)  # views of a new tensor: updated in place
        return project("down", F.silu(gate, inplace=True).mul_(up))


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
        return make_linear(weight, bias, quantization or self.precision.quantization, self.precision.dtype,
                           self.device, self.precision.dense_from_rows)


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
