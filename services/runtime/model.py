"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

One forward runs a flattened varlen batch (see `attention.BatchMetadata`) and computes logits
only at the rows that are sampled. q/k/v and gate/up projections are fused at load time so
each layer runs three matrix products instead of seven.
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
from services.common.model_config import ModelConfig


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operation order as HF's LlamaRMSNorm, so fp32 results agree bit for bit.
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
        lm_head: torch.Tensor,
        backend: AttentionBackend,
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.backend = backend
        self.scale = config.head_dim**-0.5
        freqs = torch.outer(torch.arange(config.max_position_embeddings).float(), rope_inv_freq(config))
        table = torch.cat((freqs, freqs), dim=-1).to(embed.device)
        self.cos = table.cos().to(embed.dtype)
        self.sin = table.sin().to(embed.dtype)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> CausalLM:
        config = ModelConfig.from_model_dir(model_dir)
        reader = WeightReader(model_dir)

        def take(name: str, *shape: int) -> torch.Tensor:
            return reader.take(name, shape).to(device=device, dtype=dtype)

        embed = take("model.embed_tokens.weight", config.vocab_size, config.hidden_size)
        layers = [_load_layer(take, config, i) for i in range(config.num_layers)]
        final_norm = take("model.norm.weight", config.hidden_size)
        if config.tie_word_embeddings or not reader.has("lm_head.weight"):
            lm_head = embed
        else:
            lm_head = take("lm_head.weight", config.vocab_size, config.hidden_size)
        return cls(config, embed, layers, final_norm, lm_head, backend)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, cache: PagedKVCache) -> torch.Tensor:
        """Runs the batch, writing its K/V into `cache`; returns logits `[len(logits_indices), vocab]`."""
        hidden = F.embedding(input_ids, self.embed)
        cos = self.cos[meta.positions].unsqueeze(1)
        sin = self.sin[meta.positions].unsqueeze(1)
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = cache.layer(index)
            hidden = hidden + self._attention(rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps),
                                              layer, cos, sin, k_cache, v_cache, meta)
            hidden = hidden + self._mlp(rms_norm(hidden, layer.post_norm, self.config.rms_norm_eps), layer)
        sampled = rms_norm(hidden[meta.logits_indices], self.final_norm, self.config.rms_norm_eps)
        return F.linear(sampled, self.lm_head)

    def _attention(self, x, layer: LayerWeights, cos, sin, k_cache, v_cache, meta: BatchMetadata):
        cfg = self.config
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        q, k, v = F.linear(x, layer.qkv, layer.qkv_bias).split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return F.linear(out.reshape(x.shape[0], q_size), layer.o_proj)

    @staticmethod
    def _mlp(x, layer: LayerWeights):
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)


def _load_layer(take, config: ModelConfig, index: int) -> LayerWeights:
    prefix = f"model.layers.{index}."
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    attn = prefix + "self_attn."
    qkv = torch.cat([
        take(attn + "q_proj.weight", q_size, hidden),
        take(attn + "k_proj.weight", kv_size, hidden),
        take(attn + "v_proj.weight", kv_size, hidden),
    ])
    qkv_bias = None
    if config.qkv_bias:
        qkv_bias = torch.cat([
            take(attn + "q_proj.bias", q_size), take(attn + "k_proj.bias", kv_size), take(attn + "v_proj.bias", kv_size)
        ])
    return LayerWeights(
        input_norm=take(prefix + "input_layernorm.weight", hidden),
        qkv=qkv,
        qkv_bias=qkv_bias,
        q_norm=take(attn + "q_norm.weight", head_dim) if config.qk_norm else None,
        k_norm=take(attn + "k_norm.weight", head_dim) if config.qk_norm else None,
        o_proj=take(attn + "o_proj.weight", hidden, q_size),
        post_norm=take(prefix + "post_attention_layernorm.weight", hidden),
        gate_up=torch.cat([take(prefix + "mlp.gate_proj.weight", inter, hidden),
                           take(prefix + "mlp.up_proj.weight", inter, hidden)]),
        down=take(prefix + "mlp.down_proj.weight", hidden, inter),
    )
