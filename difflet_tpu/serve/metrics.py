"""The server's Prometheus metrics (prometheus-client), in a registry of their own.

- difflet_queue_depth: requests accepted and not yet started;
- difflet_requests_total{kind, outcome}: answered requests by outcome (ok, error, dropped: the
  client went away first), and refused ones (rejected: 429 queue full, invalid: 422, unavailable:
  503 while shutting down);
- difflet_request_seconds{kind, outcome}: from acceptance to the answer;
- difflet_pipeline_calls_total{kind}, difflet_batch_requests: calls made and requests per call;
- difflet_stage_seconds{stage} (tokenize, encode, denoise, decode), difflet_step_seconds;
- difflet_compiles: XLA compiles since the process started (persistent-cache loads included), and
  difflet_compiles_after_ready: those made while serving (shapes not warmed up);
- difflet_ready: 1 once the warm-up is done.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STEP_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30)
CALL_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000)


class Metrics:
    def __init__(self, compiles=None):
        """`compiles`: a function giving the compile count since the process started."""
        from difflet_tpu import runtime

        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("difflet_queue_depth", "requests accepted and not yet started", registry=r)
        self.requests = Counter("difflet_requests", "requests by outcome", ["kind", "outcome"], registry=r)
        self.latency = Histogram("difflet_request_seconds", "acceptance to answer", ["kind", "outcome"],
                                 buckets=CALL_BUCKETS, registry=r)
        self.pipeline_calls = Counter("difflet_pipeline_calls", "pipeline calls made", ["kind"], registry=r)
        self.batch_requests = Histogram("difflet_batch_requests", "requests per pipeline call",
                                        buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.stage_seconds = Histogram("difflet_stage_seconds", "seconds per stage of a pipeline call", ["stage"],
                                       buckets=CALL_BUCKETS, registry=r)
        self.step_seconds = Histogram("difflet_step_seconds", "seconds per denoise step", buckets=STEP_BUCKETS,
                                      registry=r)
        self.ready = Gauge("difflet_ready", "1 once the warm-up shapes are compiled", registry=r)
        count = compiles or (lambda: runtime.compile_stats()["compiles"])
        self._count = count
        self._at_ready = None
        Gauge("difflet_compiles", "XLA compiles since start (cache loads included)",
              registry=r).set_function(lambda: count())
        Gauge("difflet_compiles_after_ready", "compiles while serving (shapes not warmed up)",
              registry=r).set_function(lambda: 0 if self._at_ready is None else count() - self._at_ready)

    def compiles(self) -> int:
        return self._count()

    def set_ready(self) -> None:
        self._at_ready = self._count()
        self.ready.set(1)
