"""The server's queue and its one worker: requests in, batched pipeline calls out.

`Engine(backend, max_batch, queue_size)` holds a bounded FIFO of `Work` items (`submit` raises
`QueueFull` when it is full, `NotAccepting` after `stop_accepting`). One worker thread owns the
devices: it takes the oldest item, adds the later items with the same `backend.key` (same
pipeline shape and schedule: size, frames, steps, guidance) while their rows (an image request's
`n`) fit in `max_batch` (a request larger than that runs alone), drops the
items whose client went away, and hands the batch to `backend.run`. A batch that fails is run
again one request at a time, so only the request that fails (a non-finite image, say) gets the
error. Every item's `future` gets exactly one result or exception.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The queue holds `queue_size` requests; `retry_after` is a guess in seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class NotAccepting(RuntimeError):
    """The server is shutting down (SIGTERM) and takes no new work."""


class Dropped(RuntimeError):
    """The client went away before its request ran; nothing was computed for it."""


@dataclasses.dataclass(eq=False)
class Work:
    """One accepted request: `kind` ("image" / "video"), its checked `params`, its future."""

    kind: str
    params: dict
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    cancelled: bool = False  # the client went away (set by the HTTP handler)
    accepted_at: float = dataclasses.field(default_factory=time.monotonic)
    on_start: Any = None  # called when the work starts (video jobs: status in_progress)
    on_progress: Any = None  # called with the fraction of denoise steps done (video jobs)
    id: int = dataclasses.field(default_factory=itertools.count().__next__)


def _rows(w: Work) -> int:
    """The batch rows a request takes: its `n` images (one video)."""
    return int(w.params.get("n", 1))


class Engine:
    def __init__(self, backend, *, max_batch: int = 1, queue_size: int = 64, metrics=None):
        if max_batch < 1 or queue_size < 1:
            raise ValueError(f"max_batch ({max_batch}) and queue_size ({queue_size}) must be >= 1")
        self.backend = backend
        self.max_batch = max_batch
        self.queue_size = queue_size
        self.metrics = metrics
        self._queue: list[Work] = []
        self._cond = threading.Condition()
        self._accepting = True
        self._busy = False
        self._stop = False
        self._call_seconds = 1.0  # the last pipeline call's duration, for Retry-After
        self.calls = 0  # pipeline calls made (batches and their one-request re-runs)
        self._thread = threading.Thread(target=self._loop, name="difflet-serve-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ---- the HTTP side -----------------------------------------------------------

    def submit(self, work: Work) -> Work:
        with self._cond:
            if not self._accepting:
                raise NotAccepting("the server is shutting down")
            if len(self._queue) >= self.queue_size:
                batches = -(-len(self._queue) // self.max_batch)
                raise QueueFull(max(1, round(batches * self._call_seconds)))
            self._queue.append(work)
            self._gauge()
            self._cond.notify_all()
        return work

    def depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def drain(self, timeout: float | None = None) -> bool:
        """Waits until every accepted item is answered (the queue empty and the worker idle),
        then stops the worker; False if `timeout` passed first."""
        self.stop_accepting()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=0.1 if left is None else min(left, 0.1))
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        return True

    # ---- the worker ----------------------------------------------------------------

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))

    def _take(self) -> list[Work] | None:
        """The next batch: the oldest item and the later ones with its key (cancelled items are
        answered `Dropped` and skipped); None when stopping."""
        with self._cond:
            while True:
                while not self._queue and not self._stop:
                    self._cond.wait(timeout=0.5)
                if self._stop and not self._queue:
                    return None
                for w in [w for w in self._queue if w.cancelled]:
                    self._queue.remove(w)
                    self._answer(w, exc=Dropped("the client went away before the request ran"), outcome="dropped")
                if not self._queue:
                    self._gauge()
                    continue
                first = self._queue[0]
                key = self.backend.key(first)
                batch, rows = [first], _rows(first)
                for w in self._queue[1:]:
                    if rows + _rows(w) <= self.max_batch and self.backend.key(w) == key:
                        batch.append(w)
                        rows += _rows(w)
                for w in batch:
                    self._queue.remove(w)
                self._busy = True
                self._gauge()
                return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                self._run(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _run(self, batch: list[Work]) -> None:
        for w in batch:
            if w.on_start is not None:
                w.on_start()
        try:
            results = self._call(batch)
        except Exception as e:  # noqa: BLE001 - any failure is the request's answer, not the server's end
            if len(batch) == 1:
                logger.warning("request failed: %s: %s", type(e).__name__, e)
                self._answer(batch[0], exc=e, outcome="error")
                return
            logger.warning("a batch of %d failed (%s: %s); running its requests one by one", len(batch),
                           type(e).__name__, e)
            for w in batch:
                self._run([w])
            return
        for w, r in zip(batch, results):
            self._answer(w, result=r, outcome="ok")

    def _call(self, batch: list[Work]) -> list:
        start = time.monotonic()
        self.calls += 1
        if self.metrics is not None:
            self.metrics.pipeline_calls.labels(batch[0].kind).inc()
            self.metrics.batch_requests.observe(len(batch))
        try:
            return self.backend.run(batch)
        finally:
            self._call_seconds = time.monotonic() - start

    def _answer(self, w: Work, *, result=None, exc=None, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(w.kind, outcome).inc()
            self.metrics.latency.labels(w.kind, outcome).observe(time.monotonic() - w.accepted_at)
        if w.future.done():
            return
        if exc is not None:
            w.future.set_exception(exc)
        else:
            w.future.set_result(result)
