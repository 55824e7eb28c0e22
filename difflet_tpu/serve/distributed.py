"""Multi-host serving: process 0 takes HTTP; every process runs every call.

On a slice of several hosts each process holds only its own devices' shards, so a pipeline call
must run on all of them together (difflet_tpu.parallel.distributed). Process 0's worker
publishes each call (the backend's JSON-able `{"kind", "params"}`) under a numbered key of JAX's
coordination-service key-value store before running it; the other processes wait for the next
numbered key (`follow`), run the same call, and go on waiting. A call that fails fails on every
process (the same checks, the same collectives): process 0 answers the error and every process
takes the next call. The store, not a collective, carries the calls, so an idle server holds no
collective open (gloo's bound on a collective's wait does not apply to the wait for work).
"""

from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)

PREFIX = "difflet_serve/call/"
STOP = {"stop": True}
WAIT_MS = 5_000  # one blocking get; the followers loop on it


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: multi-host serving needs it")
    return client


class Publisher:
    """Process 0's side: `publish(payload)` before running each call; `stop()` at shutdown."""

    def __init__(self):
        self.client = _client()
        self.n = 0

    def __call__(self, payload: dict) -> None:
        self.client.key_value_set(f"{PREFIX}{self.n}", json.dumps(payload))
        self.n += 1

    def stop(self) -> None:
        self(STOP)


def follow(backend) -> int:
    """The other processes' loop: run each published call in order until process 0 says stop.
    Returns the number of calls run."""
    client = _client()
    n = 0
    while True:
        try:
            raw = client.blocking_key_value_get(f"{PREFIX}{n}", WAIT_MS)
        except Exception as e:  # noqa: BLE001 - jax raises a plain error on timeout
            if "deadline" in str(e).lower() or "timed out" in str(e).lower() or "timeout" in str(e).lower():
                continue
            raise
        n += 1
        payload = json.loads(raw)
        if payload.get("stop"):
            logger.info("process 0 stopped the server after %d calls", n - 1)
            return n - 1
        try:
            backend.execute(**payload)
        except Exception as e:  # noqa: BLE001 - process 0 answers it; this process stays up
            logger.warning("call %d failed here too: %s: %s", n - 1, type(e).__name__, e)
