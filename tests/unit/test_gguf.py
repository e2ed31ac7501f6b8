"""int4 groups read straight from a GGUF's Q4_1 blocks (services/runtime/gguf_weights.py).

The oracle: groups taken from the file dequantize bit for bit to the fp32 weights HF's converter
wrote from the same file (gguf's own Q4_1 dequantization, then transformers' reverse permutation of
llama's q/k rows). And every way the file cannot serve falls back, saying why.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from services.common.gguf_source import (
    SOURCE_FILE,
    GgufSourceError,
    describe_gguf,
    read_source,
    weights_line,
    write_source,
)
from services.runtime.gguf_weights import GgufGroups, dequantized, q4_1_groups, rope_row_order
from services.runtime.loader import WeightReader
from services.runtime.quantization import Int4Groups, int4_linear, make_linear

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 2, 1, 16, 64
Q_NAME = "model.layers.0.self_attn.q_proj.weight"
K_NAME = "model.layers.0.self_attn.k_proj.weight"
DOWN_NAME = "model.layers.0.mlp.down_proj.weight"
EMBED_NAME = "model.embed_tokens.weight"
SHAPES = {Q_NAME: (HEADS * HEAD_DIM, HIDDEN), K_NAME: (KV_HEADS * HEAD_DIM, HIDDEN), DOWN_NAME: (HIDDEN, 96),
          EMBED_NAME: (48, HIDDEN)}


def _hf_weights(file_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> dict[str, torch.Tensor]:
    """What HF's converter makes of the file's tensors: gguf's dequantization, then transformers'
    reverse permutation of llama's q/k rows."""
    processor = LlamaTensorProcessor({"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    names = {"blk.0.attn_q.weight": Q_NAME, "blk.0.attn_k.weight": K_NAME, "blk.0.ffn_down.weight": DOWN_NAME,
             "token_embd.weight": EMBED_NAME}
    weights = {}
    for gguf_name, (blocks, qtype) in file_tensors.items():
        values = gguf.quants.dequantize(blocks, qtype)
        weights[names[gguf_name]] = torch.from_numpy(processor.process(values, gguf_name).weights.copy())
    return weights


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A model directory converted from a tiny llama GGUF (q, k and down in Q4_1, the embedding in
    Q8_0): HF-ordered safetensors and the source record."""
    generator = np.random.default_rng(7)
    file_tensors = {
        gguf_name: (gguf.quants.quantize(generator.standard_normal(SHAPES[hf]).astype(np.float32), qtype), qtype)
        for gguf_name, hf, qtype in [("token_embd.weight", EMBED_NAME, Q8_0), ("blk.0.attn_q.weight", Q_NAME, Q4_1),
                                     ("blk.0.attn_k.weight", K_NAME, Q4_1), ("blk.0.ffn_down.weight", DOWN_NAME, Q4_1)]
    }
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    writer.add_block_count(1)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    for name, (blocks, qtype) in file_tensors.items():
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    weights = _hf_weights(file_tensors)
    save_file(weights, str(model_dir / "model.safetensors"))
    write_source(model_dir, describe_gguf(tmp_path / "tiny.gguf", weights))
    return model_dir


def test_the_record_names_each_tensor_where_it_lies(tiny):
    source = read_source(tiny)
    assert source.architecture == "llama" and source.path == (tiny.parent / "tiny.gguf").resolve()
    assert {name: (t.gguf_name, t.type, t.shape, t.rope_heads) for name, t in source.tensors.items()} == {
        Q_NAME: ("blk.0.attn_q.weight", "Q4_1", (32, 64), HEADS),
        K_NAME: ("blk.0.attn_k.weight", "Q4_1", (16, 64), KV_HEADS),
        DOWN_NAME: ("blk.0.ffn_down.weight", "Q4_1", (64, 96), None),
        EMBED_NAME: ("token_embd.weight", "Q8_0", (48, 64), None),
    }
    assert source.tensors[Q_NAME].nbytes == 32 * 64 // 32 * 20


@pytest.mark.parametrize("name", [Q_NAME, K_NAME, DOWN_NAME])
def test_groups_dequantize_to_hf_weights_bit_for_bit(tiny, name):
    reader = WeightReader(tiny)
    groups = reader.int4_groups([name], [SHAPES[name]])
    assert groups.codes.dtype == torch.uint8 and int(groups.codes.max()) <= 15
    assert torch.equal(dequantized(groups), reader.take(name, SHAPES[name]))
    assert reader.gguf_tensors == 1


def test_a_fused_projection_joins_its_groups_by_rows(tiny):
    reader = WeightReader(tiny)
    groups = reader.int4_groups([Q_NAME, K_NAME], [SHAPES[Q_NAME], SHAPES[K_NAME]])
    assert torch.equal(dequantized(groups), torch.cat([reader.take(Q_NAME, SHAPES[Q_NAME]),
                                                        reader.take(K_NAME, SHAPES[K_NAME])]))
    assert reader.gguf_tensors == 2


def test_rope_row_order_is_transformers_reverse_permutation():
    rows = np.arange(9 * 64)
    expected = LlamaTensorProcessor()._reverse_permute_weights(rows, 9)
    assert rope_row_order(9 * 64, 9).tolist() == expected.tolist()


def test_q4_1_block_layout():
    """d and m as fp16, then byte j holding weight j (low nibble) and weight j + 16 (high nibble)."""
    block = np.zeros(20, dtype=np.uint8)
    block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    block[2:4] = np.frombuffer(np.float16(-1.0).tobytes(), dtype=np.uint8)
    block[4] = 0x3A  # weight 0: code 10, weight 16: code 3
    groups = q4_1_groups(torch.from_numpy(block).view(1, 1, 20), (1, 32))
    assert groups.codes[0, 0] == 10 and groups.codes[0, 16] == 3 and int(groups.codes[0].sum()) == 13
    assert groups.scale.tolist() == [[0.5]] and groups.minimum.tolist() == [[-1.0]]
    assert dequantized(groups)[0, :2].tolist() == [4.0, -1.0]


def test_a_type_other_than_q4_1_falls_back_logged_once(tiny, caplog):
    reader = WeightReader(tiny)
    with caplog.at_level(logging.INFO, logger="services.runtime.gguf_weights"):
        assert reader.int4_groups([EMBED_NAME], [SHAPES[EMBED_NAME]]) is None
        assert reader.int4_groups([Q_NAME, EMBED_NAME], [SHAPES[Q_NAME], SHAPES[EMBED_NAME]]) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"weights: tiny.gguf stores {EMBED_NAME} as Q8_0, which is not int4 groups; "
        "quantizing those from the safetensors instead"]
    assert reader.gguf_tensors == 0


def test_a_directory_without_a_record_has_no_groups(tiny):
    (tiny / SOURCE_FILE).unlink()
    assert GgufGroups.open(tiny) is None
    assert WeightReader(tiny).int4_groups([Q_NAME], [SHAPES[Q_NAME]]) is None


@pytest.mark.parametrize("change", ["missing", "resized"])
def test_a_missing_or_changed_file_falls_back(tiny, caplog, change):
    path = tiny.parent / "tiny.gguf"
    if change == "missing":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes() + b"\0")
    assert WeightReader(tiny).int4_groups([Q_NAME], [SHAPES[Q_NAME]]) is None
    assert "which is missing or changed; int4 weights are quantized from the safetensors instead" in caplog.text


def test_a_stale_record_is_not_used(tiny, caplog):
    """The safetensors no longer hold the file's weights: the first tensor taken shows it."""
    weights = {name: torch.ones(shape) for name, shape in SHAPES.items()}
    save_file(weights, str(tiny / "model.safetensors"))
    reader = WeightReader(tiny)
    assert reader.int4_groups([Q_NAME], [SHAPES[Q_NAME]]) is None
    assert reader.int4_groups([DOWN_NAME], [SHAPES[DOWN_NAME]]) is None
    assert f"'s {Q_NAME} does not dequantize to {tiny}'s; its record (gguf_source.json) is stale" in caplog.text
    assert reader.gguf_tensors == 0


def test_make_linear_runs_the_groups_given():
    """Groups from the file are packed as they are, not re-derived from the dense weight."""
    generator = torch.Generator().manual_seed(3)
    groups = Int4Groups(torch.randint(0, 16, (32, 64), generator=generator, dtype=torch.uint8),
                        torch.rand(32, 2, generator=generator), -torch.rand(32, 2, generator=generator))
    x = torch.randn(3, 64, generator=generator).to(torch.bfloat16)
    given = make_linear(torch.zeros(32, 64), None, "int4", torch.bfloat16, groups=groups)
    assert torch.equal(given(x), int4_linear(groups, None, torch.bfloat16)(x))
    assert not torch.equal(given(x), make_linear(torch.zeros(32, 64), None, "int4", torch.bfloat16)(x))


def test_the_shipped_files_q4_1_tensors_are_the_converted_weights(default_model_dir):
    """The strong oracle on the default model: every Q4_1 tensor of the first, a middle and the last
    layer (q and k permuted) dequantizes bit for bit to the fp32 safetensors the converter wrote. All
    210 do (checked once; the whole file takes ten times as long)."""
    source = read_source(default_model_dir)
    assert (source.count("Q4_1"), source.count("Q8_0"), source.count("F32")) == (210, 1, 61)
    reader = WeightReader(default_model_dir)
    checked = [(name, t.shape) for name, t in source.tensors.items()
               if t.type == "Q4_1" and name.split(".")[2] in ("0", "15", "29")]
    for name, shape in checked:
        assert torch.equal(dequantized(reader.int4_groups([name], [shape])), reader.take(name, shape)), name
    assert len(checked) == reader.gguf_tensors == 21


def test_the_weights_line_names_the_source(tiny):
    assert weights_line(tiny) == (f"{tiny} (safetensors converted from tiny.gguf; int4 takes the groups of its "
                                  "3 Q4_1 tensors from the file as shipped)")
    (tiny / SOURCE_FILE).unlink()
    assert weights_line(tiny) == f"{tiny} (safetensors)"


def test_a_malformed_record_says_what_to_do(tiny):
    (tiny / SOURCE_FILE).write_text('{"path": "x"}')
    with pytest.raises(GgufSourceError, match=r"gguf_source.json: not a valid record \('tensors'\); delete it"):
        WeightReader(tiny).int4_groups([Q_NAME], [SHAPES[Q_NAME]])
