"""TextCodec against the HF tokenizer of the default model, and the incremental detokenizer's
UTF-8 safety on characters split across tokens."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from services.common.tokenizer import REPLACEMENT_CHAR, TextCodec

TEXTS = [
    "Hello",
    "What is the capital of France?",
    "  leading spaces, trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "héllo wörld — «quotes» naïve café",
    "Party time 🎉🙂👍🏽 with emoji",
    "한국어 텍스트를 토큰으로 나눕니다.",
    "日本語と中文混合 text",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]
# Characters of 2, 3 and 4 bytes that the byte-level BPE splits over several tokens.
MIXED = "Grüße 日本語 한국어 🎉👍🏽 ünïcödé — ok " * 3


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_hf(codec, hf_tokenizer, text):
    assert codec.encode(text) == hf_tokenizer(text)["input_ids"]


def test_encode_exact_ids(codec):
    assert codec.encode("日本語") == [23274, 115, 40993, 179, 120, 248]


def test_chat_template_equals_hf(codec, hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France? 🇫🇷"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Korea? 한국"},
    ]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert codec.apply_chat_template(messages) == hf_tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_chat_template_default_system_prompt(codec):
    ids = codec.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert codec.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_eos_and_vocab(codec):
    assert codec.eos_token_ids == (2,)
    assert codec.vocab_size == 49152


def test_decode_skips_special_tokens_by_default(codec):
    ids = codec.encode("Paris.") + [2]
    assert codec.decode(ids) == "Paris."
    assert codec.decode(ids, skip_special_tokens=False) == "Paris.<|im_end|>"


def test_incremental_holds_partial_characters(codec):
    detok = codec.incremental()
    deltas = [detok.push([token]) for token in codec.encode("日本語")]
    assert deltas == ["", "日", "本", "", "", "語"]
    assert detok.flush() == ""


def test_incremental_one_token_at_a_time(codec):
    ids = codec.encode(MIXED)
    detok = codec.incremental()
    deltas = [detok.push([token]) for token in ids]
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) + detok.flush() == codec.decode(ids) == MIXED
    assert sum(1 for delta in deltas if delta == "") > 10  # the split characters were really held back


def test_incremental_random_chunks(codec):
    ids = codec.encode(MIXED) + [2]
    rng = random.Random(7)
    for _ in range(20):
        detok = codec.incremental()
        deltas, start = [], 0
        while start < len(ids):
            size = rng.randint(1, 4)
            deltas.append(detok.push(ids[start : start + size]))
            start += size
        assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
        assert "".join(deltas) + detok.flush() == codec.decode(ids)


def test_flush_emits_an_unfinished_character(codec):
    detok = codec.incremental()
    assert detok.push([23274]) == ""
    assert detok.flush() == REPLACEMENT_CHAR == codec.decode([23274])


def test_invalid_bytes_mid_stream_match_full_decode(codec):
    # A lone lead byte followed by ASCII never completes: it decodes to U+FFFD, as a full decode does.
    ids = [23274] + codec.encode(" ok")
    detok = codec.incremental()
    deltas = [detok.push([token]) for token in ids]
    assert deltas == ["", REPLACEMENT_CHAR + " ok"]
    assert "".join(deltas) + detok.flush() == codec.decode(ids)


def test_codec_never_imports_torch(default_model_dir):
    script = (
        "import sys\n"
        "from services.common.tokenizer import TextCodec\n"
        f"c = TextCodec.from_model_dir({str(default_model_dir)!r})\n"
        "d = c.incremental(); d.push(c.apply_chat_template([{'role': 'user', 'content': 'hi'}])); d.flush()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[2])


@pytest.fixture
def metaspace_codec(tmp_path: Path) -> TextCodec:
    """A Llama-2-style decoder (leading "▁" as space, byte fallback, first space stripped)."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "<0xE6>": 3, "<0x97>": 4, "<0xA5>": 5, "!": 6, "</s>": 7}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens([AddedToken("</s>", special=True)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return TextCodec.from_model_dir(tmp_path)


def test_incremental_keeps_spaces_of_metaspace_tokens(metaspace_codec):
    ids = [1, 3, 4, 5, 2, 6, 7]
    detok = metaspace_codec.incremental()
    deltas = [detok.push([token]) for token in ids]
    # Decoded alone, token 2 is "world"; in context it must keep its space.
    assert deltas == ["Hello", "", "", "日", " world", "!", ""]
    assert "".join(deltas) == metaspace_codec.decode(ids) == "Hello日 world!"
    assert metaspace_codec.eos_token_ids == (7,)


def test_missing_tokenizer_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json: missing"):
        TextCodec.from_model_dir(tmp_path)


def test_threads_share_one_codec_and_get_what_one_thread_gets(codec):
    """No lock: encodes, chat templates and decodes run at once in many threads (as the gateway's
    tokenizer pool and its event loop do) and give exactly the single-threaded results."""
    from concurrent.futures import ThreadPoolExecutor

    chats = [[{"role": "user", "content": text}] for text in TEXTS if text]
    jobs = ([(codec.encode, text) for text in TEXTS + [MIXED * 50]] + [(codec.apply_chat_template, c) for c in chats]
            + [(codec.decode, codec.encode(text)) for text in TEXTS])
    expected = [work(arg) for work, arg in jobs]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(20):
            assert list(pool.map(lambda job: job[0](job[1]), jobs)) == expected


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_and_stream_equal_hf_decode(codec, hf_tokenizer, skip_special_tokens):
    for text in TEXTS:
        ids = hf_tokenizer(text)["input_ids"] + list(codec.eos_token_ids)
        expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert codec.decode(ids, skip_special_tokens) == expected
        detok = codec.incremental(skip_special_tokens)
        assert "".join(detok.push([token]) for token in ids) + detok.flush() == expected


def test_a_tokenizer_that_cleans_up_spaces_streams_what_hf_decodes(tmp_path):
    """HF cleans up " ." for a non-BPE model when configured to; the Rust DecodeStream cannot, so
    such a codec streams through the windowed decode."""
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁.": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    codec = TextCodec.from_model_dir(tmp_path)
    assert codec.decode_stream(True) is None
    assert codec.decode([1, 2]) == "Hello."
    detok = codec.incremental()
    assert "".join(detok.push([token]) for token in [1, 2]) + detok.flush() == "Hello."
