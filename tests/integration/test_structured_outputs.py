"""Structured outputs and logit_bias in the engine, on the default model: sampled outputs (temperature
> 0, many seeds, one batch) always follow their constraint; the grammar state survives the KV
hand-off and a migration; unconstrained rows of a mixed batch stay token-exact vs HF."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.common.structured_output import StructuredOutput
from services.common.tokenizer import TextCodec
from services.runtime.engine import Engine, EngineConfig
from services.runtime.kv_handoff import KvHandoff
from services.runtime.sampler import SamplingParams
from services.runtime.sequence import FinishReason
from tests.hf_reference import MAX_NEW_TOKENS, assert_matches

SEEDS = range(12)
MIXED_ROWS = 4  # parity prompts decoded greedily, unconstrained, in the constrained rows' batch
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
CHOICES = ("positive", "negative", "neutral")
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CONSTRAINED = {  # row kind: (prompt text, constraint)
    "json": ("Describe a user as JSON:", StructuredOutput("json_schema", json.dumps(PERSON))),
    "object": ("A JSON object:", StructuredOutput("json_object")),
    "choice": ("The sentiment of 'I loved it' is", StructuredOutput("choice", choices=CHOICES)),
    "regex": ("A US phone number:", StructuredOutput("regex", PHONE)),
}


@pytest.fixture(scope="module")
def engine(default_model_dir) -> Engine:
    return Engine.from_model_dir(default_model_dir, EngineConfig(num_kv_blocks=1024))


@pytest.fixture(scope="module")
def codec(default_model_dir) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    """All requests in one batch, stepped to the end: each one's tokens and finish reason."""
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, str] = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason.value
    return {rid: (tokens[rid], reasons[rid]) for rid in requests}


def sampled(structured: StructuredOutput, seed: int, max_tokens: int = 64) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=structured)


@pytest.fixture(scope="module")
def batch(engine, codec, parity_prompts) -> dict[str, tuple[list[int], str]]:
    """One batch of every kind of row: JSON schema, JSON object, choice and regex rows sampled over
    many seeds, and unconstrained greedy rows (parity prompts), side by side."""
    requests = {f"plain-{i}": (p, GREEDY) for i, p in enumerate(parity_prompts[:MIXED_ROWS])}
    for kind, (text, constraint) in CONSTRAINED.items():
        requests |= {f"{kind}-{s}": (codec.encode(text), sampled(constraint, s)) for s in SEEDS}
    return run(engine, requests)


def rows(batch: dict[str, tuple[list[int], str]], kind: str) -> list[tuple[list[int], str]]:
    return [result for rid, result in batch.items() if rid.rsplit("-", 1)[0] == kind]


def test_json_schema_outputs_validate_for_every_seed(batch, engine, codec):
    texts = set()
    for tokens, reason in rows(batch, "json"):
        text = codec.decode(tokens)
        jsonschema.validate(json.loads(text), PERSON)
        assert reason == "stop", text
        assert tokens[-1] not in engine.model_config.eos_token_ids  # the grammar ended it, not EOS
        texts.add(text)
    assert len(texts) > 1  # the seeds really sampled


def test_json_object_outputs_parse_as_objects(batch, codec):
    for tokens, reason in rows(batch, "object"):
        if reason == "stop":
            assert isinstance(json.loads(codec.decode(tokens)), dict)
        else:  # an open-ended object may still be open at max_tokens; it is a valid prefix then
            assert reason == "length" and codec.decode(tokens).startswith("{")


def test_choice_yields_only_the_choices(batch, codec):
    for tokens, reason in rows(batch, "choice"):
        assert codec.decode(tokens) in CHOICES and reason == "stop"


def test_regex_outputs_match(batch, codec):
    for tokens, reason in rows(batch, "regex"):
        assert re.fullmatch(PHONE, codec.decode(tokens)) and reason == "stop"


def test_unconstrained_rows_of_a_mixed_batch_match_hf(batch, parity_references):
    for i, reference in enumerate(parity_references[:MIXED_ROWS]):
        assert_matches(batch[f"plain-{i}"][0], reference, f"mixed batch prompt {i}")


def test_logit_bias_bans_the_greedy_token(engine, codec):
    prompt = codec.encode("The capital of France is")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = run(engine, {"plain": (prompt, greedy)})["plain"][0]
    banned = plain[0]
    biased = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=((banned, -100.0),))
    out = run(engine, {"biased": (prompt, biased)})["biased"][0]
    assert out != plain and banned not in out
    clamped = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=((banned, -1e9),))
    assert run(engine, {"clamped": (prompt, clamped)})["clamped"][0] == out  # -1e9 acts as -100


def test_grammar_survives_the_kv_handoff_and_a_migration(default_model_dir, engine, codec):
    prompt = codec.encode("Describe a user as JSON:")
    params = sampled(StructuredOutput("json_schema", json.dumps(PERSON)), 5)
    whole, _ = run(engine, {"whole": (prompt, params)})["whole"]
    source, target = engine, Engine.from_model_dir(default_model_dir, EngineConfig(num_kv_blocks=256))
    source.add_request("moved", prompt, params, stop_after_prefill=True)
    (out,) = source.step()
    assert out.finish_reason is FinishReason.PREFILLED and out.new_token_ids == whole[:1]
    exporter, importer = KvHandoff(source), KvHandoff(target)
    reservation = importer.reserve("moved", len(prompt) + 1)
    export = exporter.export("moved", max_chunk_bytes=1 << 20)
    for chunk in export.chunks:
        assert importer.import_chunk(reservation, chunk)
    importer.admit("moved", prompt, out.new_token_ids, params, seed=5)
    exporter.release_export("moved")
    tokens = list(out.new_token_ids)
    while target.has_unfinished():
        for step_out in target.step():
            tokens.extend(step_out.new_token_ids)
    assert tokens == whole
    delivered = whole[:7]  # a continuation: the prompt carries the delivered tokens
    resumed = StructuredOutput("json_schema", json.dumps(PERSON), num_generated_prompt_tokens=len(delivered))
    moved = SamplingParams(max_tokens=64 - len(delivered), temperature=1.0, seed=5, structured=resumed)
    rest, reason = run(target, {"migrated": (prompt + delivered, moved)})["migrated"]
    assert delivered + rest == whole and reason == "stop"
