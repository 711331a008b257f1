"""The bounded queue, the one inference worker, and the per-request stream pipe.

Requests are accepted concurrently on the asyncio side, prepared (the backend's
``validate``: prompt rendered and tokenized, grammar compiled) on a few preparation threads
(``PREPARE_THREADS``), and generated on a single worker thread that owns the backend. A
backend that batches (``lmserve_core.backend.Batching``: ``begin`` and ``step``) runs up to
``batch_size`` generations at once: the worker advances them a step at a time, takes
queued requests into the running batch between steps, and lets each one leave as soon as
it ends. Any other backend generates one request at a time. Work that is not a generation
(an embeddings request's forward passes) is queued with ``call`` and run by the same worker
between steps, so it never races the generations for the model. The worker never touches a
socket: each request gets a ``RequestStream`` whose events are handed to the event loop
with ``call_soon_threadsafe``, so a client that stops reading only grows its own buffer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from .backend import Backend, BatchedGeneration, Batching, CountsTokens, HasSlots
from .contract import ReplySink
from .errors import LmserveError, QueueFull, ShuttingDown
from .events import ErrorEvent, Event, Finish, ReasoningDelta, TextDelta, ToolCallEvent, Usage
from .metrics import Metrics
from .plugins import pm
from .request import NormalizedRequest

log = structlog.get_logger("lmserve.requests")

_SENTINEL = object()
_R = TypeVar("_R")

# Threads that prepare requests (render, tokenize, compile grammars) next to the worker:
# half the cores (two at least, so one long preparation does not hold up every other), so
# that however many requests arrive at once, their preparation leaves the worker its share.
PREPARE_THREADS = max(2, min(4, (os.cpu_count() or 2) // 2))


@dataclass(slots=True)
class _Timing:
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None


class RequestStream:
    """The asyncio side of one request: an async iterator over its events.

    The worker thread writes with ``emit`` (thread-safe, never blocks); the event loop
    reads with ``async for``. ``cancel()`` marks the request cancelled: a queued job is
    skipped, a running one stops at its next token.

    Events wait in a deque; the loop is woken once per run of events, not once per event.
    Text that arrives in one run (the tokens a speculative pass accepts) is read as one
    delta, so a stream sends a frame per run rather than per token.
    """

    def __init__(
        self,
        request: NormalizedRequest,
        loop: asyncio.AbstractEventLoop,
        metrics: Metrics | None = None,
    ) -> None:
        self.request = request
        self._metrics = metrics
        self._last_token: float | None = None
        self._loop = loop
        self._items: collections.deque[object] = collections.deque()
        self._wake_lock = threading.Lock()
        self._wake_pending = False  # a wake-up is scheduled on the loop and has not run
        self._waiter: asyncio.Future[None] | None = None
        self._cancelled = threading.Event()
        self._closed = False
        self.timing = _Timing()
        self.finish: Finish | None = None
        self.error_status: int | None = None  # the status of the error event sent, if any

    # -- worker side (EventSink) -------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        if isinstance(event, TextDelta | ReasoningDelta | ToolCallEvent):
            now = time.perf_counter()
            if self.timing.first_token is None:
                self.timing.first_token = now
            elif self._metrics is not None and self._last_token is not None:
                self._metrics.inter_token.observe(now - self._last_token)
            self._last_token = now
        elif isinstance(event, ErrorEvent):
            self.error_status = event.status
        self._put(event)

    def _put(self, item: object) -> None:
        self._items.append(item)
        with self._wake_lock:
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancelled.set()

    def _wake(self) -> None:  # on the loop
        with self._wake_lock:
            self._wake_pending = False
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _close(self) -> None:
        self._put(_SENTINEL)

    # -- asyncio side -------------------------------------------------------------------

    def cancel(self) -> None:
        self._cancelled.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self._closed:
            raise StopAsyncIteration
        items = self._items
        while not items:
            self._waiter = self._loop.create_future()
            if items:  # appended before the waiter existed: its wake-up may have run
                self._waiter = None
                break
            await self._waiter
        item = items.popleft()
        if item is _SENTINEL:
            self._closed = True
            raise StopAsyncIteration
        if isinstance(item, TextDelta | ReasoningDelta):
            kind, parts = type(item), [item.text]
            while items and type(items[0]) is kind:
                parts.append(items.popleft().text)  # type: ignore[attr-defined]
            if len(parts) > 1:
                return kind("".join(parts))
        return item  # type: ignore[return-value]


@dataclass(slots=True, eq=False)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn(*self.args))
        except BaseException as exc:  # handed to the caller, whatever it is
            self.future.set_exception(exc)


@dataclass(slots=True, eq=False)
class _Job:
    stream: RequestStream
    generation: BatchedGeneration | None = None  # its handle while it is generated in a batch
    sink: ReplySink | None = None  # what the backend emits into (batching backends)


class Engine:
    """Owns the backend, the bounded queue and the inference worker thread."""

    def __init__(
        self, backend: Backend, *, queue_size: int = 16, prepare_threads: int | None = None
    ) -> None:
        self.backend = backend
        self.queue_size = queue_size
        self._jobs: collections.deque[_Job] = collections.deque()
        self._calls: collections.deque[_Call] = collections.deque()
        self._cond = threading.Condition()
        self._accepting = True
        self._stopping = False
        self._active: list[_Job] = []  # being generated
        self._batcher = backend if isinstance(backend, Batching) else None
        self.batch_size = 1 if self._batcher is None else max(1, int(self._batcher.batch_size))
        self.metrics = Metrics()
        pool = backend.slots if isinstance(backend, HasSlots) else None
        self.metrics.watch(
            lambda: len(self._jobs),
            lambda: len(self._active),
            (lambda: pool.slots) if pool is not None else None,
        )
        disk = None if pool is None else pool.disk
        if disk is not None:
            self.metrics.watch_disk(lambda: disk.stats)
        if isinstance(backend, HasSlots) and isinstance(backend.kv_bytes, int):
            self.metrics.kv_bytes.set(backend.kv_bytes)
        self._worker = threading.Thread(target=self._run, name="lmserve-worker", daemon=True)
        self.prepare_threads = PREPARE_THREADS if prepare_threads is None else prepare_threads
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, self.prepare_threads), thread_name_prefix="lmserve-prepare"
        )
        self._ids = itertools.count(1)
        self._started = False

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._worker.start()

    def begin_shutdown(self) -> None:
        """Stop accepting and cancel everything queued or running."""
        with self._cond:
            self._accepting = False
            for job in self._jobs:
                job.stream.cancel()
            for job in self._active:
                job.stream.cancel()
            for call in self._calls:
                if call.future.set_running_or_notify_cancel():
                    call.future.set_exception(ShuttingDown("the server is shutting down"))
            self._calls.clear()
            self._cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down and wait for the worker to finish its current job."""
        self.begin_shutdown()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._started:
            self._worker.join(timeout)
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def queued(self) -> int:
        return len(self._jobs) + len(self._calls)

    @property
    def busy(self) -> bool:
        return bool(self._active)

    @property
    def active(self) -> int:
        """Requests being generated."""
        return len(self._active)

    # -- submission ---------------------------------------------------------------------

    async def prepare(self, fn: Callable[..., _R], *args: Any) -> _R:
        """``fn(*args)`` on the preparation threads: work on a request before it is queued
        (rendering and tokenizing its prompt, compiling its grammar). At most
        ``prepare_threads`` run at once, whatever arrives, so a flood of large requests
        queues here instead of taking the cores from the worker."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        return await loop.run_in_executor(self._prepare_pool, context.run, fn, *args)

    async def submit(self, request: NormalizedRequest) -> RequestStream:
        """Validate and enqueue; raises QueueFull, ShuttingDown or the backend's error."""
        return (await self.submit_all([request]))[0]

    async def submit_all(self, requests: list[NormalizedRequest]) -> list[RequestStream]:
        """Validate and enqueue several requests together (the choices of one request):
        all of them or, when the queue cannot take them all, none."""
        if not self._accepting:
            raise ShuttingDown("the server is shutting down")
        for request in requests:
            pm.hook.prepare_request(request=request, backend=self.backend)
            # Rendering a long prompt or compiling a grammar takes milliseconds to seconds:
            # off the event loop, so other connections keep being served meanwhile.
            await self.prepare(self.backend.validate, request)
        loop = asyncio.get_running_loop()
        streams = [RequestStream(request, loop, self.metrics) for request in requests]
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._jobs) + len(self._calls) + len(streams) > self.queue_size:
                raise QueueFull(
                    f"the request queue is full ({self.queue_size} waiting); retry later",
                    retry_after=max(1, len(self._jobs)),
                )
            self._jobs.extend(_Job(stream) for stream in streams)
            self._cond.notify()
        return streams

    async def call(self, fn: Callable[..., _R], *args: Any) -> _R:
        """``fn(*args)`` on the inference worker, between generation steps, through the
        bounded queue (QueueFull, ShuttingDown): work that uses the model but is not a
        generation (embeddings)."""
        call = _Call(fn, args)
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._jobs) + len(self._calls) + 1 > self.queue_size:
                raise QueueFull(
                    f"the request queue is full ({self.queue_size} waiting); retry later",
                    retry_after=max(1, self.queued),
                )
            self._calls.append(call)
            self._cond.notify()
        result: _R = await asyncio.wrap_future(call.future)
        return result

    def _run_calls(self) -> None:
        """Run the queued calls (on the worker)."""
        while True:
            with self._cond:
                if not self._calls:
                    return
                call = self._calls.popleft()
            call.run()

    # -- the worker ---------------------------------------------------------------------

    def _run(self) -> None:
        if self._batcher is not None:
            self._run_batched(self._batcher)
            return
        while True:
            self._run_calls()
            with self._cond:
                while not self._jobs and not self._calls and not self._stopping:
                    self._cond.wait()
                if self._calls:
                    continue
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._active.append(job)
            try:
                self._generate(job.stream)
            finally:
                with self._cond:
                    self._active.clear()

    def _run_batched(self, batcher: Batching) -> None:
        active = self._active
        while True:
            self._run_calls()
            with self._cond:
                while not self._jobs and not active and not self._calls and not self._stopping:
                    self._cond.wait()
                if not self._jobs and not active:
                    if self._calls:
                        continue
                    return
                joining: list[_Job] = []
                while self._jobs and len(active) + len(joining) < self.batch_size:
                    joining.append(self._jobs.popleft())
                active.extend(joining)
            for job in joining:
                self._begin(job, batcher)
            running = [job for job in active if job.generation is not None]
            if running:
                try:
                    batcher.step([job.generation for job in running])
                except Exception as exc:  # a backend bug: fail the batch, keep the worker
                    log.exception("step_failed")
                    for job in running:
                        gen = job.generation
                        if gen is not None and gen.finish is None:
                            job.stream.emit(
                                ErrorEvent(f"generation failed: {exc}", 500, "server_error")
                            )
                            gen.finish = Finish("error", Usage())
                for job in running:
                    assert job.sink is not None
                    job.sink.step_done()
            ended = [
                job for job in active if job.generation is None or job.generation.finish is not None
            ]
            for job in ended:
                if job.generation is not None:
                    assert job.sink is not None
                    try:
                        finish = job.sink.close(job.generation.finish)
                    except Exception as exc:
                        finish = self._failed(job.stream, exc)
                    self._end(job.stream, finish)
            if ended:
                with self._cond:
                    active[:] = [job for job in active if job not in ended]

    def _begin(self, job: _Job, batcher: Batching) -> None:
        """Start a job in the running batch; one that cannot start ends here."""
        stream = job.stream
        if stream.cancelled:
            self._skip(stream)
            return
        stream.timing.started = time.perf_counter()
        job.sink = self._sink(stream, per_step=True)
        try:
            job.generation = batcher.begin(stream.request, job.sink)
        except Exception as exc:
            self._end(stream, self._failed(stream, exc))

    def _sink(self, stream: RequestStream, *, per_step: bool = False) -> ReplySink:
        """The sink a backend generates ``stream``'s reply into: the stream behind the
        bounds core applies to every backend (``lmserve_core.contract``)."""
        return ReplySink(stream, stream.request, per_step=per_step, count_prompt=self._count_prompt)

    def _count_prompt(self, request: NormalizedRequest) -> int:
        """The prompt's tokens, for a backend that reported none: its exact count when it
        has one, else its tokenizer's count of the prompt's text."""
        try:
            if isinstance(self.backend, CountsTokens):
                return int(self.backend.count_tokens(request))
            text = request.prompt
            if text is None:
                text = "\n".join(m.content for m in request.messages)
            return len(self.backend.tokenize(text))
        except Exception:  # a count is a courtesy: the reply is served either way
            log.warning("prompt_count_failed", id=request.id, exc_info=True)
            return 0

    def _skip(self, stream: RequestStream) -> None:
        """End a job cancelled before it started."""
        stream.finish = Finish("cancelled", Usage())
        if not self._accepting:
            stream.emit(ErrorEvent("the server is shutting down", 503, "overloaded_error"))
        stream._close()
        self._log(stream, 499)

    def _generate(self, stream: RequestStream) -> None:
        if stream.cancelled:
            self._skip(stream)
            return
        stream.timing.started = time.perf_counter()
        sink = self._sink(stream)
        try:
            finish = sink.close(self.backend.generate(stream.request, sink))
        except Exception as exc:  # never let one request take the worker down
            finish = self._failed(stream, exc)
        self._end(stream, finish)

    @staticmethod
    def _failed(stream: RequestStream, exc: Exception) -> Finish:
        """Send the error a backend raised for a job; its finish."""
        if isinstance(exc, LmserveError):
            stream.emit(ErrorEvent(exc.message, exc.status, exc.kind))
        else:
            log.exception("generate_failed", id=stream.request.id)
            stream.emit(ErrorEvent(f"generation failed: {exc}", 500, "server_error"))
        return Finish("error", Usage())

    def _end(self, stream: RequestStream, finish: Finish) -> None:
        """Send a job's finish, close its stream and log it."""
        if finish.reason == "cancelled" and not self._accepting:
            stream.emit(ErrorEvent("the server is shutting down", 503, "overloaded_error"))
        stream.finish = finish
        stream.timing.finished = time.perf_counter()
        stream.emit(finish)
        stream._close()
        status = {"error": stream.error_status or 500, "cancelled": 499}.get(finish.reason, 200)
        self._log(stream, status)

    def _log(self, stream: RequestStream, status: int) -> None:
        t = stream.timing
        finish = stream.finish or Finish("error")
        usage = finish.usage or Usage()
        ttft = (t.first_token - t.submitted) if t.first_token else None
        self.metrics.request(stream.request.dialect, status)
        self.metrics.usage(usage, ttft)
        gen_time = (t.finished - t.first_token) if (t.finished and t.first_token) else None
        tps = (
            (usage.completion_tokens - 1) / gen_time
            if gen_time and usage.completion_tokens > 1
            else None
        )
        log.info(
            "request",
            id=stream.request.id,
            dialect=stream.request.dialect,
            status=status,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            ttft_s=round(ttft, 4) if ttft is not None else None,
            tok_per_s=round(tps, 2) if tps is not None else None,
            finish_reason=finish.reason,
        )
