"""bench/placement.py at a small, fast setting: latency placement serves only what it provisioned
(the most popular models that fit) and refuses the rest, never cold-starting; cost placement serves
every request, loading on demand. The real run's catalogue (the default model under numbered names)
and its count of model loads from the workers' metrics."""

from __future__ import annotations

import random
from pathlib import Path

from bench.placement import Setup, run, zipf
from bench.placement_real import loads_in, make_home
from services.common.model_catalogue import ModelCatalogue
from services.scheduler.model_placement import ModelPlacement

SETUP = Setup(models=6, workers=2, requests=60, rate=400.0, model_gib=0.5, memory_gib=1.0, max_seqs=4, load_ms=20.0,
              prefill_ms=1.0, step_ms=1.0, output_tokens=4, replicas=1, rebalance_ms=50.0, replicate_active=2,
              drop_idle_ms=100, seed=3)


def drawn() -> list[int]:
    """The models the run draws at skew 1.2, in order (the run's seeded draws, between its seeded gaps)."""
    rng, popularity, models = random.Random(SETUP.seed), zipf(SETUP.models, 1.2), []
    for _ in range(SETUP.requests):
        models.append(rng.choices(range(SETUP.models), weights=popularity)[0])
        rng.expovariate(SETUP.rate)
    return models


def test_zipf_popularity_is_uniform_at_skew_0_and_falls_with_rank() -> None:
    assert zipf(4, 0.0) == [0.25] * 4
    shares = zipf(3, 1.0)
    assert [round(s, 4) for s in shares] == [0.5455, 0.2727, 0.1818]


async def test_latency_placement_refuses_the_models_it_could_not_provision_and_never_cold_starts() -> None:
    result = await run(SETUP, ModelPlacement.LATENCY, 1.2)
    unprovisioned = sum(1 for m in drawn() if m >= 4)  # two workers x two models of memory: m0..m3
    assert (result.refused, result.served, result.cold_start_pct, result.loads) == (
        unprovisioned, SETUP.requests - unprovisioned, 0.0, 0)


async def test_cost_placement_serves_every_request_loading_models_on_demand() -> None:
    result = await run(SETUP, ModelPlacement.COST, 1.2)
    assert (result.refused, result.served) == (0, SETUP.requests)
    assert result.loads >= len(set(drawn())) and result.cold_start_pct > 0


def test_the_real_run_serves_the_default_model_under_numbered_names(tmp_path: Path, default_model_dir: Path) -> None:
    home = make_home(tmp_path, default_model_dir, 3)
    catalogue = ModelCatalogue.from_flags([str(home / "models" / "m0")], home=home)
    assert catalogue.names() == ("m0", "m1", "m2")
    assert {name: path.resolve() for name, path in catalogue.models.items()} == dict.fromkeys(
        ("m0", "m1", "m2"), default_model_dir.resolve())


def test_the_real_run_counts_model_loads_over_every_model_of_a_worker() -> None:
    metrics = "\n".join([
        "# HELP tandem:model_loads_total Models loaded onto this worker (cold starts).",
        "# TYPE tandem:model_loads_total counter",
        'tandem:model_loads_total{model_name="m0",worker="colocated"} 1.0',
        'tandem:model_loads_total{model_name="m3",worker="colocated"} 2.0',
        'tandem:model_loads_created{model_name="m3",worker="colocated"} 1.7e+09',
        'tandem:model_load_seconds_count{model_name="m3",worker="colocated"} 2.0',
    ])
    assert loads_in(metrics) == 3
