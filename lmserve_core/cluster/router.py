"""The request router of the replicas' deployment: a conversation goes to the replica its
routing key hashes to (rendezvous hashing: a replica that leaves or joins moves only the
conversations it owned or takes), or, when that replica is full, to the least loaded other.

The ingress passes the key as the first argument of the replica call (None: no affinity,
round robin). Ray Serve probes the ranks in order and takes, within a rank, the replica with
the shortest queue below its ``max_ongoing_requests``."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .wire import rank_by_key

# Rounds of selection in which only a request's own replica is asked whether it has room:
# Ray gives up on a replica whose answer takes longer than its probe deadline (100 ms at
# first, doubling each round), which a busy replica on a loaded machine can miss; one more
# round keeps the conversation where its KV is. A full replica answers at once: falling back
# then costs a round, milliseconds.
PRIMARY_ROUNDS = 2


class PrefixAffinityRouter(RequestRouter):
    """Routing-key affinity with a least-loaded fallback (see the module's docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._next = 0
        self._rounds: dict[str, int] = {}  # a request's rounds of selection so far

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any,
                          result: Any) -> None:
        self._rounds.pop(pending_request.metadata.internal_request_id, None)

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
            if pending_request.args and isinstance(pending_request.args[0], str):
                key = pending_request.args[0]
        if key is None:
            n = len(candidate_replicas)
            start = getattr(self, "_next", 0) % n
            self._next = start + 1
            return [[candidate_replicas[(start + i) % n]] for i in range(n)]
        ranked = rank_by_key(key, candidate_replicas, lambda r: r.replica_id.unique_id)
        assert pending_request is not None
        rid = pending_request.metadata.internal_request_id
        if len(self._rounds) > 4096:  # requests routed without the hook, or given up on
            self._rounds.clear()
        rounds = self._rounds[rid] = self._rounds.get(rid, 0) + 1
        if rounds <= PRIMARY_ROUNDS or len(ranked) == 1:
            return [ranked[:1]]
        return [ranked[:1], ranked[1:]]
