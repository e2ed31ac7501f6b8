"""Store on Redis, shared by scheduler replicas. Keys, all under the namespace (default `tandem`):

  {ns}:workers            set of registered worker ids (expired ones are pruned by list_workers)
  {ns}:worker:{id}        hash {info, load} (JSON), expiring ttl after the last register/heartbeat
  {ns}:blocks:{id}        set of block hashes the worker caches
  {ns}:block:{hash}       set of worker ids caching the block (the prefix index)
  {ns}:claim:{key}        the owner of a claim, expiring with its ttl

Every Redis or socket error is raised as StoreUnavailable. Each call a scheduler makes per request
or per listing is one round trip (a Lua script of redis_scripts.py): a listing of the workers, a
prefix match, one report of a worker's block changes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError, RedisError

from services.common import redis_scripts
from services.common.block_hash import BlockHash
from services.common.store import (
    ModelResidency, ModelState, StoreUnavailable, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole,
)

def _ttl_ms(ttl: float) -> int:
    return max(1, round(ttl * 1000))


def _to_json(value: WorkerInfo | WorkerLoad) -> str:
    return json.dumps(dataclasses.asdict(value))


def _record(info_json: str, load_json: str) -> WorkerRecord:
    info = json.loads(info_json)
    info["role"] = WorkerRole(info["role"])
    info["catalogue"] = tuple(info.get("catalogue", ()))
    load = json.loads(load_json)
    load["models"] = tuple(ModelResidency(**{**m, "state": ModelState(m["state"])}) for m in load.get("models", ()))
    return WorkerRecord(WorkerInfo(**info), WorkerLoad(**load))


# Connections one store opens at most; past them a command waits for a free one.
MAX_CONNECTIONS = 64


class RedisStore:
    """Store on a Redis server at `url` (redis://host:port/db). Connects lazily."""

    name = "redis"

    def __init__(self, url: str, *, namespace: str = "tandem", timeout: float = 1.0,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.url = url
        self._ns = namespace
        # A pooled connection that a restarted Redis closed fails its next command: each command
        # tries once more on a fresh connection (which a Redis still down refuses at once). A command
        # finding every connection in use waits for one (at most `timeout`), where the default pool
        # refused it: 100 workers leaving at once are 100 concurrent commands.
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, decode_responses=True,
            socket_timeout=timeout, socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self._redis = redis.Redis.from_pool(pool)
        self._heartbeat = self._redis.register_script(redis_scripts.HEARTBEAT)
        self._drop_blocks = self._redis.register_script(redis_scripts.DROP_BLOCKS)
        self._prune_expired = self._redis.register_script(redis_scripts.PRUNE_EXPIRED)
        self._list_workers = self._redis.register_script(redis_scripts.LIST_WORKERS)
        self._update_blocks = self._redis.register_script(redis_scripts.UPDATE_BLOCKS)
        self._match_prefix = self._redis.register_script(redis_scripts.MATCH_PREFIX)
        self._release = self._redis.register_script(redis_scripts.RELEASE)
        # Each listed worker's stored JSON (info, load) and its record: decoded again only when it changed.
        self._listed: dict[str, tuple[tuple[str, str], WorkerRecord]] = {}

    def _key(self, *parts: str) -> str:
        return ":".join((self._ns, *parts))

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis at {self.url} unavailable: {exc}") from exc

    async def register_worker(self, info: WorkerInfo, ttl: float, load: WorkerLoad = WorkerLoad()) -> None:
        worker_key = self._key("worker", info.worker_id)
        with self._guard():
            await self._drop(info.worker_id, deregister=False)
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(worker_key)
                pipe.hset(worker_key, mapping={"info": _to_json(info), "load": _to_json(load)})
                pipe.pexpire(worker_key, _ttl_ms(ttl))
                pipe.sadd(self._key("workers"), info.worker_id)
                await pipe.execute()

    async def heartbeat(self, worker_id: str, load: WorkerLoad, ttl: float) -> bool:
        with self._guard():
            renewed = await self._heartbeat(keys=[self._key("worker", worker_id)], args=[_to_json(load), _ttl_ms(ttl)])
            if not renewed:
                await self._prune(worker_id)
        return bool(renewed)

    async def list_workers(self) -> list[WorkerRecord]:
        with self._guard():
            flat = await self._list_workers(keys=[self._key("workers")], args=[
                self._key("worker", ""), self._key("blocks", ""), self._key("block", "")])
        found = {flat[i]: (flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)}
        listed = {}
        for worker_id in sorted(found):
            raw = found[worker_id]
            last = self._listed.get(worker_id)
            listed[worker_id] = (raw, last[1] if last is not None and last[0] == raw else _record(*raw))
        self._listed = listed
        return [record for _, record in listed.values()]

    async def remove_worker(self, worker_id: str) -> None:
        with self._guard():
            await self._redis.delete(self._key("worker", worker_id))
            await self._drop(worker_id, deregister=True)

    async def add_blocks(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        await self.update_blocks(worker_id, stored=hashes)

    async def remove_blocks(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        await self.update_blocks(worker_id, evicted=hashes)

    async def update_blocks(self, worker_id: str, stored: Iterable[BlockHash] = (),
                            evicted: Iterable[BlockHash] = (), *, reset: bool = False) -> None:
        stored, evicted = list(stored), list(evicted)
        if not (stored or evicted or reset):
            return
        with self._guard():
            await self._update_blocks(keys=[self._key("blocks", worker_id)], args=[
                worker_id, self._key("block", ""), "1" if reset else "0", len(stored), *stored, *evicted])

    async def match_prefix(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not hashes:
            return {}
        with self._guard():
            flat = await self._match_prefix(keys=[], args=[self._key("block", ""), *hashes])
        return dict(zip(flat[::2], flat[1::2]))

    async def drop_worker_blocks(self, worker_id: str) -> None:
        with self._guard():
            await self._drop(worker_id, deregister=False)

    async def _drop(self, worker_id: str, *, deregister: bool) -> None:
        keys = [self._key("blocks", worker_id), self._key("workers")]
        await self._drop_blocks(keys=keys, args=[worker_id, self._key("block", ""), "1" if deregister else "0"])

    async def _prune(self, worker_id: str) -> None:
        keys = [self._key("worker", worker_id), self._key("blocks", worker_id), self._key("workers")]
        await self._prune_expired(keys=keys, args=[worker_id, self._key("block", "")])

    async def claim(self, key: str, owner: str, ttl: float) -> bool:
        with self._guard():
            return bool(await self._redis.set(self._key("claim", key), owner, nx=True, px=_ttl_ms(ttl)))

    async def release(self, key: str, owner: str) -> None:
        with self._guard():
            await self._release(keys=[self._key("claim", key)], args=[owner])

    async def ping(self) -> None:
        with self._guard():
            await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()
