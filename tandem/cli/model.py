"""`tandem model`: pull the default model into the cache, and show a model directory's sizes.

`tandem model pull-default` converts SmolLM2-135M-Instruct once and prints its directory;
`tandem model info DIR [--memory 4GiB]` prints parameters, dtype and the KV cache budget.
"""

from __future__ import annotations

import argparse
import sys

from services.common.config import parse_size
from services.common.model_store import ModelInfo, ModelStoreError, default_model_dir, model_info, pull_default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    actions.add_parser(
        "pull-default",
        help=f"convert the default model into the cache (now {default_model_dir()}); does nothing if present",
    )
    info = actions.add_parser("info", help="print a model directory's architecture, parameters and KV sizes")
    info.add_argument("model_dir", metavar="DIR", help="an HF model directory (config.json + *.safetensors)")
    info.add_argument("--memory", type=parse_size, default=parse_size("4GiB"),
                      help="KV cache budget to size, e.g. 4GiB (default: 4GiB)")


def main(args: argparse.Namespace) -> int:
    try:
        if args.model_command == "pull-default":
            print(pull_default())
        else:
            print(format_info(model_info(args.model_dir, args.memory)))
    except (ModelStoreError, ValueError) as exc:  # ValueError: the runtime's ModelLoadError, bad JSON
        print(f"tandem model: error: {exc}", file=sys.stderr)
        return 1
    return 0


def format_info(info: ModelInfo) -> str:
    rows = [
        ("model", str(info.model_dir)),
        ("architecture", info.architecture),
        ("parameters", f"{info.num_parameters:,} ({info.num_parameters / 1e6:.1f}M)"),
        ("weights", f"{info.weight_bytes:,} bytes ({info.weight_bytes / 2**20:.1f} MiB)"),
        ("dtype", info.dtype),
        ("layers / kv heads / head dim", f"{info.num_layers} / {info.num_kv_heads} / {info.head_dim}"),
        ("kv bytes per token", f"{info.kv_bytes_per_token:,}"),
    ]
    if info.memory_bytes is not None:
        rows.append((f"kv tokens in {info.memory_bytes / 2**30:g} GiB", f"{info.kv_tokens:,}"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
