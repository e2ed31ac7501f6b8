"""Weight-only quantized layers, the choice rule behind `--dtype auto`, and the probe's cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.model_config import ModelConfig
from services.runtime import native, precision_probe
from services.runtime.precision import FLOAT32, Choice, Precision, choose, hybrids, resolve
from services.runtime.precision_probe import ProbeSetup, run_probe
from services.runtime.quantization import (DenseLinear, Int4Groups, Int4Linear, Int8Linear, NativeInt4Linear,
                                             NativeInt8Linear, SplitLinear, int4_linear, make_linear)

BF16, FP16 = Precision(torch.bfloat16), Precision(torch.float16)
BF16_INT4, BF16_INT8 = Precision(torch.bfloat16, "int4"), Precision(torch.bfloat16, "int8")
# Measured on the development machine (AMD EPYC, 1 thread, busy): ms per pass at 1, 32 and 512 rows.
MEASURED = {
    FLOAT32: [5.96, 42.85, 412.6],
    BF16: [6.33, 21.55, 187.73],
    FP16: [2.07, 150.12, None],
    BF16_INT8: [2.49, 44.68, 510.97],
    BF16_INT4: [1.16, 34.04, 441.74],
}


def weight(out_features: int = 48, in_features: int = 64) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1))


def test_int8_rows_keep_their_scale_and_round_to_the_nearest_level():
    w = weight()
    layer = Int8Linear.quantize(w, None, torch.float32)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().amax(dim=1).tolist() == [127] * 48
    dequantized = layer.qweight.float() * layer.scales[:, None]
    assert (dequantized - w).abs().max() <= layer.scales.max() / 2 + 1e-6
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ dequantized.T, rtol=1e-5, atol=1e-4)


def test_int4_groups_of_32_run_as_their_dequantized_weights():
    w = weight()
    layer = int4_linear(Int4Groups.quantize(w), torch.arange(48.0), torch.float32)
    groups = w.view(48, 2, 32)
    scale = (groups.amax(-1) - groups.amin(-1)) / 15
    x = torch.eye(64)  # rows of the output are the dequantized weight's columns, plus the bias
    dequantized = (layer(x) - torch.arange(48.0)).T
    assert ((dequantized - w).view(48, 2, 32).abs() <= scale[..., None] / 2 + 1e-5).all()
    assert len(torch.unique(dequantized.view(48, 2, 32)[0, 0])) <= 16


def test_make_linear_formats():
    w = weight()
    assert isinstance(make_linear(w, None, "none", torch.bfloat16), DenseLinear)
    int8, int4 = (NativeInt8Linear, NativeInt4Linear) if native.loaded() else (Int8Linear, Int4Linear)
    assert isinstance(make_linear(w, None, "int8", torch.bfloat16), int8)
    assert isinstance(make_linear(w, None, "int4", torch.bfloat16), int4)
    assert isinstance(make_linear(weight(40, 64), None, "int4", torch.bfloat16), Int8Linear)  # 40 rows: no int4 tile
    split = make_linear(w, None, "int4", torch.bfloat16, dense_from_rows=8)
    assert isinstance(split, SplitLinear) and isinstance(split.dense, DenseLinear) and split.dense_from_rows == 8


def test_make_linear_refuses_what_the_kernels_cannot_run():
    with pytest.raises(ValueError, match=r"^--quantization int8 runs with 16-bit activations, not torch.float32; "
                                         r"pass --dtype bfloat16, float16 or auto$"):
        make_linear(weight(), None, "int8", torch.float32)
    with pytest.raises(ValueError, match=r"^--quantization int4 has CPU kernels only; on cuda:0 pass --quantization none$"):
        make_linear(weight(), None, "int4", torch.bfloat16, device="cuda:0")


def test_a_split_layer_runs_the_dense_copy_from_its_row_count_on():
    split = SplitLinear(quantized=lambda x: torch.zeros(len(x)), dense=lambda x: torch.ones(len(x)), dense_from_rows=4)
    assert split(torch.empty(3, 2)).tolist() == [0, 0, 0]
    assert split(torch.empty(4, 2)).tolist() == [1, 1, 1, 1]


def test_hybrid_switches_to_dense_where_dense_first_wins():
    found = hybrids({BF16: MEASURED[BF16], BF16_INT4: MEASURED[BF16_INT4], BF16_INT8: MEASURED[BF16_INT8]}, (1, 32, 512))
    assert found == {
        Precision(torch.bfloat16, "int4", 32): [1.16, 21.55, 187.73],
        Precision(torch.bfloat16, "int8", 32): [2.49, 21.55, 187.73],
    }
    assert Precision(torch.bfloat16, "int4", 32).name == "bfloat16+int4, dense from 32 rows"
    assert hybrids({BF16_INT4: MEASURED[BF16_INT4]}, (1, 32, 512)) == {}  # no dense sibling among the options


def test_choose_takes_the_least_geometric_mean_among_those_that_run_well():
    times = dict(MEASURED)
    assert choose(times, MEASURED[FLOAT32]) == BF16_INT4  # 0.55 against bf16's 0.62; fp16 ran 3.5x fp32 at 32 rows
    times.update(hybrids(times, (1, 32, 512)))
    assert choose(times, MEASURED[FLOAT32]) == Precision(torch.bfloat16, "int4", 32)
    slow_once = {FLOAT32: [10.0, 10.0], BF16: [1.0, 16.0]}  # geometric mean 0.4, but 1.6x fp32 at 32 rows
    assert choose(slow_once, [10.0, 10.0]) == FLOAT32
    assert choose({BF16_INT4: [20.0, None], BF16_INT8: [30.0, 30.0]}, [10.0, 10.0]) == BF16_INT8
    assert choose({BF16: [5.0], FP16: [5.0]}, [10.0]) == BF16  # a tie goes to the first


@pytest.fixture
def model_config(default_model_dir) -> ModelConfig:
    return ModelConfig.from_model_dir(default_model_dir)


def test_given_flags_need_no_probe(model_config, tmp_path, monkeypatch):
    monkeypatch.setattr(precision_probe, "run_probe", lambda setup: pytest.fail("probed"))
    assert resolve("float32", "none", "cpu", model_config, 512, tmp_path) == Choice(FLOAT32, "given")
    assert resolve("bfloat16", "int4", "cpu", model_config, 512, tmp_path) == Choice(BF16_INT4, "given")
    assert resolve("auto", "auto", "cuda:0", model_config, 512, tmp_path) == Choice(BF16, "auto on cuda")
    assert resolve("float16", "auto", "cuda", model_config, 512, tmp_path) == Choice(FP16, "auto on cuda")
    with pytest.raises(ValueError, match=r"^--quantization int4 runs with 16-bit activations, not torch.float32"):
        resolve("float32", "int4", "cpu", model_config, 512, tmp_path)
    with pytest.raises(ValueError, match=r"^--quantization int8 has CPU kernels only; on cuda pass --quantization none$"):
        resolve("auto", "int8", "cuda", model_config, 512, tmp_path)
    with pytest.raises(ValueError, match=r"^dtype 'fp8' is not one of auto, float32, bfloat16, float16$"):
        resolve("fp8", "none", "cpu", model_config, 512, tmp_path)


def test_auto_probes_once_per_machine_and_reads_the_cache_after(model_config, tmp_path, monkeypatch):
    calls: list[ProbeSetup] = []

    def fake_probe(setup: ProbeSetup) -> dict[str, list[float | None]]:
        calls.append(setup)
        return {"float32": [5.96, 12.0, 42.85, 412.6], "bfloat16": [6.33, 8.0, 21.55, 187.73],
                "float16": [2.07, 40.0, None, None], "bfloat16+int8": [2.49, 9.0, 44.68, 510.97],
                "bfloat16+int4": [1.16, 7.0, 34.04, 441.74], "float16+int8": [9.0, None, None, None],
                "float16+int4": [9.0, None, None, None]}

    monkeypatch.setattr(precision_probe, "run_probe", fake_probe)
    monkeypatch.setattr(precision_probe, "machine_load", lambda: 0.0)
    first = resolve("auto", "auto", "cpu", model_config, 512, tmp_path)
    assert first.precision == Precision(torch.bfloat16, "int4", 32) and first.reason.startswith("auto: probed, cached in ")
    again = resolve("auto", "auto", "cpu", model_config, 512, tmp_path)
    assert again.precision == first.precision and again.reason.startswith("auto: cached probe ")
    only_dense = resolve("auto", "none", "cpu", model_config, 512, tmp_path)
    assert only_dense.precision == BF16 and len(calls) == 1
    assert calls[0].rows == (1, 8, 32, 512) and calls[0].layers == 5 and calls[0].shapes == (
        (960, 576), (576, 576), (3072, 576), (576, 1536))


def test_the_probe_times_every_candidate_at_every_size_until_it_drops_out():
    times = run_probe(ProbeSetup(shapes=((32, 64),), layers=2, rows=(1, 4), threads=1))
    assert set(times) == {"float32", "bfloat16", "float16", "bfloat16+int8", "float16+int8", "bfloat16+int4",
                          "float16+int4"}
    assert all(isinstance(t, float) and t > 0 for t in times["float32"]) and len(times["float32"]) == 2
    for series in times.values():
        assert len(series) == 2 and series[0] is not None
        assert series[1] is None or series[1] > 0


@pytest.fixture
def torch_threads():
    threads = torch.get_num_threads()  # WorkerConfig.precision sets the worker's own
    yield
    torch.set_num_threads(threads)


def test_a_worker_without_precision_flags_keeps_the_device_default(default_model_dir, torch_threads):
    from services.worker.main_common import WorkerConfig

    assert WorkerConfig().precision(default_model_dir) == Choice(FLOAT32, "the default on cpu")
    assert WorkerConfig(device="cuda:0").precision(default_model_dir) == Choice(BF16, "the default on cuda:0")
    assert WorkerConfig(dtype="bfloat16", quantization="int8").precision(default_model_dir) == Choice(BF16_INT8, "given")


def test_a_probe_taken_on_a_busy_machine_is_taken_again_once_it_is_quiet(model_config, tmp_path, monkeypatch):
    probes: list[float] = []
    load = [2.0]
    monkeypatch.setattr(precision_probe, "machine_load", lambda: load[0])
    monkeypatch.setattr(precision_probe, "run_probe", lambda setup: probes.append(load[0]) or {
        "float32": [5.0, 10.0, 40.0, 400.0], "bfloat16": [6.0, 8.0, 20.0, 190.0], "float16": [None] * 4,
        "bfloat16+int8": [None] * 4, "bfloat16+int4": [None] * 4, "float16+int8": [None] * 4,
        "float16+int4": [None] * 4})
    busy = resolve("auto", "none", "cpu", model_config, 512, tmp_path)
    assert busy.reason.startswith("auto: probed on a busy machine (load 2.0 per core)")
    assert resolve("auto", "none", "cpu", model_config, 512, tmp_path).reason.startswith("auto: cached probe ")
    load[0] = 0.1
    assert resolve("auto", "none", "cpu", model_config, 512, tmp_path).reason.startswith("auto: probed, cached in ")
    assert resolve("auto", "none", "cpu", model_config, 512, tmp_path).reason.startswith("auto: cached probe ")
    assert probes == [2.0, 0.1]


def test_the_probe_cache_key_names_the_native_build(model_config, monkeypatch):
    """A kernel change makes a new build key, so the probe times the new kernels instead of reusing
    times taken on the old ones."""
    setup = ProbeSetup.for_model(model_config, (1,), 1)
    monkeypatch.setattr(native, "loaded", lambda: True)
    monkeypatch.setattr(native, "build_dir", lambda: Path("/home/native/aaaa"))
    assert setup.key()["native_kernels"] == "aaaa"
    monkeypatch.setattr(native, "build_dir", lambda: Path("/home/native/bbbb"))
    assert setup.key()["native_kernels"] == "bbbb"
    monkeypatch.setattr(native, "loaded", lambda: False)
    assert setup.key()["native_kernels"] is None
