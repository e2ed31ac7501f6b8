"""`tandem generate` end to end on the default model: streamed text and `--json` output."""

from __future__ import annotations

import json

from tandem.cli import main as cli

QUESTION = "What is the capital of France?"
PARIS_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]


def test_streams_the_answer(default_model_dir, capsys):
    argv = ["generate", "--chat", "--greedy", "--threads", "1", "--max-tokens", "16", "--prompt", QUESTION]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


def test_json_batch_one_object_per_prompt(default_model_dir, capsys):
    argv = ["generate", "--chat", "--greedy", "--json", "--threads", "1", "--max-tokens", "8",
            "--prompt", QUESTION, "--prompt", "Say hello in Korean: 안녕"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first == {"prompt": QUESTION, "token_ids": PARIS_IDS, "text": "The capital of France is Paris.",
                     "finish_reason": "stop"}
    assert second["prompt"] == "Say hello in Korean: 안녕"
    assert len(second["token_ids"]) == 8 and second["finish_reason"] == "length"


def test_plain_prompt_is_not_chat_templated(default_model_dir, capsys):
    argv = ["generate", "--greedy", "--json", "--threads", "1", "--max-tokens", "2",
            "--prompt", "The capital of France is"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["text"] == " Paris."


def test_bad_request_is_reported(default_model_dir, capsys):
    argv = ["generate", "--threads", "1", "--prompt", ""]
    assert cli.main(argv) == 2
    assert "prompt_token_ids is empty" in capsys.readouterr().err
