"""The request router of the replicas' deployment: a conversation goes to its replica, and
new ones to the replicas in turn (``wire.Affinity``: the conversations of a burst spread
evenly at once); when its replica is full it waits a round more, then goes to the least
loaded other, which keeps it from then on (logged ``route_moved`` and counted in
``lmserve_route_moves_total`` of the ingress's metrics).

The ingress passes the key as the first argument of the replica call (None: no affinity,
round robin). Ray Serve probes the ranks in order and takes, within a rank, the replica with
the shortest queue below its ``max_ongoing_requests``."""

from __future__ import annotations

from typing import Any

import structlog
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from . import wire

log = structlog.get_logger("lmserve.cluster")

# Rounds of selection in which only a request's own replica is asked whether it has room:
# Ray gives up on a replica whose answer takes longer than its probe deadline (100 ms at
# first, doubling each round), which a busy replica on a loaded machine can miss; one more
# round keeps the conversation where its KV is. A full replica answers at once: falling back
# then costs a round, milliseconds.
PRIMARY_ROUNDS = 2


class PrefixAffinityRouter(RequestRouter):
    """Conversation affinity with a least-loaded fallback (see the module's docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._next = 0
        self._rounds: dict[str, int] = {}  # a request's rounds of selection so far
        self._affinity = wire.Affinity()

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any,
                          result: Any) -> None:
        self._rounds.pop(pending_request.metadata.internal_request_id, None)
        key = _key(pending_request)
        if key is not None and self._affinity.routed(key, replica_id.unique_id):
            wire.ROUTE_MOVES.inc()
            log.info("route_moved", key=key, to=replica_id.unique_id)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = None
        if pending_request is not None:
            # every replica full: wait with a growing pause between probes, not spin
            pending_request.routing_context.should_backoff = True
            key = _key(pending_request)
        if key is None:
            n = len(candidate_replicas)
            start = getattr(self, "_next", 0) % n
            self._next = start + 1
            return [[candidate_replicas[(start + i) % n]] for i in range(n)]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_name[name] for name in self._affinity.place(key, list(by_name))]
        assert pending_request is not None
        rid = pending_request.metadata.internal_request_id
        if len(self._rounds) > 4096:  # requests routed without the hook, or given up on
            self._rounds.clear()
        rounds = self._rounds[rid] = self._rounds.get(rid, 0) + 1
        if rounds <= PRIMARY_ROUNDS or len(ranked) == 1:
            return [ranked[:1]]
        return [ranked[:1], ranked[1:]]


def _key(pending_request: PendingRequest) -> str | None:
    args = pending_request.args
    return args[0] if args and isinstance(args[0], str) else None
