"""`AsyncLLM`: one `LLMEngine` driven by a dedicated thread, consumed from asyncio.

The engine is not thread-safe, so only its thread touches it. New requests and aborts are queued
under one condition lock and applied between steps, so an abort frees the request's KV blocks
before the next step runs. A step's outputs reach the event loop in one
`loop.call_soon_threadsafe` call; the event loop never waits on the engine. Outputs are
cumulative, so a consumer that falls behind gets only the newest one (one chunk for the tokens
of several steps), never a backlog.

Admission: when the engine is idle and a request arrives, requests of the same burst usually
follow within a few milliseconds (concurrent clients; up to ~10 ms apart here, while they open
connections). Stepping at once would run the first one's prefill alone and make the rest wait for
that whole step (~0.4 s for 128 tokens on a 2-core CPU), so the engine first waits until no request
has arrived for `admission_gap` seconds (at most `admission_max_wait` in all): a lone request pays
the gap once; a busy engine never waits (arrivals join at the next step boundary). On a GPU a
prefill of a few hundred tokens takes milliseconds, less than the wait would, so there the default
gap is 0 (no wait).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.errors import PocketLLMError, RequestError, RequestFailedError
from pocketllm.outputs import RequestOutput
from pocketllm.sampling_params import SamplingParams

log = logging.getLogger("pocketllm")


class EngineUnavailableError(PocketLLMError):
    """The request cannot be served now; the same request may succeed later (HTTP 503)."""

    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class QueueFullError(EngineUnavailableError):
    """Too many requests are already waiting for the engine."""

    def __init__(self, max_queued: int, retry_after: int = 1):
        super().__init__(f"The server is overloaded: its queue of {max_queued} waiting requests is full. "
                         "Please retry later.", retry_after)


class QueueTimeoutError(EngineUnavailableError):
    """The request waited longer than the queue-time limit without starting."""

    def __init__(self, max_queue_time: float, retry_after: int = 5):
        super().__init__(f"The server is overloaded: the request waited {max_queue_time:g} s in the queue "
                         "without starting. Please retry later.", retry_after)


class EngineClosedError(EngineUnavailableError):
    """The engine is shutting down, or stopped after an internal error."""


@dataclass(frozen=True)
class EngineStats:
    """What the engine thread publishes after every step, for admission and metrics. Counters
    are cumulative since the engine started."""
    # vLLM's buckets of tokens per step (the metrics cut them at max_num_batched_tokens).
    ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    # Steps by the tokens they computed: one count per bucket of ITERATION_TOKEN_BUCKETS (a step
    # of n tokens counts in the first bucket >= n), then one for larger steps; and their sum.
    iteration_token_counts: tuple[int, ...] = (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
    iteration_tokens_sum: int = 0
    spec: object = None  # the engine's SpecDecodingStats (a copy), when it speculates
    # The engine's `last_step` already counted: a step is counted once however often stats are published.
    last_step: object = None


def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """On the event loop: hand one step's outputs to their streams."""
    for stream, item in items:
        stream._push(item)


