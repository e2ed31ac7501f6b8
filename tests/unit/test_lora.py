"""LoRA adapters on a tiny random Llama: greedy tokens equal HF transformers + PEFT for random
PEFT-made adapters (fp32), a batch mixing adapters equals each request run alone, the prefix
cache never shares blocks across adapters, and the loaded set is LRU under --max-loras."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.common.block_hash import hash_chain
from services.runtime.attention import TorchAttention
from services.runtime.engine import Engine, EngineConfig
from services.common.lora_catalogue import LoraCatalogueError, lora_sources, split_model
from services.runtime.lora import LoraError, LoraManager
from services.runtime.model import CausalLM
from services.runtime.sampler import SamplingParams
from tests.unit.test_model_tiny import PROMPT, make_tiny

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, alpha, targets, rslora, seed)
    "all4": (4, 8, ALL_TARGETS, False, 1),
    "qv16": (16, 16, ["q_proj", "v_proj"], True, 2),
    "mlp8": (8, 32, ["gate_proj", "up_proj", "down_proj", "o_proj"], False, 3),
}
PROMPTS = [PROMPT[:11], PROMPT[3:17], PROMPT[:6]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """The base model's directory and each adapter's, made with PEFT itself (random A and B)."""
    import peft

    root = tmp_path_factory.mktemp("lora")
    make_tiny("llama", root / "base")
    dirs = {}
    for name, (rank, alpha, targets, rslora, seed) in ADAPTERS.items():
        base = _hf_base(root / "base")
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                 init_lora_weights=False, lora_dropout=0.0)
        peft.get_peft_model(base, config).save_pretrained(root / name, safe_serialization=True)
        dirs[name] = root / name
    return root / "base", dirs


def _hf_base(model_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int]) -> list[int]:
    import peft

    model = _hf_base(model_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine(tiny, max_loras: int = 4) -> Engine:
    base, dirs = tiny
    model = CausalLM.from_model_dir(base, TorchAttention())
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_loras=max_loras)
    return Engine(model, config, loras=LoraManager(dirs, max_loras, model.config, torch.float32))


def _run(engine: Engine, requests: list[tuple[str, list[int], str]]) -> dict[str, list[int]]:
    """Runs (request id, prompt, adapter) together to the end; returns each one's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for rid, prompt, lora in requests:
        engine.add_request(rid, prompt, params, lora=lora)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return outputs


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_greedy_with_adapter_matches_peft(tiny, name):
    torch.set_num_threads(1)
    base, dirs = tiny
    expected = _hf_greedy(base, dirs[name], PROMPTS[0])
    assert expected != _hf_greedy(base, None, PROMPTS[0])  # the adapter changes the output
    assert _run(_engine(tiny), [("r", PROMPTS[0], name)])["r"] == expected


def test_mixed_adapter_batch_equals_each_request_alone(tiny):
    torch.set_num_threads(1)
    requests = [(f"{lora or 'base'}-{i}", prompt, lora)
                for i, prompt in enumerate(PROMPTS) for lora in ["", *sorted(ADAPTERS)]]
    alone = {rid: _run(_engine(tiny), [(rid, prompt, lora)])[rid] for rid, prompt, lora in requests}
    engine = _engine(tiny)
    together = _run(engine, requests)
    assert together == alone
    changed = [rid for rid, _, lora in requests if lora and together[rid] != together[f"base-{rid[-1]}"]]
    assert len(changed) == 9, changed  # every adapter changes every prompt's output


def test_batched_apply_equals_per_adapter_loop(tiny):
    engine = _engine(tiny)
    for name in ADAPTERS:
        engine.loras.acquire(name)
    batch = engine.loras.batch([("all4", 3), ("", 2), ("qv16", 1), ("mlp8", 4), ("all4", 1)])
    x = torch.randn(11, engine.model_config.hidden_size)
    for fused in ["qkv", "gate_up"]:
        torch.testing.assert_close(batch.delta_masked(0, fused, x), batch.delta_looped(0, fused, x))
    assert batch.delta_masked(0, "qkv", x)[3:5].abs().max() == 0  # rows of no adapter get no update
    assert batch.delta_looped(0, "qkv", x)[3:5].abs().max() == 0


