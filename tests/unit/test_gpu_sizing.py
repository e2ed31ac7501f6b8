"""The GPU path's sizing, checked on the CPU: --block-size against the attention backend, the KV
budget from free device memory, and the worker flags that carry them to the engine."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from services.prefill.main import SPEC
from services.runtime import attention
from services.runtime.attention import FlashAttention, TorchAttention, select_backend
from services.runtime.kv_cache import CPU_KV_MEMORY, kv_memory_budget
from services.worker.main_common import add_arguments, worker_config

CUDA = torch.device("cuda:0")
CPU = torch.device("cpu")


class _FakeFlash(FlashAttention):
    def __init__(self) -> None:  # flash-attn "imports": no kernel is called here
        self._prefill_fallback_logged = False


@pytest.mark.parametrize("name", ["auto", "torch"])
def test_the_cpu_takes_sdpa_at_any_block_size(name: str) -> None:
    for block_size in (1, 16, 100, 256):
        assert isinstance(select_backend(name, CPU, block_size), TorchAttention)


def test_a_block_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^--block-size 0 must be at least 1$"):
        select_backend("auto", CPU, 0)


def test_flash_refuses_a_block_size_its_paged_kernel_cannot_take() -> None:
    with pytest.raises(ValueError) as raised:
        select_backend("flash", CUDA, 16)
    assert str(raised.value) == ("the flash attention backend needs --block-size a multiple of 256 (flash-attn's "
                                 "paged kernel), not 16; use --block-size 256 or --attention torch")


def test_flash_on_a_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device; use --attention torch on CPU"):
        select_backend("flash", CPU, 256)


def test_auto_on_cuda_with_small_blocks_falls_back_to_sdpa_and_says_why(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        backend = select_backend("auto", CUDA, 16)
    assert isinstance(backend, TorchAttention)
    assert caplog.messages == ["attention: torch SDPA on CUDA, not flash-attn: --block-size 16 is not a multiple "
                               "of 256, which flash-attn's paged kernel needs"]


def test_auto_on_cuda_without_flash_attn_falls_back_to_sdpa_and_says_why(monkeypatch, caplog) -> None:
    def no_flash() -> None:
        raise ImportError("No module named 'flash_attn'")

    monkeypatch.setattr(attention, "FlashAttention", no_flash)
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        backend = select_backend("auto", CUDA, 512)
    assert isinstance(backend, TorchAttention)
    assert caplog.messages == ["attention: torch SDPA on CUDA, not flash-attn: flash-attn is not importable"]
    with pytest.raises(ValueError, match=r"^flash-attn is not importable; install flash-attn or use --attention torch$"):
        select_backend("flash", CUDA, 256)


def test_auto_on_cuda_takes_flash_at_a_multiple_of_256(monkeypatch) -> None:
    monkeypatch.setattr(attention, "FlashAttention", _FakeFlash)
    assert isinstance(select_backend("auto", CUDA, 512), _FakeFlash)
    assert isinstance(select_backend("flash", CUDA, 256), _FakeFlash)


def test_flash_logs_its_prefill_fallback_once(caplog) -> None:
    flash = _FakeFlash()
    calls: list[int] = []
    flash._torch = type("Sdpa", (), {"attend": lambda self, *args: calls.append(1) or "sdpa"})()
    meta = attention.BatchMetadata(torch.zeros(1), torch.zeros(1), 0, None, None, None, [], torch.zeros(1))
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        assert [flash.attend(None, None, None, None, None, meta, 1.0) for _ in range(3)] == ["sdpa"] * 3
    assert calls == [1, 1, 1]
    assert len(caplog.messages) == 1
    assert caplog.messages[0].startswith("attention: steps with prompt chunks use torch SDPA on CUDA")


def test_the_kv_budget_is_the_set_size_else_a_share_of_free_gpu_memory(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 << 30, 80 << 30))
    assert kv_memory_budget(1 << 30, 0.9, CUDA) == 1 << 30
    assert kv_memory_budget(None, 0.9, CUDA) == int((10 << 30) * 0.9)
    assert kv_memory_budget(None, 0.5, CUDA) == 5 << 30
    assert kv_memory_budget(None, 0.9, CPU) == CPU_KV_MEMORY == 2 << 30


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_kv_memory_fraction_outside_zero_to_one_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match=rf"^--kv-memory-fraction {fraction} must be above 0 and at most 1$"):
        kv_memory_budget(None, fraction, CPU)


def _worker(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser, SPEC)
    return worker_config(parser.parse_args(["--insecure-internal", *argv]), SPEC)


def test_sizing_flags_reach_the_engine_config() -> None:
    from services.runtime.precision import Precision

    default = _worker().engine_config(Precision())
    assert (default.kv_memory_bytes, default.kv_memory_fraction, default.block_size, default.max_num_seqs) == (
        None, 0.9, 16, 64)
    config = _worker("--kv-memory", "4GiB", "--kv-memory-fraction", "0.8", "--block-size", "256",
                     "--max-num-seqs", "128").engine_config(Precision())
    assert (config.kv_memory_bytes, config.kv_memory_fraction, config.block_size, config.max_num_seqs) == (
        4 << 30, 0.8, 256, 128)
