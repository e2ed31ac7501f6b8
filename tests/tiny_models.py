"""Tiny random-weights models the mesh tests serve beside the default model: any transformers
architecture, with the default model's vocabulary, special tokens and tokenizer files, so the
gateway tokenizes for them and HF `generate` on the same directory is their reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def build_tiny(default_model_dir: Path, out: Path, config_class: str, **config: Any) -> Path:
    """`config_class` (a transformers config, e.g. "Qwen2Config") with `config` over the default
    model's vocabulary and special token ids, random weights from seed 0, saved as safetensors in
    `out` with the default model's tokenizer files beside them."""
    import torch
    import transformers

    base = json.loads((default_model_dir / "config.json").read_text())
    special = {key: base[key] for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**special, **config))
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir / name, out / name)
    return out
