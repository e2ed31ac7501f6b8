"""Several models of several architectures on one colocated worker, through the gateway: the default
model under two names, and tiny random Qwen2 (q/k/v bias) and Qwen3 (q/k norm) models built here,
all in the catalogue of $TANDEM_HOME/models. Requests for every model at once, interleaved, each
get HF transformers' greedy tokens for their model; and a prompt cached by one name of the default
model earns the other name no prefix credit in the scheduler, nor any cached token on the worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tandem.v1 import gateway_pb2
from tests.e2e.api import MODEL, prompt_of
from tests.hf_reference import Reference, assert_matches, reference_outputs
from tests.mesh import Mesh, collect, greedy_request
from tests.tiny_models import build_tiny
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(300)]

ALIAS = "smol-alias"  # the default model's directory again, under another name
TINY = {
    "tiny-qwen2": ("Qwen2Config", {}),  # q, k and v projections with bias
    "tiny-qwen3": ("Qwen3Config", {"head_dim": 16}),  # RMS norm on each head's q and k
}
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
                  initializer_range=0.5)  # logits far apart: no near-ties in greedy decoding
MODELS = (MODEL, *TINY, ALIAS)
MAX_TOKENS = 10
PROMPTS = ("The three primary colors are red, yellow and blue. Mixing red and blue gives",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return")
BLOCK = 16  # the worker's --block-size default


@pytest.fixture(scope="module")
def home(tmp_path_factory, default_model_dir) -> Path:
    home = tmp_path_factory.mktemp("models-home")
    (home / "models").mkdir()
    (home / "models" / ALIAS).symlink_to(default_model_dir, target_is_directory=True)
    for name, (config_class, extra) in TINY.items():
        build_tiny(default_model_dir, home / "models" / name, config_class, **TINY_SHAPE, **extra)
    return home


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, home, default_model_dir) -> Iterator[Mesh]:
    env = {"TANDEM_HOME": str(home), "TANDEM_THREADS": "1", "TANDEM_KV_MEMORY": "64MiB",
           "TANDEM_MODEL_MEMORY": "2GiB"}  # room for every model: two copies of the default, two tiny ones
    started = Mesh.start("--mode", "colocated", "--model", str(default_model_dir), env=env,
                         run_dir=tmp_path_factory.mktemp("models-run"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [tokenizer(text)["input_ids"] for text in PROMPTS]


@pytest.fixture(scope="module")
def references(home, default_model_dir, prompts) -> dict[str, list[Reference]]:
    """HF greedy on each model, two short prompts: cheaper than the session's parity references (8 of 48 tokens)."""
    default = reference_outputs(default_model_dir, prompts, MAX_TOKENS)
    tiny = {name: reference_outputs(home / "models" / name, prompts, MAX_TOKENS) for name in TINY}
    return {MODEL: default, ALIAS: default, **tiny}


def generate(mesh: Mesh, model: str, prompt: list[int], request_id: str,
             max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[gateway_pb2.GenerateResponse]]:
    request = greedy_request(prompt, max_tokens, model=model, request_id=request_id)
    return collect(mesh.gateway().Generate(request, timeout=120))


def test_every_model_at_once_gets_hf_greedy_tokens(mesh, prompts, references):
    """Interleaved: each model's requests sit between other models' ones, all submitted together."""
    jobs = [(model, index) for index in range(len(prompts)) for model in MODELS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outputs = list(pool.map(lambda job: generate(mesh, job[0], prompts[job[1]], f"parity-{job[0]}-{job[1]}")[0],
                                jobs))
    for (model, index), tokens in zip(jobs, outputs):
        assert_matches(tokens, references[model][index], f"{model}, prompt {index}")
    assert outputs[MODELS.index(MODEL)] == outputs[MODELS.index(ALIAS)]  # one model under two names
    assert len({tuple(tokens) for tokens in outputs[: len(MODELS)]}) == 3  # three different models
    wait_until(lambda: [sorted(m.name for m in w.load.models) for w in mesh.scheduler_stats().workers]
               == [sorted(MODELS)], "the one worker's heartbeat reporting every model resident")


def test_a_prefix_cached_under_one_name_is_no_hit_for_the_other(mesh):
    prompt = prompt_of(3 * BLOCK + 2, 9101)  # three full blocks, all reusable
    cached = 3 * BLOCK

    def warm(model: str) -> None:
        """Sends the prompt for `model` until the scheduler credits its own blocks (they reach its index
        on the worker's token stream, which may come after the client's last token)."""
        attempts = iter(range(1000))
        wait_until(lambda: matched_blocks(mesh, model, prompt, f"warm-{model}-{next(attempts)}") == (3, cached),
                   f"the scheduler crediting {model}'s cached prefix")

    warm(MODEL)
    assert matched_blocks(mesh, ALIAS, prompt, "cross-model") == (0, 0)
    warm(ALIAS)


def matched_blocks(mesh: Mesh, model: str, prompt: list[int], request_id: str) -> tuple[int, int]:
    """(prefix blocks the scheduler credited the worker with, tokens the worker found cached) for one request."""
    tokens, messages = generate(mesh, model, prompt, request_id, max_tokens=1)
    assert len(tokens) == 1
    route = {r.request_id: r for r in mesh.scheduler_stats().recent_routes}[request_id]
    return route.matched_prefix_blocks, messages[-1].usage.cached_tokens
