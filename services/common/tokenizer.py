"""Text <-> token ids for a model directory: encoding exactly as HF does, the chat template,
and UTF-8-safe incremental detokenization for streaming. Never imports torch."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from services.common.tool_prompt import fallback_messages, native_messages, template_supports_tools

REPLACEMENT_CHAR = "\ufffd"


class TextCodec:
    """One model's tokenizer (tokenizer.json + tokenizer_config.json) and its end-of-sequence ids.

    Safe to share between threads without a lock: encoding goes straight to the Rust tokenizer
    (`encode_batch`, which releases the GIL while it works), configured once here as HF's own
    call configures it (no truncation, no padding), so no call ever reconfigures it. Reconfiguring
    on every call is what makes HF's call fail with "Already borrowed" when threads share it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = tokenizer.split_special_tokens
        # HF's decode is the Rust decode plus, when configured, its clean-up of spaces: without
        # one, decoding goes straight to Rust (a streamed token decodes twice; HF's wrapper cost
        # more than the decoding itself).
        self._decodes_raw = not tokenizer.clean_up_tokenization_spaces
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> TextCodec:
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{model_dir / 'tokenizer.json'}: missing; the model directory needs a fast tokenizer"
            )
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        return cls(tokenizer, _eos_token_ids(model_dir, tokenizer))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return len(self._tokenizer)

    @property
    def has_chat_template(self) -> bool:
        """Whether apply_chat_template can work (tokenizer_config.json has a chat_template)."""
        return self._tokenizer.chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Exactly `tokenizer(text)["input_ids"]` of HF transformers (special tokens as configured)."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def renders_tools(self) -> bool:
        """Whether the model's chat template renders tools itself (else tool_prompt's fallback does)."""
        template = self._tokenizer.chat_template
        return isinstance(template, str) and template_supports_tools(template)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The model's chat template over `messages` (and `tools`, OpenAI's tool objects), ending with
        the assistant's turn opened: the rendered text encoded without added special tokens, as HF's
        `tokenize=True` does. A template without tool support gets tools, tool calls and tool
        results written into plain messages by tool_prompt's fallback."""
        if self._tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer_config.json has no chat_template; send a plain prompt instead")
        if self.renders_tools:
            text = self._tokenizer.apply_chat_template(native_messages(messages), tools=tools or None,
                                                       add_generation_prompt=True, tokenize=False)
        else:
            text = self._tokenizer.apply_chat_template(fallback_messages(messages, tools),
                                                       add_generation_prompt=True, tokenize=False)
        return self.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Exactly `tokenizer.decode(ids, skip_special_tokens=...)` of HF transformers."""
        if self._decodes_raw:
            return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def incremental(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool) -> Callable[[int], str | None] | None:
        """The Rust tokenizer's own incremental decoder: one call per token, the new text or None
        while it is held back. None when HF's decode would also clean up spaces (it cannot)."""
        if not self._decodes_raw:
            return None
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return functools.partial(stream.step, self._tokenizer.backend_tokenizer)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Invariant: the deltas returned by `push` and `flush`, concatenated, equal
    `codec.decode(all ids)`. A delta never ends in a partial UTF-8 character: while the
    decoded tail ends in U+FFFD (bytes of an unfinished character) the text is held back until
    a later token completes it, or until `flush`.

    Decoding works on a window: ids[prefix:read] is text already emitted, kept as context so
    that decoders that depend on the preceding token (leading spaces) produce the same text as
    a full decode; the delta is what decoding ids[prefix:] adds to it. While streaming, the Rust
    tokenizer's DecodeStream does the same per token, in one call (TextCodec.decode_stream); the
    window is then kept only for `flush`.
    """

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True) -> None:
        self._codec = codec
        self._skip_special_tokens = skip_special_tokens
        self._step = codec.decode_stream(skip_special_tokens)
        self._token_ids: list[int] = []
        self._prefix = 0
        self._read = 0

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the new complete text (possibly "")."""
        if self._step is not None:
            if len(token_ids) == 1:  # one token an event, as a stream usually has
                return self._stepped(token_ids[0])
            return "".join([self._stepped(token_id) for token_id in token_ids])
        self._token_ids.extend(token_ids)
        delta = self._pending_text()
        if delta.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return delta

    def flush(self) -> str:
        """Returns whatever is still held back (an unfinished character decodes as U+FFFD)."""
        delta = self._pending_text()
        self._advance()
        return delta

    def _stepped(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        text = self._step(token_id)
        if text is None:
            return ""
        self._advance()
        return text

    def _pending_text(self) -> str:
        emitted = self._decode(self._token_ids[self._prefix : self._read])
        window = self._decode(self._token_ids[self._prefix :])
        return window[len(emitted) :]

    def _advance(self) -> None:
        self._prefix, self._read = self._read, len(self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._codec.decode(token_ids, self._skip_special_tokens) if token_ids else ""


def _eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerFast) -> tuple[int, ...]:
    """EOS ids from generation_config.json, then config.json, then the tokenizer, in that order."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            ids.extend(_as_ids(json.loads(path.read_text()).get("eos_token_id")))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
