"""`tandem generate`: run prompts through the in-process engine and stream the text.

All `--prompt`s go into one batch. Text streams to the terminal prompt by prompt (the first
live, the others catching up as their turn comes); `--json` prints one object per prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import TextIO

from services.common.model_store import ensure_default_model
from services.common.tokenizer import IncrementalDetokenizer, TextCodec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                        help="a prompt; repeat to run several in one batch")
    parser.add_argument("--model", metavar="DIR", help="HF model directory (default: the default model)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--greedy", action="store_true", help="always pick the most likely token")
    parser.add_argument("--max-tokens", type=int, default=256, metavar="N", help="new tokens per prompt (default 256)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    parser.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    parser.add_argument("--seed", type=int, help="seed for reproducible sampling")
    parser.add_argument("--json", action="store_true",
                        help='print {"prompt", "token_ids", "text", "finish_reason"} per prompt, one per line')
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")


@dataclass(slots=True)
class Completion:
    """One prompt's progress: its output tokens and the text not yet shown."""

    prompt: str
    detokenizer: IncrementalDetokenizer
    pending: list[str] = field(default_factory=list)
    finish_reason: str | None = None

    def push(self, token_ids: list[int]) -> None:
        self.pending.append(self.detokenizer.push(token_ids))

    def finish(self, reason: str) -> None:
        self.pending.append(self.detokenizer.flush())
        self.finish_reason = reason

    def take_text(self) -> str:
        text, self.pending = "".join(self.pending), []
        return text


class StreamView:
    """Shows completions in prompt order: the one in focus streams live; the next gets the focus
    (and prints what it has gathered) once the one before it has finished."""

    def __init__(self, completions: list[Completion], out: TextIO) -> None:
        self._completions = completions
        self._out = out
        self._focus = -1
        self._advance()

    def update(self) -> None:
        while self._focus < len(self._completions):
            current = self._completions[self._focus]
            self._out.write(current.take_text())
            if current.finish_reason is None:
                break
            self._out.write("\n" if current.finish_reason == "stop" else f"\n[finished: {current.finish_reason}]\n")
            self._advance()
        self._out.flush()

    def _advance(self) -> None:
        self._focus += 1
        if self._focus < len(self._completions) and len(self._completions) > 1:
            self._out.write(f"\n=== prompt {self._focus + 1}: {self._completions[self._focus].prompt}\n")


def main(args: argparse.Namespace) -> int:
    from services.runtime.engine import Engine, EngineConfig
    from services.runtime.sampler import SamplingParams

    model_dir = args.model or ensure_default_model()
    codec = TextCodec.from_model_dir(model_dir)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0 if args.greedy else args.temperature,
        top_p=1.0 if args.greedy else args.top_p,
        seed=args.seed,
        stop_token_ids=codec.eos_token_ids,
    )
    engine = Engine.from_model_dir(model_dir, EngineConfig(device=args.device, num_threads=args.threads))
    completions = [Completion(prompt, codec.incremental()) for prompt in args.prompt]
    try:
        for index, prompt in enumerate(args.prompt):
            engine.add_request(str(index), _prompt_ids(codec, prompt, args.chat), params)
    except ValueError as exc:
        print(f"tandem generate: error: {exc}", file=sys.stderr)
        return 2
    view = None if args.json else StreamView(completions, sys.stdout)
    while engine.has_unfinished():
        for output in engine.step():
            completion = completions[int(output.request_id)]
            completion.push(output.new_token_ids)
            if output.finish_reason is not None:
                completion.finish(output.finish_reason.value)
        if view is not None:
            view.update()
    if args.json:
        for completion in completions:
            print(json.dumps(_as_json(completion, codec), ensure_ascii=False))
    return 0


def _prompt_ids(codec: TextCodec, prompt: str, chat: bool) -> list[int]:
    return codec.apply_chat_template([{"role": "user", "content": prompt}]) if chat else codec.encode(prompt)


def _as_json(completion: Completion, codec: TextCodec) -> dict[str, object]:
    token_ids = completion.detokenizer.token_ids
    return {
        "prompt": completion.prompt,
        "token_ids": token_ids,
        "text": codec.decode(token_ids),
        "finish_reason": completion.finish_reason,
    }