def test_prefix_cache_is_never_shared_across_adapters(tiny):
    engine = _engine(tiny)
    prompt = PROMPTS[0]  # 11 tokens: 2 full blocks of 4
    _run(engine, [("a", prompt, "all4")])
    cached_a = engine.blocks.match_prefix(hash_chain(prompt, 4, adapter="all4"), [tuple(prompt[:4]), tuple(prompt[4:8])])
    assert len(cached_a) == 2
    assert engine.blocks.match_prefix(hash_chain(prompt, 4, adapter="qv16"), [tuple(prompt[:4]), tuple(prompt[4:8])]) == []
    assert engine.blocks.match_prefix(hash_chain(prompt, 4), [tuple(prompt[:4]), tuple(prompt[4:8])]) == []
    for rid, lora, cached in [("b", "qv16", 0), ("none", "", 0), ("a-again", "all4", 8)]:
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), lora=lora)
        engine.step()
        assert engine.last_work[rid].num_cached_tokens == cached, rid
    assert hash_chain(prompt, 4) == hash_chain(prompt, 4, salt="", adapter="")
    assert len({hash_chain(prompt, 4, adapter="x")[0], hash_chain(prompt, 4, salt="x")[0],
                hash_chain(prompt, 4, salt="lora", adapter="x")[0], hash_chain(prompt, 4)[0]}) == 4


def test_loaded_adapters_are_lru_and_busy_ones_stay(tiny):
    engine = _engine(tiny, max_loras=2)
    loras = engine.loras
    loras.acquire("all4")
    loras.acquire("qv16")
    loras.release("all4")
    loras.release("qv16")
    loras.acquire("all4")  # now qv16 is the least recently used
    loras.release("all4")
    loras.acquire("mlp8")
    assert loras.loaded == ["all4", "mlp8"]
    loras.acquire("all4")
    with pytest.raises(LoraError, match="all 2 adapter slots hold adapters of running requests; raise --max-loras"):
        loras.acquire("qv16")
    assert loras.loaded == ["mlp8", "all4"]


def test_unknown_or_unservable_adapters_are_refused(tiny, tmp_path):
    engine = _engine(tiny)
    params = SamplingParams(max_tokens=1)
    with pytest.raises(LoraError, match=r"unknown LoRA adapter 'nope'; this worker serves: all4, mlp8, qv16"):
        engine.add_request("x", PROMPTS[0], params, lora="nope")
    assert not engine.has_request("x")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "use_dora": True}))
    model = engine.model
    with pytest.raises(LoraError, match="use_dora is not supported"):
        LoraManager({"bad": tmp_path / "bad"}, 1, model.config, torch.float32).acquire("bad")
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(LoraError, match="pickle adapter files are refused"):
        LoraManager({"p": tmp_path / "pickled"}, 1, model.config, torch.float32).acquire("p")


def test_lora_sources_from_home_and_flags(tmp_path):
    (tmp_path / "loras" / "alpha").mkdir(parents=True)
    (tmp_path / "loras" / "alpha" / "adapter_config.json").write_text("{}")
    (tmp_path / "loras" / "empty").mkdir()
    assert lora_sources(["beta=/x/beta"], home=tmp_path) == {"alpha": tmp_path / "loras" / "alpha",
                                                            "beta": Path("/x/beta")}
    with pytest.raises(LoraCatalogueError, match="--lora takes NAME=DIR"):
        lora_sources(["a:b=/x"], home=tmp_path)
    assert split_model("SmolLM2-135M-Instruct:my-adapter") == ("SmolLM2-135M-Instruct", "my-adapter")
    assert split_model("SmolLM2-135M-Instruct") == ("SmolLM2-135M-Instruct", "")
