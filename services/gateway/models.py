"""The models a gateway serves: its model catalogue (services/common/model_catalogue.py, read with
the workers' rules), each model's tokenizer, chat template and limits loaded on first use (its
first request, or a listing) and kept, and the listing of every model and adapter with how many
workers hold it loaded now (the scheduler's Stats: each worker's WorkerLoad.models).

The primary model (the first --model, else the default model) loads at start, so a broken one stops
the gateway; adapters (--lora, $TANDEM_HOME/loras) are served on it as BASE:NAME, as the workers
serve them on their primary model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.errors import FailedPrecondition, NotFound
from services.common.lora_catalogue import split_model
from services.common.model_catalogue import ModelCatalogue
from services.common.model_config import ModelLoadError
from services.common.tokenizer import TextCodec
from services.gateway.request import ServedModel
from services.gateway.upstream import Upstream
from tandem.v1 import scheduler_pb2

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 2.0  # each scheduler asked for the residency; the next one past it


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """One catalogue model as the gateway uses it: its name and limits, and its tokenizer."""

    model: ServedModel
    codec: TextCodec

    @classmethod
    def from_model_dir(cls, name: str, model_dir: Path, loras: tuple[str, ...] = ()) -> LoadedModel:
        """Reads the tokenizer and config.json (blocking: call it off the event loop)."""
        codec = TextCodec.from_model_dir(model_dir)
        return cls(dataclasses.replace(ServedModel.from_model_dir(model_dir, codec, loras), name=name), codec)


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One line of a listing: a served name (a model, or an adapter BASE:NAME), the model behind it,
    and how many workers hold that model (an adapter's base) loaded."""

    id: str
    model: ServedModel
    resident_workers: int

    @property
    def resident(self) -> bool:
        return self.resident_workers > 0

    @property
    def parent(self) -> str | None:
        """The base model of an adapter; None for a model."""
        return None if self.id == self.model.name else self.model.name


class GatewayModels:
    """Call `for_request(name)` for each request (it loads a model on first use, once however many
    requests wait for it) and `entries(residency)` or `entry(id, residency)` to list them."""

    def __init__(self, primary: LoadedModel, catalogue: Mapping[str, Path] | None = None) -> None:
        self.primary = primary
        self._paths = {name: path for name, path in (catalogue or {}).items() if name != primary.model.name}
        self._loaded = {primary.model.name: primary}
        self._loading: dict[str, asyncio.Lock] = {}

    @classmethod
    async def start(cls, catalogue: ModelCatalogue, loras: tuple[str, ...] = ()) -> GatewayModels:
        """The catalogue's models with its primary loaded (ModelLoadError or OSError when it cannot be)."""
        primary_dir = catalogue.path(catalogue.primary)
        primary = await asyncio.to_thread(LoadedModel.from_model_dir, catalogue.primary, primary_dir, loras)
        return cls(primary, catalogue.models)

    def names(self) -> list[str]:
        """Every model, the primary first."""
        return [self.primary.model.name, *self._paths]

    def served_names(self) -> list[str]:
        """What requests may name: every model, then the primary's adapters (BASE:NAME)."""
        return [*self.names(), *self.primary.model.served_names[1:]]

    async def for_request(self, requested: str) -> LoadedModel:
        """The model a request names ('': the primary; BASE:NAME: BASE), loaded on first use.
        NotFound naming what the gateway serves for any other name."""
        if requested and requested not in self.served_names():
            served = ", ".join(repr(name) for name in self.served_names())
            raise NotFound(f"model {requested!r} not found; this gateway serves {served}")
        return await self._load(split_model(requested)[0] or self.primary.model.name)

    async def entries(self, residency: Mapping[str, int]) -> list[ModelEntry]:
        """Every served name with its model (each loaded on first listing) and its workers. A model
        that cannot be loaded is left out (logged; its requests say why), so one broken directory
        never hides the others."""
        entries = []
        for name in self.served_names():
            try:
                entries.append(await self.entry(name, residency))
            except FailedPrecondition as exc:
                log.warning("listing leaves out %s", exc.message)
        return entries

    async def entry(self, served_name: str, residency: Mapping[str, int]) -> ModelEntry:
        """One served name's line; NotFound as `for_request` for a name the gateway does not serve."""
        loaded = await self.for_request(served_name)
        return ModelEntry(served_name, loaded.model, residency.get(loaded.model.name, 0))

    async def _load(self, name: str) -> LoadedModel:
        if name in self._loaded:
            return self._loaded[name]
        async with self._loading.setdefault(name, asyncio.Lock()):
            if name not in self._loaded:
                path = self._paths[name]
                try:
                    self._loaded[name] = await asyncio.to_thread(LoadedModel.from_model_dir, name, path)
                except (OSError, ModelLoadError) as exc:
                    raise FailedPrecondition(f"model {name!r} cannot be served from {path}: {exc}") from None
                log.info("model %s loaded from %s", name, path)
        return self._loaded[name]


def resident_workers(stats: scheduler_pb2.SchedulerStats) -> Counter[str]:
    """How many live workers hold each model loaded (not still loading). A worker that reports no
    residency holds the one model it registered, as the scheduler counts it too."""
    counts: Counter[str] = Counter()
    for worker in stats.workers:
        held = worker.load.models or [scheduler_pb2.ModelResidency(name=worker.info.model)]
        counts.update({m.name for m in held if m.state != scheduler_pb2.MODEL_STATE_LOADING})
    return counts


async def read_residency(upstream: Upstream, metadata: tuple[tuple[str, str], ...]) -> Counter[str]:
    """The residency by the first scheduler that answers Stats (the replicas share one registry),
    each asked for at most STATS_TIMEOUT_S; none when none answers (logged)."""
    for turn in range(upstream.num_schedulers):
        try:
            stats = await upstream.scheduler(turn).stub.Stats(scheduler_pb2.SchedulerStatsRequest(),
                                                               timeout=STATS_TIMEOUT_S, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            log.warning("model residency: scheduler %d of %d answered %s: %s", turn + 1, upstream.num_schedulers,
                        exc.code().name, exc.details())
            continue
        return resident_workers(stats)
    return Counter()
