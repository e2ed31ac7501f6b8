"""Every scheduler test of test_scheduler_service again, with each request on a Submissions stream
(the gateway's client, services/gateway/submissions.py, one stream per test's scheduler) instead of
a Submit call of its own: placements, lost attempts and continuations, statuses with their messages
and retry hints, cancels and deadlines must come out the same. The `scheduler(...)` mesh's stub
submits on the stream; everything else is the original test."""

from __future__ import annotations

import pytest

from services.gateway.submissions import SchedulerSubmissions
from services.scheduler.servicer import SchedulerServicer
from tandem.v1 import scheduler_pb2_grpc
from tests.redis_fixture import private_redis  # noqa: F401 (fixture)
from tests.unit import test_scheduler_service as service

_SERVED_ALONE = {"test_tandem_scheduler_serves_and_reports_serving"}  # starts its own process: no stream
globals().update({name: test for name, test in vars(service).items()
                  if name.startswith("test_") and callable(test) and name not in _SERVED_ALONE})


class _StreamStub(scheduler_pb2_grpc.SchedulerServiceStub):
    """The scheduler's stub whose Submit rides the channel's one Submissions stream."""

    def __init__(self, channel) -> None:
        super().__init__(channel)
        submissions = SchedulerSubmissions(self)
        self.Submit = lambda request, *, metadata, timeout: submissions.submit(request, timeout=timeout,
                                                                               metadata=metadata)


def _no_submit_call(self, request, context):
    raise AssertionError("a request came on a Submit call of its own, not on the Submissions stream")


@pytest.fixture(autouse=True)
def submitted_on_one_stream(monkeypatch) -> None:
    monkeypatch.setattr(service.scheduler_pb2_grpc, "SchedulerServiceStub", _StreamStub)
    monkeypatch.setattr(SchedulerServicer, "Submit", _no_submit_call)
