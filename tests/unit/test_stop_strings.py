"""Stop strings: the matcher on text pieces, and the gateway's output assembler on real tokens of
the default model, where a stop string spans tokens and characters are split across tokens."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import TextCodec
from services.gateway.output import OutputAssembler, OutputOptions
from services.gateway.stop_strings import StopMatch, StopStringMatcher
from tandem.v1 import common_pb2, scheduler_pb2


def feed(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, str | None]:
    sent, stop = "", None
    for piece in pieces:
        match = matcher.push(piece)
        sent += match.text
        stop = stop or match.stop
    return sent + ("" if stop else matcher.flush()), stop


def test_stop_spanning_two_pieces_is_cut_exactly():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("abc ST") == StopMatch("abc ")  # "ST" may begin the stop string: held back
    assert matcher.push("OP tail") == StopMatch("", "STOP")
    assert matcher.push("more") == StopMatch("")
    assert matcher.stopped == "STOP"


def test_held_text_is_released_when_it_stops_matching():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("xSTO") == StopMatch("x")
    assert matcher.push("RY") == StopMatch("STORY")
    assert matcher.flush() == ""


def test_include_stop_keeps_the_stop_string():
    matcher = StopStringMatcher(["\n\n"], include_stop=True)
    assert feed(matcher, ["one\n", "\ntwo"]) == ("one\n\n", "\n\n")


def test_first_match_is_the_one_that_completes_first_however_the_text_is_split():
    text = "xabcdy"
    for cut in itertools.combinations(range(1, len(text)), 2):
        pieces = [text[i:j] for i, j in zip((0, *cut), (*cut, len(text)))]
        # "cd" completes at "d", before "bcdy"; "abcd" completes there too and is longer: it wins.
        assert feed(StopStringMatcher(["bcdy", "cd", "abcd"]), pieces) == ("x", "abcd")
        assert feed(StopStringMatcher(["bcdy", "cd"]), pieces) == ("xab", "cd")


def test_no_stop_strings_send_everything_at_once():
    matcher = StopStringMatcher([])
    assert matcher.push("abc") == StopMatch("abc")


def test_unchecked_text_passes_unsearched():
    matcher = StopStringMatcher(["ab"])
    assert matcher.push("xa", check=False) == StopMatch("xa")
    assert matcher.push("b") == StopMatch("b")  # the "a" was already sent: no match across it
    assert matcher.push("ab") == StopMatch("", "ab")


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        StopStringMatcher(["a", ""])


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


def events(token_ids: list[int], per_event: int = 1, final: int = common_pb2.FINISH_REASON_LENGTH):
    """Token events of `per_event` tokens each; the last one carries `final` and the usage."""
    groups = [token_ids[i : i + per_event] for i in range(0, len(token_ids), per_event)]
    for index, group in enumerate(groups):
        event = scheduler_pb2.TokenEvent(request_id="r", output_offset=index * per_event, token_ids=group)
        if index == len(groups) - 1:
            event.finish_reason = final
            event.usage.CopyFrom(common_pb2.Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=len(token_ids)))
        yield event


def assemble(codec: TextCodec, token_ids: list[int], stop: tuple[str, ...], per_event: int = 1, **options):
    assembler = OutputAssembler(codec, OutputOptions(SamplingParams(), stop, **options), prompt_token_ids=[1, 2, 3])
    chunks = []
    for event in events(token_ids, per_event):
        chunk = assembler.on_event(event)
        if chunk is not None:
            chunks.append(chunk)
        if assembler.finished:
            break
    return chunks


def test_stop_string_spanning_two_tokens_cuts_text_and_tokens_exactly(codec):
    ids = codec.encode("The capital of France is Paris. It is big.")
    # " Paris" and "." are separate tokens: the stop string "is Paris." needs three tokens.
    paris = codec.encode(" Paris")
    assert len(paris) == 1 and ids[ids.index(paris[0]) + 1] == codec.encode(".")[0]
    for per_event in (1, 2, 5, len(ids)):
        chunks = assemble(codec, ids, ("is Paris.",), per_event)
        last = chunks[-1]
        assert "".join(c.text for c in chunks) == "The capital of France "
        assert [t for c in chunks for t in c.token_ids] == ids[: ids.index(paris[0]) + 2]
        assert (last.finish_reason, last.stop_string, last.stop_token_id) == ("stop", "is Paris.", None)
        assert last.usage == common_pb2.Usage(prompt_tokens=3, cached_tokens=0,
                                              completion_tokens=ids.index(paris[0]) + 2)


def test_stop_string_inside_one_token(codec):
    ids = codec.encode("hello world")
    chunks = assemble(codec, ids, ("wor",), include_stop_str_in_output=True)
    assert "".join(c.text for c in chunks) == "hello wor"
    assert [t for c in chunks for t in c.token_ids] == ids


def test_multibyte_stop_string_split_across_tokens(codec):
    ids = codec.encode("日本語です")
    assert codec.encode("日本語") == [23274, 115, 40993, 179, 120, 248]  # 語 takes three tokens
    chunks = assemble(codec, ids, ("語",))
    assert [c.text for c in chunks] == ["", "日", "本", "", "", ""]
    assert [t for c in chunks for t in c.token_ids] == [23274, 115, 40993, 179, 120, 248]
    assert chunks[-1].stop_string == "語"


def test_split_characters_are_held_back_without_stop_strings(codec):
    text = "Grüße 日本語 한국어 🎉👍🏽 ok"
    ids = codec.encode(text)
    chunks = assemble(codec, ids, ())
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == text
    assert chunks[-1].finish_reason == "length" and chunks[-1].stop_string is None
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_held_text_that_never_completes_a_stop_string_is_sent_at_the_end(codec):
    ids = codec.encode("to be contin")
    chunks = assemble(codec, ids, ("continued",))
    assert "".join(c.text for c in chunks) == "to be contin"
    assert chunks[-1].text.endswith("contin") and chunks[-1].finish_reason == "length"


def test_eos_stop_reports_the_stop_token(codec):
    ids = codec.encode("Paris.") + [2]
    assembler = OutputAssembler(codec, OutputOptions(SamplingParams()), prompt_token_ids=[1, 2, 3])
    chunks = [assembler.on_event(e) for e in events(ids, per_event=len(ids), final=common_pb2.FINISH_REASON_STOP)]
    assert chunks[0].text == "Paris."
    assert (chunks[0].finish_reason, chunks[0].stop_token_id) == ("stop", 2)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_id_ends_the_text_before_it_as_in_vllm(codec, include):
    ids = codec.encode("Paris. It")[:2]  # " Paris" is not a token at the start: "Paris", "."
    period = codec.encode(".")[0]
    assert ids[-1] == period
    options = OutputOptions(SamplingParams(stop_token_ids=(period,)), include_stop_str_in_output=include)
    for per_event in (1, 2):
        assembler = OutputAssembler(codec, options, prompt_token_ids=[1, 2, 3])
        chunks = [assembler.on_event(e) for e in events(ids, per_event, final=common_pb2.FINISH_REASON_STOP)]
        assert "".join(c.text for c in chunks if c) == ("Paris." if include else "Paris")
        assert [t for c in chunks if c for t in c.token_ids] == ids
        assert (chunks[-1].finish_reason, chunks[-1].stop_token_id) == ("stop", period)


def test_eos_text_is_not_shown_even_with_special_tokens(codec):
    ids = codec.encode("Paris") + [2]
    options = OutputOptions(SamplingParams(), skip_special_tokens=False)
    assembler = OutputAssembler(codec, options, prompt_token_ids=[1, 2, 3])
    [chunk] = [assembler.on_event(e) for e in events(ids, len(ids), final=common_pb2.FINISH_REASON_STOP)]
    assert (chunk.text, chunk.token_ids, chunk.stop_token_id) == ("Paris", ids, 2)


@pytest.mark.parametrize("per_event", [1, 3])
@pytest.mark.parametrize("include", [False, True])
def test_without_stop_strings_an_event_is_taken_whole_with_the_same_chunks(codec, per_event, include):
    ids = codec.encode(" Grüße 日本語 🎉 ok. Paris") + [2]  # ends on EOS

    def chunks(stop: tuple[str, ...]) -> list[tuple[list[int], str, str | None]]:
        options = OutputOptions(SamplingParams(), stop, include_stop_str_in_output=include, skip_special_tokens=False)
        assembler = OutputAssembler(codec, options, prompt_token_ids=[1, 2, 3])
        found = [assembler.on_event(e) for e in events(ids, per_event, final=common_pb2.FINISH_REASON_STOP)]
        return [(c.token_ids, c.text, c.finish_reason) for c in found if c is not None]

    whole = chunks(())
    assert whole == chunks(("never in this text",))  # searched token by token
    assert "".join(text for _, text, _ in whole) == codec.decode(ids if include else ids[:-1],
                                                                 skip_special_tokens=False)
    assert whole[-1][2] == "stop"
