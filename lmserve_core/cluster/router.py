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


class PrefixAffinityRouter(RequestRouter):
    """Routing-key affinity with a least-loaded fallback (see the module's docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._next = 0

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
        return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]
