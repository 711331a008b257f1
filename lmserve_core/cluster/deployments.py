"""The two Ray Serve deployments of ``lmserve cluster``.

``LmserveReplica`` is a whole lmserve: the model, its engine (worker, bounded queue, KV
slots, disk tier) and the Litestar application ``lmserve`` serves, answering in-process the
HTTP requests the ingress hands it, its response streamed back a message at a time.
``LmserveIngress`` receives the HTTP requests, picks the routing key, calls a replica through
the :class:`~.router.PrefixAffinityRouter` and relays the response; when no replica can take
a request it answers 429 in the dialect's envelope, and when the replica serving a stream is
lost it ends the stream with the dialect's in-band error.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray
import structlog
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from . import wire

log = structlog.get_logger("lmserve.cluster")

NAMESPACE = "lmserve"
METRICS_BOARD = "lmserve-metrics"
METRICS_PERIOD_S = 2.0
# Headers of the replica's response the ingress does not pass on: the connection's own.
_HOP = {b"content-length", b"transfer-encoding", b"connection", b"date", b"server", b"keep-alive"}
REPLICA_HEADER = "x-lmserve-replica"


@ray.remote(num_cpus=0)
class MetricsBoard:
    """Where the replicas leave their latest /metrics text for the ingress to merge."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[str, float]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (text, time.time())

    def fresh(self, max_age: float) -> dict[str, str]:
        now = time.time()
        self.texts = {k: v for k, v in self.texts.items() if now - v[1] <= max_age}
        return {k: v[0] for k, v in self.texts.items()}


def metrics_board() -> Any:
    return MetricsBoard.options(  # type: ignore[attr-defined]
        name=METRICS_BOARD, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


class LmserveReplica:
    """One lmserve engine (see the module's docstring); ``argv``: ``lmserve``'s arguments."""

    def __init__(self, argv: list[str]) -> None:
        from .. import logs
        from ..launch import build, build_parser
        from ..plugins import pm

        args = build_parser().parse_args(argv)
        logs.configure(args.log_level, log_format="json")
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        rank = getattr(context.rank, "rank", context.rank)
        # Ray admits at most --batch + --queue requests (max_ongoing_requests): the engine
        # takes all of them, even those arriving together before its worker has moved any
        # into the running batch (on its own it would count them all as waiting)
        args.queue += args.batch
        if args.kv_cache_dir:  # a directory of its own, the same after a restart
            args.kv_cache_dir = str(Path(args.kv_cache_dir) / f"replica-{rank}")
        self.built = build(args)
        self.app = self.built.app
        self.built.engine.start()
        self._pm = pm
        pm.hook.startup(backend=self.built.backend, settings=self.built.server.settings)
        self.pid = os.getpid()
        self._stop = threading.Event()
        threading.Thread(target=self._push_metrics, name="lmserve-metrics", daemon=True).start()
        log.info("replica_ready", replica=self.name, rank=rank, pid=self.pid,
                 threads=args.threads)

    def _push_metrics(self) -> None:
        board = metrics_board()
        while not self._stop.wait(METRICS_PERIOD_S / 2):
            try:
                text = self.built.engine.metrics.render().decode()
                ray.get(board.put.remote(self.name, text), timeout=5)
            except Exception:  # the board restarting: the next round tries again
                log.debug("metrics_push_failed", exc_info=True)

    async def handle(
        self,
        key: str | None,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> AsyncIterator[Any]:
        """The response to one HTTP request: first ``(status, headers)``, then the body's
        bytes as the application sends them (what is ready at once goes as one piece)."""
        del key  # the router's
        yield self.name  # taken: the ingress stops counting its wait for a replica
        if path == "/cluster/replica":
            yield 200, [(b"content-type", b"application/json")]
            yield wire.json_bytes({"replica": self.name, "pid": self.pid,
                                   "node": ray.get_runtime_context().get_node_id()})
            return
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            messages.put_nowait(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": query, "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
        }
        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while True:
                message = await messages.get()
                if message is None:
                    return
                if message["type"] == "http.response.start":
                    out = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.name.encode())]
                    yield message["status"], out
                    continue
                if message["type"] != "http.response.body":
                    continue
                chunks = [message.get("body", b"")]
                more = message.get("more_body", False)
                while more and not messages.empty():  # frames ready together go together
                    following = messages.get_nowait()
                    if following is None:
                        more = False
                        break
                    chunks.append(following.get("body", b""))
                    more = following.get("more_body", False)
                data = b"".join(chunks)
                if data:
                    yield data
                if not more:
                    return
        finally:
            disconnected.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, 5)
                except Exception:  # it does not end: cut it off
                    task.cancel()

    def __del__(self) -> None:
        # Serve's graceful stop, once the requests in progress have ended (or timed out)
        built = getattr(self, "built", None)
        if built is None:
            return
        self._stop.set()
        built.engine.begin_shutdown()
        self._pm.hook.shutdown(backend=built.backend)
        built.engine.stop()
        built.backend.close()


