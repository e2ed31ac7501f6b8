"""What the gateway calls upstream: its schedulers (one or more, `--scheduler a,b`) and the workers
they place requests on, whose token streams it reads.

Requests go to schedulers by their leading prefix (replica_choice.py), each request on its scheduler's one Submissions
stream (submissions.py); each scheduler keeps its own requests (their queue,
reservations and accounting), so a request stays with the scheduler that placed it, its
continuations included, unless that one cannot be reached or is lost. A submission whose
stream to its scheduler broke or never connected goes to the next one; one the scheduler
answered has its own answer. Worker channels are opened on first use, one per address, and
carry the tokens of all the gateway's requests on that worker on one call (follow.py).
With a `stream_interval` above 1, a worker's stream sends the first token at once and then
messages of at least that many tokens (fewer messages to read and chunks to send, per token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from services.common.channels import internal_channel
from services.gateway.follow import FollowedStream, WorkerFollow
from services.gateway.replica_choice import ReplicaChoice, prefix_key
from services.gateway.submissions import SchedulerSubmissions, SubmitCall
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc


@dataclass(frozen=True, slots=True)
class SchedulerLink:
    """One scheduler: its stub, the stream its requests ride, and the channel that says whether it
    is failing."""

    stub: scheduler_pb2_grpc.SchedulerServiceStub
    channel: grpc.aio.Channel
    submissions: SchedulerSubmissions

    @classmethod
    def over(cls, channel: grpc.aio.Channel) -> SchedulerLink:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return cls(stub, channel, SchedulerSubmissions(stub))

    def submit(self, request: scheduler_pb2.SubmitRequest, *, timeout: float | None,
               metadata: Sequence[tuple[str, str]]) -> SubmitCall:
        """Submit the request on the scheduler's Submissions stream; read it as its Submit call."""
        return self.submissions.submit(request, timeout=timeout, metadata=metadata)

    def failing(self) -> bool:
        """True while the channel's last attempt to connect failed (the scheduler is down or restarting)."""
        return self.channel.get_state() in (grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                                            grpc.ChannelConnectivity.SHUTDOWN)


class Upstream:
    """Call order: first_turn(request) per request, scheduler(turn) for each Submit (turn + 1 after one
    whose stream to its scheduler broke), stream() for the workers' tokens; close() last."""

    def __init__(self, schedulers: Sequence[grpc.aio.Channel],
                 open_channel: Callable[[str], grpc.aio.Channel] = internal_channel, stream_interval: int = 1) -> None:
        if not schedulers:
            raise ValueError("the gateway needs at least one scheduler address")
        if stream_interval < 1:
            raise ValueError(f"stream_interval is {stream_interval}; give 1 (each token as it comes) or more")
        self.stream_interval = stream_interval
        self._schedulers = [SchedulerLink.over(c) for c in schedulers]
        self._choice = ReplicaChoice(len(self._schedulers))
        self._open_channel = open_channel
        self._workers: dict[str, tuple[grpc.aio.Channel, WorkerFollow]] = {}

    @property
    def num_schedulers(self) -> int:
        return len(self._schedulers)

    def first_turn(self, request: scheduler_pb2.SubmitRequest) -> int:
        """Where a new request starts: the replica its leading prefix hashes to, within the bound on
        its load, passing over those whose channel is failing (replica_choice.py)."""
        key = prefix_key(request.model, request.cache_salt, request.lora, request.token_ids)
        return self._choice.choose(key, lambda replica: not self._schedulers[replica].failing())

    def scheduler(self, turn: int) -> SchedulerLink:
        return self._schedulers[turn % len(self._schedulers)]

    def stream(self, address: str, request: worker_pb2.StreamRequest,
               metadata: tuple[tuple[str, str], ...]) -> FollowedStream:
        """The request's events from the worker at `address`, `stream_interval` tokens a message, on
        the gateway's Follow call to that worker (follow.py)."""
        request.min_tokens_per_message = self.stream_interval
        if address not in self._workers:
            channel = self._open_channel(address)
            self._workers[address] = (channel, WorkerFollow(worker_pb2_grpc.TokenStreamServiceStub(channel)))
        return self._workers[address][1].attach(request, metadata)

    async def close(self) -> None:
        """End the Submissions streams, and close the channels it opened to workers (the schedulers'
        are the caller's)."""
        for scheduler in self._schedulers:
            scheduler.submissions.close()
        for channel, follow in self._workers.values():
            follow.close()
            await channel.close()
        self._workers.clear()
