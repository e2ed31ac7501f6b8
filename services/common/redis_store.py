"""Store on Redis, shared by scheduler replicas. Keys, all under the namespace (default `tandem`):

  {ns}:workers            set of registered worker ids (expired ones are pruned by list_workers)
  {ns}:worker:{id}        hash {info, load} (JSON), expiring ttl after the last register/heartbeat
  {ns}:blocks:{id}        set of block hashes the worker caches
  {ns}:block:{hash}       set of worker ids caching the block (the prefix index)
  {ns}:claim:{key}        the owner of a claim, expiring with its ttl

Every Redis or socket error is raised as StoreUnavailable.
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

from services.common.block_hash import BlockHash
from services.common.store import (
    ModelResidency, ModelState, StoreUnavailable, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole, leading_matches,
)

# KEYS: worker hash. ARGV: load JSON, ttl ms. Renews only a worker that has not expired.
_HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'load', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: worker blocks set, workers set. ARGV: worker id, block key prefix, "1" to also deregister.
_DROP_BLOCKS = """
for _, h in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  redis.call('SREM', ARGV[2] .. h, ARGV[1])
end
redis.call('DEL', KEYS[1])
if ARGV[3] == '1' then redis.call('SREM', KEYS[2], ARGV[1]) end
return 1
"""

# KEYS: worker hash, worker blocks set, workers set. ARGV: worker id, block key prefix.
# Forgets a worker whose hash expired; atomic, so a worker re-registering meanwhile is kept.
_PRUNE_EXPIRED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for _, h in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  redis.call('SREM', ARGV[2] .. h, ARGV[1])
end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
"""

# KEYS: claim key. ARGV: owner. Deletes the claim only while that owner holds it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _ttl_ms(ttl: float) -> int:
    return max(1, round(ttl * 1000))


def _to_json(value: WorkerInfo | WorkerLoad) -> str:
    return json.dumps(dataclasses.asdict(value))


def _record(fields: dict[str, str]) -> WorkerRecord:
    info = json.loads(fields["info"])
    info["role"] = WorkerRole(info["role"])
    info["catalogue"] = tuple(info.get("catalogue", ()))
    load = json.loads(fields["load"])
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
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._drop_blocks = self._redis.register_script(_DROP_BLOCKS)
        self._prune_expired = self._redis.register_script(_PRUNE_EXPIRED)
        self._release = self._redis.register_script(_RELEASE)
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
            worker_ids = sorted(await self._redis.smembers(self._key("workers")))
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker_id in worker_ids:
                    pipe.hgetall(self._key("worker", worker_id))
                fields = await pipe.execute()
            records, listed = [], {}
            for worker_id, values in zip(worker_ids, fields):
                if not values:
                    await self._prune(worker_id)
                    continue
                raw = (values["info"], values["load"])
                last = self._listed.get(worker_id)
                record = last[1] if last is not None and last[0] == raw else _record(values)
                listed[worker_id] = (raw, record)
                records.append(record)
            self._listed = listed
        return records

    async def remove_worker(self, worker_id: str) -> None:
        with self._guard():
            await self._redis.delete(self._key("worker", worker_id))
            await self._drop(worker_id, deregister=True)

    async def add_blocks(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        hashes = list(hashes)
        if not hashes:
            return
        with self._guard():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.sadd(self._key("blocks", worker_id), *hashes)
                for block_hash in hashes:
                    pipe.sadd(self._key("block", block_hash), worker_id)
                await pipe.execute()

    async def remove_blocks(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        hashes = list(hashes)
        if not hashes:
            return
        with self._guard():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.srem(self._key("blocks", worker_id), *hashes)
                for block_hash in hashes:
                    pipe.srem(self._key("block", block_hash), worker_id)
                await pipe.execute()

    async def match_prefix(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not hashes:
            return {}
        with self._guard():
            async with self._redis.pipeline(transaction=False) as pipe:
                for block_hash in hashes:
                    pipe.smembers(self._key("block", block_hash))
                holders = await pipe.execute()
        return leading_matches(holders)

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