class LmserveIngress:
    """The HTTP face of the cluster (see the module's docstring)."""

    def __init__(self, replicas: DeploymentHandle, routing: str = "prefix",
                 admit_wait: float = 2.0, retry_after: int = 1) -> None:
        self.replicas = replicas.options(stream=True)
        self.routing = routing
        self.admit_wait = admit_wait
        self.retry_after = retry_after
        self.board = metrics_board()

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            texts = await self.board.fresh.remote(METRICS_PERIOD_S * 5)
            texts["ingress"] = wire.routing_metrics()
            return Response(wire.merge_metrics(texts), media_type=wire.METRICS_TYPE)
        body = await request.body()
        headers = request.headers
        routing = headers.get(wire.ROUTING_HEADER, self.routing)
        key = wire.routing_key(path, body, headers) if routing == "prefix" else None
        call = (key, request.method, path, request.url.query.encode(), request.headers.raw, body)
        attempts = 3
        for attempt in range(attempts):
            stream: Any = self.replicas.handle.remote(*call)  # a DeploymentResponseGenerator
            try:
                try:
                    await asyncio.wait_for(stream.__anext__(), self.admit_wait)
                except (TimeoutError, BackPressureError):
                    stream.cancel()
                    return self._refusal(path, headers, 429, "every replica is busy; retry later")
                status, raw = await stream.__anext__()
                break
            except (RayActorError, DeploymentUnavailableError) as exc:
                # not started: another replica can take it
                log.warning("replica_lost", path=path, attempt=attempt, error=str(exc))
                if attempt == attempts - 1:
                    return self._refusal(path, headers, 503, "no replica could take the request")
            except StopAsyncIteration:
                return self._refusal(path, headers, 502, "the replica sent no response")
            except asyncio.CancelledError:  # the client left: so does the replica's request
                stream.cancel()
                raise
        passed = [(k, v) for k, v in raw if k.lower() not in _HOP]
        if wire.is_event_stream((k.decode("latin-1"), v.decode("latin-1")) for k, v in raw):
            response: Response = StreamingResponse(self._relay(stream, path), status_code=status)
        else:
            try:
                content = b"".join([chunk async for chunk in stream])
            except RayError as exc:
                log.warning("replica_lost", path=path, error=str(exc))
                return self._refusal(path, headers, 502, "the replica serving the request was lost")
            except asyncio.CancelledError:
                stream.cancel()
                raise
            response = Response(content, status_code=status)
            passed.append((b"content-length", str(len(content)).encode()))
        response.raw_headers = passed
        return response

    async def _relay(self, stream: Any, path: str) -> AsyncIterator[bytes]:
        watch = wire.StreamWatch(path)
        try:
            async for chunk in stream:
                watch.feed(chunk)
                yield chunk
        except RayError as exc:
            log.warning("stream_cut", path=path, error=str(exc))
            yield watch.error_frames(
                500, "the replica serving this stream was lost; retry the request"
            )
        finally:
            stream.cancel()

    def _refusal(self, path: str, headers: Any, status: int, message: str) -> Response:
        content, out = wire.error_response(
            path, headers, status, message, retry_after=self.retry_after
        )
        return Response(content, status_code=status, headers=out)
