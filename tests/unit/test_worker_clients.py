"""The scheduler's clients to workers: one stub per worker address and service, kept until the
worker is forgotten (a lost worker's next incarnation gets a fresh channel and stubs)."""

from __future__ import annotations

from services.scheduler.worker_clients import WorkerClients

ADDRESS = "127.0.0.1:1"


async def test_one_stub_per_address_and_service_until_the_worker_is_forgotten() -> None:
    clients = WorkerClients()
    try:
        stub = clients.colocated(ADDRESS)
        assert clients.colocated(ADDRESS) is stub
        assert clients.decode(ADDRESS) is not clients.prefill(ADDRESS)
        assert clients.decode(ADDRESS) is clients.decode(ADDRESS)
        assert clients.colocated("127.0.0.1:2") is not stub
        await clients.forget(ADDRESS)
        assert clients.colocated(ADDRESS) is not stub
    finally:
        await clients.close()
