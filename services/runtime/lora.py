"""LoRA adapters in the PEFT layout, served on top of a base model, several in one batch.

An adapter is a directory with `adapter_config.json` and `adapter_model.safetensors` (never a
pickle). Its q/k/v and gate/up matrices are fused as the base model's are: one A of the targets'
A rows stacked and one block-diagonal B (scaling folded in) per fused projection, so every
projection gets one low-rank update. A batch mixing adapters (and rows of none) applies them all
at once: x times every adapter's A side by side, masked to each row's own adapter's columns,
times every B side by side: two matrix products per projection whatever the mix
(`delta_masked`). Its products grow with the number of adapters, so past `MASKED_MAX_ROWS` rows
(prefill chunks) looping adapter by adapter over its own rows is cheaper (`delta_looped`);
bench/lora.py measures both.
At most `max_loras` adapters are loaded at once; the least recently used idle one leaves first.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.model_config import ModelConfig
from services.common.lora_catalogue import ADAPTER_CONFIG

ADAPTER_WEIGHTS = "adapter_model.safetensors"
FUSED_TARGETS = {  # the model's fused projection -> its PEFT target modules, in output order
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_FUSED_OF = {target: fused for fused, targets in FUSED_TARGETS.items() for target in targets}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
MASKED_MAX_ROWS = 64  # bench/lora.py: masked 2-6x faster at 32 rows, 1.3-3x slower at 512 with 4-8 adapters
_UNSUPPORTED_OPTIONS = ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and what to change."""


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One projection's update: delta = (x @ a.T) @ b.T, with a `[rank, in]` and b `[out, rank]`."""

    a: torch.Tensor
    b: torch.Tensor
    owners: torch.Tensor  # [rank]: the batch index of the adapter each column belongs to


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    rank: int
    layers: list[dict[str, LoraModule]]  # per layer: fused projection -> update (untargeted ones absent)
    num_bytes: int

    @classmethod
    def load(cls, name: str, directory: str | Path, config: ModelConfig, dtype: torch.dtype,
             device: torch.device | str = "cpu") -> LoraAdapter:
        root = Path(directory)
        settings = _read_config(name, root)
        rank, alpha = int(settings["r"]), float(settings["lora_alpha"])
        scaling = alpha / rank**0.5 if settings.get("use_rslora") else alpha / rank
        pairs = _read_pairs(name, root, config)
        layers = [{fused: _fuse(name, fused, pairs.get(i, {}), config, rank, scaling, dtype, device)
                   for fused in FUSED_TARGETS if any(t in pairs.get(i, {}) for t in FUSED_TARGETS[fused])}
                  for i in range(config.num_layers)]
        num_bytes = sum(m.a.nbytes + m.b.nbytes for layer in layers for m in layer.values())
        return cls(name, rank, layers, num_bytes)


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """The adapters of one forward's rows: per layer and projection every adapter's update side by
    side, and each row's adapter index (-1: the base model alone)."""

    layers: list[dict[str, LoraModule]]
    row_owners: torch.Tensor  # [num_rows]

    def delta(self, layer: int, fused: str, x: torch.Tensor) -> torch.Tensor | None:
        """The update of `x`'s rows, each by its own adapter, or None if no adapter targets it."""
        if x.shape[0] > MASKED_MAX_ROWS:
            return self.delta_looped(layer, fused, x)
        return self.delta_masked(layer, fused, x)

    def delta_masked(self, layer: int, fused: str, x: torch.Tensor) -> torch.Tensor | None:
        """All adapters' updates in two products, masked to each row's own adapter's columns."""
        module = self.layers[layer].get(fused)
        if module is None:
            return None
        mask = (self.row_owners[:, None] == module.owners[None, :]).to(x.dtype)
        return ((x @ module.a.T) * mask) @ module.b.T

    def delta_looped(self, layer: int, fused: str, x: torch.Tensor) -> torch.Tensor | None:
        """The same update computed adapter by adapter over its own rows."""
        module = self.layers[layer].get(fused)
        if module is None:
            return None
        out = x.new_zeros(x.shape[0], module.b.shape[0])
        for owner in module.owners.unique().tolist():
            rows = (self.row_owners == owner).nonzero().squeeze(1)
            columns = (module.owners == owner).nonzero().squeeze(1)
            out.index_add_(0, rows, (x[rows] @ module.a[columns].T) @ module.b[:, columns].T)
        return out


