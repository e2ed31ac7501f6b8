"""LoRA benchmark: the masked apply of services/runtime/lora.py against looping adapter by
adapter, on the default model's shapes, and what adapters cost a whole decode step.

For K adapters of rank `--rank` on every q/k/v/o and MLP projection, rows spread evenly over them
(32 rows: a decode batch; 512: a prefill chunk), it times every layer's LoRA updates both ways,
then an engine decode step of 32 requests with no adapter and with K. Random adapters are written
in the PEFT layout first, so the loader is the real one.
Run: `flock /tmp/tandem-bench.lock .venv/bin/python bench/lora.py [--threads 2] [--rank 16] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.model_config import ModelConfig  # noqa: E402
from services.common.model_store import ensure_default_model  # noqa: E402
from services.runtime.engine import Engine, EngineConfig  # noqa: E402
from services.runtime.lora import FUSED_TARGETS, LoraBatch, LoraManager  # noqa: E402
from services.runtime.precision import Precision  # noqa: E402
from services.runtime.sampler import SamplingParams  # noqa: E402

ADAPTER_COUNTS = (1, 4, 8)
ROW_COUNTS = (32, 512)
_SHAPES = {"q_proj": ("q", "h"), "k_proj": ("kv", "h"), "v_proj": ("kv", "h"), "o_proj": ("h", "q"),
           "gate_proj": ("i", "h"), "up_proj": ("i", "h"), "down_proj": ("h", "i")}


def write_adapter(directory: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A random PEFT-layout adapter on every q/k/v/o and MLP projection."""
    sizes = {"h": config.hidden_size, "i": config.intermediate_size, "q": config.num_heads * config.head_dim,
             "kv": config.num_kv_heads * config.head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target, (out, inp) in _SHAPES.items():
            group = "mlp" if target in FUSED_TARGETS["gate_up"] + FUSED_TARGETS["down"] else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{group}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, sizes[inp], generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(sizes[out], rank, generator=generator) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                               "target_modules": list(_SHAPES)}))


def best_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def apply_ms(batch: LoraBatch, x: torch.Tensor, inter: int, looped: bool) -> float:
    """Every layer's four projection updates (inputs of the right widths), in milliseconds."""
    apply = batch.delta_looped if looped else batch.delta_masked
    wide = x.new_zeros(x.shape[0], inter)

    def run() -> None:
        for layer in range(len(batch.layers)):
            for fused in FUSED_TARGETS:
                apply(layer, fused, wide if fused == "down" else x)
    return best_ms(run)


def decode_step_ms(engine: Engine, names: list[str], rows: int) -> float:
    """One decode step of `rows` running requests, their adapters taken in turn from `names`."""
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"r{i}", [1 + i, 2, 3, 4], params, lora=names[i % len(names)])
    engine.step()  # the prompts
    ms = best_ms(engine.step)
    for i in range(rows):
        engine.abort(f"r{i}")
    return ms


def measure(model_dir: Path, rank: int) -> list[dict]:
    config = ModelConfig.from_model_dir(model_dir)
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        sources = {f"a{k}": Path(tmp) / f"a{k}" for k in range(max(ADAPTER_COUNTS))}
        for k, directory in enumerate(sources.values()):
            write_adapter(directory, config, rank, k)
        engine = Engine.from_model_dir(model_dir, EngineConfig(precision=Precision(torch.float32, "none"),
                                                              max_loras=max(ADAPTER_COUNTS)), sources)
        base_step = decode_step_ms(engine, [""], 32)
        for count in ADAPTER_COUNTS:
            names = [f"a{k}" for k in range(count)]
            for rows in ROW_COUNTS:
                for name in names:
                    engine.loras.acquire(name)
                batch = engine.loras.batch([(names[i % count], 1) for i in range(rows)])
                x = torch.randn(rows, config.hidden_size)
                rows_out.append({"adapters": count, "rows": rows,
                                 "masked_ms": apply_ms(batch, x, config.intermediate_size, looped=False),
                                 "looped_ms": apply_ms(batch, x, config.intermediate_size, looped=True)})
                for name in names:
                    engine.loras.release(name)
            rows_out.append({"adapters": count, "rows": 32, "decode_step_ms": decode_step_ms(engine, names, 32),
                             "base_decode_step_ms": base_step})
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = measure(args.model or ensure_default_model(), args.rank)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for row in results:
        if "masked_ms" in row:
            print(f"LoRA apply, {row['adapters']} adapters x {row['rows']} rows: masked {row['masked_ms']:.2f} ms, "
                  f"looped {row['looped_ms']:.2f} ms ({row['looped_ms'] / row['masked_ms']:.2f}x)")
        else:
            print(f"decode step of 32 over {row['adapters']} adapters: {row['decode_step_ms']:.1f} ms "
                  f"(no adapter: {row['base_decode_step_ms']:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
