"""Requests assigned to a colocated worker from a test, as the scheduler does: on one Assign call."""

from __future__ import annotations

import grpc

from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.v1.errors import code_from_number


class Refused(grpc.RpcError):
    """A request the worker refused, read as the failed call a test expects: its code and details."""

    def __init__(self, status) -> None:
        super().__init__(status.message)
        self._status = status

    def code(self) -> grpc.StatusCode:
        return code_from_number(self._status.code)

    def details(self) -> str:
        return self._status.message


def assign(channel: grpc.Channel, *requests: worker_pb2.RunRequest, timeout: float) -> list[worker_pb2.RunResult]:
    """Each request's RunResult, in the order of `requests`, once all are queued; Refused for the
    first one refused."""
    for call_id, request in enumerate(requests, 1):
        request.call_id = call_id
    answers = worker_pb2_grpc.ColocatedServiceStub(channel).Assign(iter(requests), timeout=timeout)
    by_call = {result.call_id: result for result in answers}
    results = [by_call[request.call_id] for request in requests]
    for result in results:
        if result.status.code:
            raise Refused(result.status)
    return results
