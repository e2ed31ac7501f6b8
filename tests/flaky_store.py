"""A Store whose backend can be switched off, for the scheduler's degraded-mode tests."""

from __future__ import annotations

import time
from collections.abc import Callable

from services.common.store import EmbeddedStore, StoreUnavailable


class FlakyStore(EmbeddedStore):
    """An EmbeddedStore that raises StoreUnavailable on every call while `down`, as RedisStore
    does while Redis is unreachable; it keeps its data meanwhile."""

    name = "redis"

    def __init__(self, clock: Callable[[], float] = time.monotonic, down: bool = False) -> None:
        super().__init__(clock)
        self.down = down

    def __getattribute__(self, name: str):
        attribute = super().__getattribute__(name)
        if name.startswith("_") or not callable(attribute) or not super().__getattribute__("down"):
            return attribute

        async def unavailable(*_args, **_kwargs):
            raise StoreUnavailable("redis at redis://127.0.0.1:6390/0 unavailable: Connection refused")

        return unavailable
