"""The correctness oracle: HF transformers greedy `generate` on the same model and dtype.

`reference_outputs` runs each prompt alone and keeps the raw logits of every generated
position, so a comparison can tell a real divergence from a near-tie (top two logits within
`NEAR_TIE`), the only divergence a parity test may accept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.paths import tandem_home

NEAR_TIE = 1e-3

LONG_PREFIX = (
    "You are a careful assistant for a small library. The library opens at nine in the morning and closes "
    "at six in the evening, except on Sundays when it is closed all day. Members may borrow up to five books "
    "for three weeks, renew them twice online, and reserve new arrivals at the front desk. Quiet rooms on the "
    "second floor can be booked for two hours at a time. "
)
LONG_STORY = " ".join(
    f"Chapter {i}: the traveller crossed the {color} valley, counted {i * 3} stones by the river, "
    f"and wrote a short note about the weather before resting under a tall {tree} tree."
    for i, color, tree in zip(range(1, 10), ["green", "red", "blue", "grey", "golden", "white", "dark", "quiet", "wide"],
                              ["oak", "pine", "birch", "maple", "cedar", "willow", "elm", "ash", "yew"])
)
PARITY_PROMPTS = [
    "Hello",
    "What is the capital of France?",
    LONG_STORY + " Summarize the journey:",
    LONG_PREFIX + "Question: when does the library close on Saturdays?",
    LONG_PREFIX + "Question: how many books can a member borrow?",
    "The quick brown fox",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
]
MAX_NEW_TOKENS = 48


@dataclass(frozen=True, slots=True)
class Reference:
    prompt_ids: list[int]
    tokens: list[int]
    logits: list[torch.Tensor]


def reference_outputs(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
                      dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[Reference]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    references = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device=device), max_new_tokens=max_new_tokens, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(ids):].tolist()
            references.append(Reference(ids, tokens, [step[0].float().cpu() for step in out.logits]))
    return references


def cached_reference_outputs(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[Reference]:
    """`reference_outputs` in float32 on the CPU, kept under $TANDEM_HOME/hf-references once computed.

    A session fixture is computed inside whichever test first asks for it, so its cost counts against
    that test's timeout: the parity prompts' references took 162 s on a 2-core machine at load 10,
    past a 300-s mark once the test's own work was added, and the fixture's error then failed every
    later test that used it. The key holds everything the answer depends on: the model files (name,
    size, mtime), the prompts, the length, and the torch and transformers versions."""
    path = tandem_home() / "hf-references" / f"{_reference_key(model_dir, prompts, max_new_tokens)}.pt"
    if path.exists():
        return [Reference(**fields) for fields in torch.load(path)]
    references = reference_outputs(model_dir, prompts, max_new_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # sessions computing it at once never clash
    torch.save([dataclasses.asdict(reference) for reference in references], partial)
    os.replace(partial, path)
    return references


def _reference_key(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> str:
    import transformers

    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in model_dir.iterdir() if f.is_file())
    identity = (str(model_dir.resolve()), files, prompts, max_new_tokens, torch.__version__, transformers.__version__)
    return hashlib.sha256(repr(identity).encode()).hexdigest()[:32]


def first_divergence(got: list[int], ref: Reference) -> int | None:
    """Index of the first differing token, or None when `got` equals the reference exactly."""
    for index, (a, b) in enumerate(zip(got, ref.tokens)):
        if a != b:
            return index
    return None if len(got) == len(ref.tokens) else min(len(got), len(ref.tokens))


def assert_matches(got: list[int], ref: Reference, label: str = "", near_tie: float = NEAR_TIE) -> None:
    """Token-exact, except a divergence at a checked near-tie (top two logits within `near_tie`)."""
    index = first_divergence(got, ref)
    if index is None:
        return
    assert index < len(ref.tokens) and index < len(got), (
        f"{label}: length differs: got {len(got)} tokens, reference {len(ref.tokens)}\n got {got}\n ref {ref.tokens}"
    )
    top2 = torch.topk(ref.logits[index], 2).values
    margin = float(top2[0] - top2[1])
    assert margin < near_tie, (
        f"{label}: token {index} is {got[index]}, reference {ref.tokens[index]} (top-2 margin {margin:.2e}, "
        f"not a near-tie)\n got {got}\n ref {ref.tokens}"
    )
