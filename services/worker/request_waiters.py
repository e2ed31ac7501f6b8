"""What a request's handler awaits while the worker runs it: its first output, and its abort.

Call order: open(request_id) before the engine gets the request -> `note(outputs)` after each
engine step resolves the first output -> `abort(request_id)` resolves it with None and wakes
`until_aborted` -> close(request_id) when the handler is done with the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.runtime.engine import RequestOutput


@dataclass(slots=True)
class _Waiter:
    first: asyncio.Future[RequestOutput | None]
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class RequestWaiters:
    def __init__(self) -> None:
        self._waiters: dict[str, _Waiter] = {}

    def open(self, request_id: str) -> None:
        self._waiters[request_id] = _Waiter(asyncio.get_running_loop().create_future())

    def close(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiters

    def request_ids(self) -> list[str]:
        return list(self._waiters)

    def note(self, outputs: Iterable[RequestOutput]) -> None:
        for output in outputs:
            waiter = self._waiters.get(output.request_id)
            if waiter is not None and not waiter.first.done():
                waiter.first.set_result(output)

    def abort(self, request_id: str) -> bool:
        """Marks the request aborted; False if no handler waits on it."""
        waiter = self._waiters.get(request_id)
        if waiter is None:
            return False
        waiter.aborted.set()
        if not waiter.first.done():
            waiter.first.set_result(None)
        return True

    async def first_output(self, request_id: str) -> RequestOutput | None:
        """The request's first output; None when it was aborted before one."""
        return await self._waiters[request_id].first

    def was_aborted(self, request_id: str) -> bool:
        waiter = self._waiters.get(request_id)
        return waiter is not None and waiter.aborted.is_set()

    async def until_aborted(self, request_id: str) -> None:
        await self._waiters[request_id].aborted.wait()
