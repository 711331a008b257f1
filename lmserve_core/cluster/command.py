"""``lmserve cluster MODEL --replicas N``: lmserve replicas on Ray Serve behind one ingress
(docs/cluster.md). Every option of ``lmserve`` but the cluster's own is passed to each
replica unchanged."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import logs
from ..launch import UsageError, build_parser, check_args, pick_backend
from .wire import ROUTINGS

if TYPE_CHECKING:
    from ray import serve

APP = "lmserve"


def cluster_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmserve cluster",
        usage="lmserve cluster [MODEL] [cluster options] [lmserve options]",
        description="Serve a model from N lmserve replicas on Ray Serve behind one ingress "
        "that keeps each conversation on the replica holding its KV. Every other option is "
        "lmserve's own (`lmserve --help`), given to each replica.",
        add_help=True,
    )
    p.add_argument("--replicas", type=int, default=2, help="replicas to start (default 2)")
    p.add_argument(
        "--replica-cpus", type=float, default=1.0,
        help="CPUs Ray reserves for each replica; its compute threads unless --threads "
        "says otherwise (default 1)",
    )
    p.add_argument(
        "--address",
        help="the Ray cluster to join: `auto` (the one `ray start` started on this machine) "
        "or ray://HOST:PORT; default: start a local one in this process",
    )
    p.add_argument("--min-replicas", type=int, help="autoscale down to this many replicas")
    p.add_argument("--max-replicas", type=int, help="autoscale up to this many replicas")
    p.add_argument(
        "--routing", choices=ROUTINGS, default="prefix",
        help="prefix: a conversation stays on one replica while it has room (default); "
        "round-robin: no affinity",
    )
    p.add_argument(
        "--admit-wait", type=float, default=2.0, metavar="SECONDS",
        help="how long a request may wait at the ingress for a replica with room (every "
        "replica holding --batch running and --queue waiting) before it is answered 429 + "
        "retry-after (default 2)",
    )
    return p


def _replica_argv(rest: list[str], threads: int) -> list[str]:
    argv = list(rest)

    def given(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in argv)

    if not given("--threads"):
        argv += ["--threads", str(threads)]
    if not given("--kv-slots"):
        # a replica keeps every conversation routed to it while memory allows
        argv += ["--kv-slots", "auto"]
    return argv


def build_application(cluster: argparse.Namespace, args: argparse.Namespace,
                      replica_argv: list[str]) -> serve.Application:
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from .deployments import LmserveIngress, LmserveReplica

    replicas = cluster.replicas
    per_replica = args.batch + args.queue  # running + waiting: the engine's bound
    options: dict[str, object] = {
        "name": "lmserve-replica",
        "max_ongoing_requests": per_replica,
        # the wait at the ingress is bounded in time (--admit-wait), not by Ray's count,
        # which also counts requests on their way to a replica with room
        "max_queued_requests": -1,
        "ray_actor_options": {"num_cpus": cluster.replica_cpus},
        "request_router_config": RequestRouterConfig(
            request_router_class="lmserve_core.cluster.router.PrefixAffinityRouter",  # type: ignore[arg-type]
        ),
        "graceful_shutdown_timeout_s": 30,
        "health_check_period_s": 2,
        "health_check_timeout_s": 30,
    }
    if cluster.min_replicas is not None or cluster.max_replicas is not None:
        low = cluster.min_replicas if cluster.min_replicas is not None else 1
        high = cluster.max_replicas if cluster.max_replicas is not None else max(replicas, low)
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=low, max_replicas=high, initial_replicas=min(max(replicas, low), high),
            # more requests than a replica generates at once: a queue forms, add one
            target_ongoing_requests=args.batch,
        )
    else:
        options["num_replicas"] = replicas
    deployment: Any = serve.deployment  # typed for its use as a decorator factory
    replica = deployment(LmserveReplica).options(**options)
    ingress = deployment(LmserveIngress).options(
        name="lmserve-ingress", max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=30,
    )
    return ingress.bind(replica.bind(replica_argv), cluster.routing, cluster.admit_wait)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, argparse.Namespace, list[str]]:
    """The cluster's options, the replicas' (``lmserve``'s) and the replicas' argv; raises
    UsageError."""
    cluster, rest = cluster_parser().parse_known_args(list(argv))
    args = build_parser().parse_args(rest)
    check_args(args)
    if cluster.replicas < 1:
        raise UsageError("--replicas must be at least 1")
    if cluster.admit_wait < 0:
        raise UsageError("--admit-wait must be 0 or positive")
    if cluster.replica_cpus <= 0:
        raise UsageError("--replica-cpus must be positive")
    for name in ("min_replicas", "max_replicas"):
        value = getattr(cluster, name)
        if value is not None and value < (0 if name == "min_replicas" else 1):
            raise UsageError(f"--{name.replace('_', '-')} is out of range")
    if (cluster.min_replicas or 0) > (cluster.max_replicas or sys.maxsize):
        raise UsageError("--min-replicas is above --max-replicas")
    pick_backend(args)  # the model and its backend, before Ray starts for nothing
    threads = args.threads or max(1, int(cluster.replica_cpus))
    return cluster, args, _replica_argv(rest, threads)


def app(config: dict[str, str]) -> serve.Application:
    """The application ``lmserve cluster`` deploys, for Serve's own CLI and config files:
    ``serve run lmserve_core.cluster.command:app argv="model.gguf --replicas 2"``
    (``argv``: the command's arguments; the address and port are then Serve's)."""
    try:
        cluster, args, replica_argv = parse(shlex.split(config.get("argv", "")))
    except UsageError as exc:
        raise ValueError(f"lmserve cluster: {exc}") from None
    return build_application(cluster, args, replica_argv)


def main(argv: Sequence[str]) -> int:
    """``lmserve cluster ...``; the exit status. Its help and checks need no Ray."""
    try:
        cluster, args, replica_argv = parse(argv)
    except UsageError as exc:
        print(f"lmserve cluster: error: {exc}", file=sys.stderr)
        return 2
    try:
        import ray
        from ray import serve
        from ray.serve.config import HTTPOptions

        from .deployments import METRICS_BOARD, NAMESPACE
    except ImportError as exc:  # Ray is an optional extra
        print(f"lmserve cluster: error: {exc}; install it with "
              "`pip install 'lmserve-core[ray]'`", file=sys.stderr)
        return 2
    logs.configure(args.log_level, log_format=args.log_format)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    init: dict[str, object] = {"namespace": NAMESPACE, "include_dashboard": False,
                               "log_to_driver": True}
    if cluster.address:
        init["address"] = cluster.address
    else:
        wanted = (cluster.max_replicas or cluster.replicas) * cluster.replica_cpus
        init["num_cpus"] = max(os.cpu_count() or 1, int(wanted + 0.999))
    ray.init(**init)  # type: ignore[arg-type]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=HTTPOptions(host=args.host, port=args.port))
        serve.run(build_application(cluster, args, replica_argv), name=APP, route_prefix="/")
        print(f"lmserve cluster: serving on http://{args.host}:{args.port} "
              f"({cluster.replicas} replicas, routing {cluster.routing})",
              file=sys.stderr, flush=True)
        stop.wait()
        print("lmserve cluster: stopping (draining the replicas)", file=sys.stderr, flush=True)
    finally:
        try:
            serve.delete(APP)  # drains: requests in progress end first
            if not cluster.address:  # a cluster of our own; on a shared one, other apps stay
                serve.shutdown()
            board = ray.get_actor(METRICS_BOARD, namespace=NAMESPACE)
            ray.kill(board)
        except Exception:  # noqa: BLE001 (already gone)
            pass
        ray.shutdown()
    return 0