def _send(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """From the engine thread: one wake-up of the event loop per step, whatever the batch size."""
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


class RequestStream:
    """The outputs of one request, in order; since they are cumulative, only the newest one waits
    to be read. `close()` aborts the request if it has not finished."""

    def __init__(self, owner: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._item: RequestOutput | BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        _send(self._loop, [(self, item)])

    def _push(self, item: RequestOutput | BaseException) -> None:
        if not isinstance(self._item, BaseException):  # an error is final; a newer output replaces an older one
            self._item = item
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._item is None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self._item = self._item, None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncLLM:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_queued_requests: int | None = None,
                 admission_gap: float | None = None, admission_max_wait: float = 0.04,
                 max_queue_time: float | None = None, on_fatal: Callable[[BaseException], None] | None = None):
        """`engine` may be a function that builds it: it then runs on the engine thread, so that
        all torch work happens on that one thread. (Steps ran ~1.6x slower on a 2-core machine when
        the engine thread computed next to the idle OpenMP team of the thread that loaded it.)
        Returns once the engine is built; its error, if any, is raised here. `admission_gap`:
        None is 15 ms on CPU and 0 on CUDA (see the module docs). A request that waits more than
        `max_queue_time` seconds without starting fails with QueueTimeoutError. `on_fatal` is
        called (on the engine thread) when the engine dies of an error it cannot recover from."""
        build = None if isinstance(engine, LLMEngine) else engine
        self.engine = None if build else engine
        self.max_queued_requests = max_queued_requests
        self.max_queue_time = max_queue_time
        self.on_fatal = on_fatal
        self.admission_gap, self.admission_max_wait = admission_gap, admission_max_wait
        self.stats = EngineStats()
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._adds: list[tuple[RequestStream, object, SamplingParams, float, object]] = []  # ..., grammar
        # Sequences (a request's n choices each) added and not yet in the published waiting count.
        self._num_adding = 0
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}  # requests added and not finished or aborted
        self._accepting = True
        self._stopping = False
        self._fatal_reported = False
        built = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(build, built), name="pocketllm-engine",
                                        daemon=True)
        self._thread.start()
        built.wait()
        if self.error is not None:
            raise self.error

    @property
    def is_running(self) -> bool:
        return self._accepting and self.error is None and self._thread.is_alive()

    # -- the event-loop side ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | list[int], params: SamplingParams,
                    arrival_time: float | None = None, grammar=None, lora: str | None = None) -> RequestStream:
        """Queue a request for the engine. Raises at once if it cannot be admitted. `grammar`: its
        `structured_outputs` compiled already, so that the engine thread does not compile it. `lora`:
        the name of its LoRA adapter."""
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        with self._cond:
            if not self.is_running:
                raise EngineClosedError("the engine is not accepting requests (shutting down or failed)")
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use")
            # The queue holds sequences: a request of n choices takes n places (what it costs).
            if (self.max_queued_requests is not None
                    and self._num_adding + self.stats.num_waiting + params.n > self.max_queued_requests):
                raise QueueFullError(self.max_queued_requests)
            self._num_adding += params.n
            self._streams[request_id] = stream
            self._adds.append((stream, prompt, params, time.monotonic() if arrival_time is None else arrival_time,
                               grammar, lora))
            self._cond.notify()
        return stream

    async def generate(self, prompt: str | dict | list[int], params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; leaving the loop early aborts it."""
        stream = self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:  # GeneratorExit, CancelledError or an error in the consumer
            stream.close()

    def abort(self, request_id: str) -> None:
        with self._cond:
            if self._streams.pop(request_id, None) is not None:
                self._aborts.append(request_id)
                self._cond.notify()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish for up to `timeout` seconds, abort the rest
        (their consumers get EngineClosedError). Calling it again waits for the same end."""
        with self._cond:
            self._accepting = False
        deadline = time.monotonic() + timeout
        while self._busy() and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.05)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(self._join_engine_thread)
        if self.engine is not None:
            self.engine.shutdown()  # the other tensor-parallel ranks, once no step runs

    FAILED_THREAD_GRACE = 5.0  # seconds a failed engine's thread gets to end (it may be stuck in a collective)

    def _join_engine_thread(self) -> None:
        while self._thread.is_alive() and self.error is None:
            self._thread.join(0.25)
        self._thread.join(self.FAILED_THREAD_GRACE)

    def _busy(self) -> bool:
        return self.num_in_flight > 0

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished or aborted."""
        with self._cond:
            return len(self._streams)

    # -- the engine thread ----------------------------------------------------------------------
    def _main(self, build: Callable[[], LLMEngine] | None, built: threading.Event) -> None:
        try:
            if build is not None:
                self.engine = build()
            if self.admission_gap is None:
                self.admission_gap = 0.0 if self.engine.device.type == "cuda" else 0.015
            self.engine.on_ranks_lost(self._engine_lost)
        except BaseException as e:  # noqa: BLE001  (handed to the constructor's caller)
            self.error = e
            return
        finally:
            built.set()
        self._run()

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._adds or self._aborts or self._stopping or engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    if self._adds and not engine.has_unfinished_requests():
                        self._wait_for_burst()
                        if self._stopping:
                            break
                    adds, aborts = self._adds, self._aborts
                    self._adds, self._aborts = [], []
                # Outside the lock: building a request's sequences (n of them, each with its
                # detokenizer and grammar matcher) must not hold up the event loop's adds and aborts.
                self._apply(adds, aborts)
                with self._cond:
                    self._num_adding -= sum(add[2].n for add in adds)  # (stream, prompt, params, ...): now waiting
                    if self.max_queue_time is not None:
                        self._expire_waiting()
                    self._publish()
                outs = engine.step()
                if not outs and engine.last_step.num_seqs == 0:
                    with self._cond:  # nothing could be scheduled: wait for a change, not spin
                        self._cond.wait(0.01)
                with self._cond:
                    self._publish()
                    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
                    for o in outs:
                        stream = self._streams.get(o.request_id)
                        if stream is not None:
                            item = o if o.error is None else RequestFailedError(
                                "The server had an error while processing your request; it was aborted "
                                "(other requests are unaffected).")
                            by_loop.setdefault(stream._loop, []).append((stream, item))
                            if o.finished:
                                del self._streams[o.request_id]
                for loop, items in by_loop.items():
                    _send(loop, items)
        except Exception as e:  # noqa: BLE001  (EngineDeadError, or a bug outside the step)
            log.exception("the engine failed; no more requests will be served")
            with self._cond:
                self.error = self.error or e  # a lost rank's watchdog may have told first
        self._close_all()
        self._report_fatal()

    def _engine_lost(self, error: BaseException) -> None:
        """From the tensor-parallel watchdog, when a rank ends: the engine thread may be blocked in
        a collective for good, so its requests are failed and `on_fatal` told from here."""
        log.error("the engine failed; no more requests will be served: %s", error)
        with self._cond:
            self.error = self.error or error
            self._stopping = True
            self._cond.notify()
        self._close_all()
        self._report_fatal()

    def _report_fatal(self) -> None:
        """`on_fatal`, once: the engine thread and the watchdog may both see the engine die."""
        with self._cond:
            if self.error is None or self._fatal_reported:
                return
            self._fatal_reported = True
        if self.on_fatal is not None:
            self.on_fatal(self.error)

    def _expire_waiting(self) -> None:
        """Called with the lock held: fail the requests that waited too long without starting."""
        for request_id in self.engine.stale_requests(self.max_queue_time, time.monotonic()):
            self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(QueueTimeoutError(self.max_queue_time))

    def _wait_for_burst(self) -> None:
        """Called with the lock held on an idle engine: let the rest of a burst of requests arrive."""
        start = last = time.monotonic()
        seen = len(self._adds)
        while not self._stopping:
            left = min(last + self.admission_gap, start + self.admission_max_wait) - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)
            if len(self._adds) != seen:
                seen, last = len(self._adds), time.monotonic()

    def _apply(self, adds, aborts) -> None:
        """On the engine thread, without the lock (only this thread touches the engine)."""
        for stream, prompt, params, arrival, grammar, lora in adds:
            if stream.finished:
                continue  # aborted before it reached the engine (its abort is in `aborts`: a no-op)
            try:
                self.engine.add_request(stream.request_id, prompt, params, arrival, grammar=grammar, lora_request=lora)
            except Exception as e:  # a bad request fails alone; the engine goes on
                with self._cond:
                    self._streams.pop(stream.request_id, None)
                stream.put(e)
        for request_id in aborts:
            self.engine.abort_request(request_id)

    def _publish(self) -> None:
        kv, sched, step, prev = self.engine.kv, self.engine.scheduler, self.engine.last_step, self.stats
        counts, tokens = prev.iteration_token_counts, prev.iteration_tokens_sum
        if step is not prev.last_step and step.num_tokens > 0:  # a step ran since the last publication
            bounds = EngineStats.ITERATION_TOKEN_BUCKETS
            i = next((i for i, b in enumerate(bounds) if step.num_tokens <= b), len(bounds))
            counts = counts[:i] + (counts[i] + 1,) + counts[i + 1:]
            tokens += step.num_tokens
        spec = self.engine.speculator
        self.stats = EngineStats(len(sched.running), len(sched.waiting), kv.usage,
                                 kv.num_queried_tokens, kv.num_hit_tokens, sched.num_preemptions,
                                 counts, tokens, spec.stats.copy() if spec else None, step)

    def _close_all(self) -> None:
        """Abort whatever is left and tell its consumers; the engine thread ends after this."""
        with self._cond:
            self._accepting = False
            streams = list(self._streams.values())  # queued adds are in here too
            self._streams.clear()
            self._adds.clear()
            self._num_adding = 0
            if self.error is None:
                for s in streams:
                    self.engine.abort_request(s.request_id)
                self._publish()
        reason = "the server is shutting down" if self.error is None else "the engine failed"
        for s in streams:
            s.put(EngineClosedError(f"{reason}; the request was aborted"))
