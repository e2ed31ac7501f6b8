"""Model residency on a worker: loads on demand with one load per model at a time, LRU eviction of
idle unpinned models to fit the budget, never a busy or pinned one, and the errors of a model that
cannot fit or load."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from services.worker.residency import (
    ModelLoadError,
    ModelMemoryExhausted,
    ModelRecord,
    ModelState,
    ResidentModels,
)
from services.worker.served_model import free_memory, freeze_memory


@dataclass(slots=True)
class Fake:
    """The models a test's loader built and freed, and the requests each one runs."""

    loads: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    unloads: list[str] = field(default_factory=list)
    running: dict[str, int] = field(default_factory=dict)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    broken: set[str] = field(default_factory=set)
    now: float = 0.0

    async def load(self, name: str, evicted: tuple[str, ...]) -> str:
        self.loads.append((name, evicted))
        if name in self.gates:
            await self.gates[name].wait()
        if name in self.broken:
            raise OSError(f"{name}: no model.safetensors")
        return f"model:{name}"

    async def unload(self, name: str, model: str) -> None:
        assert model == f"model:{name}"
        self.unloads.append(name)

    def active(self, model: str) -> int:
        return self.running.get(model.removeprefix("model:"), 0)

    def residency(self, budget: int, **sizes: int) -> ResidentModels[str]:
        return ResidentModels(sizes, budget, self.load, self.unload, self.active, clock=lambda: self.now)


async def _use(models: ResidentModels[str], name: str) -> str:
    async with models.lease(name) as model:
        return model


async def test_requests_for_a_loading_model_share_one_load():
    fake = Fake(gates={"a": asyncio.Event()})
    models = fake.residency(100, a=60)
    first = asyncio.ensure_future(_use(models, "a"))
    second = asyncio.ensure_future(_use(models, "a"))
    await asyncio.sleep(0)
    assert models.records() == [ModelRecord("a", ModelState.LOADING, False, 60, 2, 0)]
    fake.gates["a"].set()
    assert await asyncio.gather(first, second) == ["model:a", "model:a"]
    assert fake.loads == [("a", ())]
    assert models.records() == [ModelRecord("a", ModelState.RESIDENT, False, 60, 0, 0)]


async def test_least_recently_used_idle_model_is_evicted_to_fit():
    fake = Fake()
    models = fake.residency(100, a=40, b=40, c=40)
    await _use(models, "a")
    fake.now = 1.0
    await _use(models, "b")
    fake.now = 2.0
    await _use(models, "a")  # a is now more recent than b
    fake.now = 3.5
    assert models.free_bytes == 20
    assert models.records()[0] == ModelRecord("a", ModelState.RESIDENT, False, 40, 0, 1500)
    loaded = await models.load("c")
    assert loaded.evicted == ("b",)
    assert fake.unloads == ["b"] and fake.loads[-1] == ("c", ("b",))
    assert sorted(models.models()) == ["a", "c"]
    assert models.free_bytes == 20


async def test_busy_and_pinned_models_are_never_evicted():
    fake = Fake(running={"a": 1})
    models = fake.residency(100, a=50, b=50, c=50)
    await _use(models, "a")
    await models.load("b", pin=True)
    with pytest.raises(ModelMemoryExhausted) as caught:
        await _use(models, "c")
    assert str(caught.value) == (
        "model 'c' needs 50 bytes of weights; 0 of --model-memory 100 are free and the models holding the rest "
        "are busy, pinned or loading (a, b); retry later, or on a worker with room")
    assert fake.unloads == [] and sorted(models.models()) == ["a", "b"]
    fake.running["a"] = 0  # a's request ended: it may go now, b stays pinned
    await _use(models, "c")
    assert fake.unloads == ["a"] and sorted(models.models()) == ["b", "c"]


async def test_a_lease_keeps_its_model_while_the_request_is_admitted():
    fake = Fake()
    models = fake.residency(50, a=50, b=50)
    async with models.lease("a"):
        with pytest.raises(ModelMemoryExhausted):
            await _use(models, "b")
    await _use(models, "b")
    assert fake.unloads == ["a"]


async def test_a_model_larger_than_the_budget_is_refused_and_nothing_is_evicted():
    fake = Fake()
    models = fake.residency(100, a=60, big=101)
    await _use(models, "a")
    with pytest.raises(ModelMemoryExhausted, match=r"^model 'big' needs 101 bytes of weights, more than this "
                                                   r"worker's --model-memory \(100 bytes\)"):
        await models.load("big")
    assert fake.unloads == [] and list(models.models()) == ["a"]


async def test_a_failed_load_fails_its_waiters_and_the_next_request_tries_again():
    fake = Fake(broken={"a"}, gates={"a": asyncio.Event()})
    models = fake.residency(100, a=60)
    waiters = [asyncio.ensure_future(_use(models, "a")) for _ in range(2)]
    await asyncio.sleep(0)
    fake.gates["a"].set()
    for waiter in waiters:
        with pytest.raises(ModelLoadError, match=r"^model 'a' could not be loaded: OSError: a: no model.safetensors$"):
            await waiter
    assert models.records() == [] and models.free_bytes == 100
    fake.broken.clear()
    assert await _use(models, "a") == "model:a"
    assert [name for name, _ in fake.loads] == ["a", "a"]


async def test_unload_evicts_an_idle_model_and_a_busy_one_once_it_is_idle():
    fake = Fake(running={"b": 1})
    models = fake.residency(100, a=30, b=30)
    await models.load("a", pin=True)
    await _use(models, "b")
    assert await models.unload("a") is True
    assert fake.unloads == ["a"]
    assert await models.unload("b") is False
    models.note_used("b")
    assert fake.unloads == ["a"]
    fake.running["b"] = 0
    models.note_used("b")
    await asyncio.sleep(0)
    assert fake.unloads == ["a", "b"] and models.models() == {}
    assert await models.unload("never") is False


async def test_an_evicted_model_is_freed_before_the_next_one_loads():
    import gc
    import weakref

    class Model:
        pass

    built: list[weakref.ref] = []
    alive_during_load: list[bool] = []

    async def load(name: str, evicted: tuple[str, ...]) -> Model:
        gc.collect()
        alive_during_load.append(any(ref() is not None for ref in built))  # the victim is freed first
        model = Model()
        built.append(weakref.ref(model))
        return model

    async def unload(name: str, model: Model) -> None:
        pass

    models: ResidentModels[Model] = ResidentModels({"a": 10, "b": 10}, 10, load, unload, lambda model: 0)
    await models.load("a")
    await models.load("b")  # evicts a
    gc.collect()
    assert alive_during_load == [False, False]
    assert built[0]() is None and built[1]() is not None


async def test_a_model_unloaded_while_leased_leaves_when_the_lease_ends():
    fake = Fake()
    models = fake.residency(100, a=30)
    async with models.lease("a"):
        assert await models.unload("a") is False
    await asyncio.sleep(0)
    assert fake.unloads == ["a"] and models.models() == {}


def test_a_frozen_collector_still_frees_a_dropped_engines_cycles():
    import gc
    import weakref

    class Engine:
        pass

    engine = Engine()
    engine.cycle = engine
    dropped = weakref.ref(engine)
    freeze_memory()
    try:
        del engine
        gc.collect()
        assert dropped() is not None  # frozen: a plain collection leaves it
        free_memory("cpu")
        assert dropped() is None
        assert gc.get_freeze_count() > 0  # what stays is frozen again
    finally:
        gc.unfreeze()