class LoraManager:
    """The adapters a worker may serve (name -> directory) and the ones loaded, at most `max_loras`.

    Invariant: an adapter with live requests (acquired, not yet released) stays loaded; a load
    that needs room evicts the least recently acquired idle adapter, and fails when none is idle.
    """

    def __init__(self, sources: dict[str, Path], max_loras: int, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        if max_loras < 1:
            raise LoraError(f"--max-loras must be at least 1, got {max_loras}")
        self.sources = dict(sources)
        self.max_loras = max_loras
        self._config, self._dtype, self._device = config, dtype, device
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently acquired first
        self._users: dict[str, int] = {}
        self._stacked: tuple[tuple[str, ...], list[dict[str, LoraModule]]] | None = None

    @property
    def loaded(self) -> list[str]:
        """Loaded adapters, least recently acquired first."""
        return list(self._loaded)

    def acquire(self, name: str) -> None:
        """Marks a request's use of `name`, loading it first (evicting an idle adapter if full)."""
        if name not in self.sources:
            known = ", ".join(sorted(self.sources)) or "none"
            raise LoraError(f"unknown LoRA adapter {name!r}; this worker serves: {known} "
                            "(add one with --lora NAME=DIR or under $TANDEM_HOME/loras/NAME/)")
        if name not in self._loaded:
            self._make_room(name)
            self._loaded[name] = LoraAdapter.load(name, self.sources[name], self._config, self._dtype, self._device)
        self._loaded.move_to_end(name)
        self._users[name] = self._users.get(name, 0) + 1

    def release(self, name: str) -> None:
        self._users[name] -= 1

    def batch(self, row_adapters: list[tuple[str, int]]) -> LoraBatch | None:
        """The batch for rows given as (adapter name or "", number of rows) runs; None without adapters."""
        names = tuple(sorted({name for name, _ in row_adapters if name}))
        if not names:
            return None
        index = {name: i for i, name in enumerate(names)}
        owners = [index.get(name, -1) for name, count in row_adapters for _ in range(count)]
        return LoraBatch(self._stack(names), torch.tensor(owners, device=self._device))

    def _make_room(self, name: str) -> None:
        if len(self._loaded) < self.max_loras:
            return
        idle = next((n for n in self._loaded if not self._users.get(n)), None)
        if idle is None:
            raise LoraError(f"cannot load LoRA adapter {name!r}: all {self.max_loras} adapter slots hold adapters of "
                            "running requests; raise --max-loras or retry when they finish")
        del self._loaded[idle]
        self._users.pop(idle, None)
        self._stacked = None

    def _stack(self, names: tuple[str, ...]) -> list[dict[str, LoraModule]]:
        """Every adapter's updates side by side per projection, kept while the same set runs (decode)."""
        if self._stacked is None or self._stacked[0] != names:
            adapters = [self._loaded[n] for n in names]
            self._stacked = (names, [_stack_layer(adapters, i) for i in range(self._config.num_layers)])
        return self._stacked[1]


def _read_config(name: str, root: Path) -> dict:
    path = root / ADAPTER_CONFIG
    if not path.is_file():
        raise LoraError(f"LoRA adapter {name!r}: {path} is missing; an adapter directory needs {ADAPTER_CONFIG} "
                        f"and {ADAPTER_WEIGHTS} (PEFT's save_pretrained writes both)")
    settings = json.loads(path.read_text())
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type is {settings['peft_type']!r}; only LORA is served")
    if settings.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {name!r}: bias={settings['bias']!r} is not served; train with bias='none'")
    used = [option for option in _UNSUPPORTED_OPTIONS if settings.get(option)]
    if used:
        raise LoraError(f"LoRA adapter {name!r}: {', '.join(used)} is not supported; save the adapter without it")
    return settings


def _read_pairs(name: str, root: Path, config: ModelConfig) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """layer -> target -> {"A": tensor, "B": tensor}, read from the safetensors file (mmap)."""
    path = root / ADAPTER_WEIGHTS
    if not path.is_file():
        raise LoraError(f"LoRA adapter {name!r}: {path} is missing (pickle adapter files are refused; "
                        "save with safe_serialization=True)")
    pairs: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    with safe_open(str(path), framework="pt") as handle:
        for key in handle.keys():
            match = _KEY.match(key)
            if match is None or match[2] not in _FUSED_OF or int(match[1]) >= config.num_layers:
                raise LoraError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B of a q/k/v/o or MLP "
                                f"projection of this {config.num_layers}-layer model")
            pairs.setdefault(int(match[1]), {}).setdefault(match[2], {})[match[3]] = handle.get_tensor(key)
    return pairs


def _target_shapes(fused: str, config: ModelConfig) -> tuple[int, list[int]]:
    """A fused projection's input size and its targets' output sizes."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv": (hidden, [q_size, kv_size, kv_size]), "o_proj": (q_size, [hidden]),
            "gate_up": (hidden, [inter, inter]), "down": (inter, [hidden])}[fused]


def _fuse(name: str, fused: str, targets: dict[str, dict[str, torch.Tensor]], config: ModelConfig, rank: int,
          scaling: float, dtype: torch.dtype, device: torch.device | str) -> LoraModule:
    """The targets' A rows stacked, and B block-diagonal at each target's output rows (scaled)."""
    in_size, out_sizes = _target_shapes(fused, config)
    present = [(i, t) for i, t in enumerate(FUSED_TARGETS[fused]) if t in targets]
    a = torch.zeros(rank * len(present), in_size)
    b = torch.zeros(sum(out_sizes), rank * len(present))
    for slot, (i, target) in enumerate(present):
        pair = targets[target]
        if set(pair) != {"A", "B"} or tuple(pair["A"].shape) != (rank, in_size) \
                or tuple(pair["B"].shape) != (out_sizes[i], rank):
            raise LoraError(f"LoRA adapter {name!r}: {target} needs lora_A {(rank, in_size)} and lora_B "
                            f"{(out_sizes[i], rank)} for r={rank} on this model")
        start = sum(out_sizes[:i])
        a[slot * rank:(slot + 1) * rank] = pair["A"].float()
        b[start:start + out_sizes[i], slot * rank:(slot + 1) * rank] = pair["B"].float() * scaling
    owners = torch.zeros(a.shape[0], dtype=torch.long)
    return LoraModule(a.to(device, dtype), b.to(device, dtype), owners.to(device))


def _stack_layer(adapters: list[LoraAdapter], layer: int) -> dict[str, LoraModule]:
    stacked: dict[str, LoraModule] = {}
    for fused in FUSED_TARGETS:
        parts = [(k, a.layers[layer][fused]) for k, a in enumerate(adapters) if fused in a.layers[layer]]
        if parts:
            stacked[fused] = LoraModule(
                torch.cat([m.a for _, m in parts]), torch.cat([m.b for _, m in parts], dim=1),
                torch.cat([torch.full_like(m.owners, k) for k, m in parts]))
    return stacked
