"""The server's queue and worker (difflet_tpu.serve.engine) with a recording fake backend, and
the batched pipeline call (difflet_tpu.serve.backend) against the same requests alone."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from difflet_tpu.serve.engine import Dropped, Engine, NotAccepting, QueueFull, Work

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"


class Fake:
    """Records each call's requests; `gate` holds the worker inside a call until set."""

    kind = "image"

    def __init__(self):
        self.calls = []
        self.gate = threading.Event()
        self.gate.set()

    def key(self, w):
        return w.params["size"]

    def run(self, batch):
        self.gate.wait(timeout=30)
        self.calls.append([w.params["i"] for w in batch])
        if any(w.params.get("bad") for w in batch):
            raise FloatingPointError("non-finite")
        return [w.params["i"] * 10 for w in batch]


def work(i, size=32, **kw):
    return Work("image", dict(i=i, size=size, **kw))


def test_compatible_requests_share_a_call_in_order_up_to_max_batch():
    fake = Fake()
    fake.gate.clear()
    e = Engine(fake, max_batch=3, queue_size=10)
    first = e.submit(work(0))
    e.start()
    while e.depth():  # the worker holds the first request
        time.sleep(0.01)
    ws = [e.submit(work(i, size=64 if i % 2 else 32)) for i in range(1, 8)]
    fake.gate.set()
    assert [w.future.result(timeout=30) for w in [first, *ws]] == [i * 10 for i in range(8)]
    assert fake.calls == [[0], [1, 3, 5], [2, 4, 6], [7]]
    assert e.drain(timeout=30)


def test_a_batch_holds_at_most_max_batch_rows():
    fake = Fake()
    fake.gate.clear()
    e = Engine(fake, max_batch=4, queue_size=10)
    ws = [e.submit(work(i, n=n)) for i, n in enumerate([2, 3, 1, 1, 6])]
    e.start()
    fake.gate.set()
    assert [w.future.result(timeout=30) for w in ws] == [0, 10, 20, 30, 40]
    assert fake.calls == [[0, 2, 3], [1], [4]]
    assert e.drain(timeout=30)


def test_queue_full_and_not_accepting():
    fake = Fake()
    e = Engine(fake, max_batch=1, queue_size=2)  # not started: nothing leaves the queue
    e.submit(work(0))
    e.submit(work(1))
    with pytest.raises(QueueFull) as err:
        e.submit(work(2))
    assert err.value.retry_after >= 1
    e.stop_accepting()
    with pytest.raises(NotAccepting):
        e.submit(work(3))


def test_a_failing_batch_is_rerun_one_by_one_and_only_the_bad_request_fails():
    fake = Fake()
    fake.gate.clear()
    e = Engine(fake, max_batch=4, queue_size=10)
    ws = [e.submit(work(i, bad=i == 1)) for i in range(3)]
    e.start()
    fake.gate.set()
    assert ws[0].future.result(timeout=30) == 0 and ws[2].future.result(timeout=30) == 20
    with pytest.raises(FloatingPointError):
        ws[1].future.result(timeout=30)
    assert fake.calls == [[0, 1, 2], [0], [1], [2]]
    assert e.drain(timeout=30)


def test_a_cancelled_request_is_dropped_before_it_runs_and_drain_answers_everything():
    fake = Fake()
    e = Engine(fake, max_batch=1, queue_size=10)
    ws = [e.submit(work(i)) for i in range(4)]
    ws[2].cancelled = True
    e.start()
    assert e.drain(timeout=30)
    assert [w.future.done() for w in ws] == [True] * 4
    with pytest.raises(Dropped):
        ws[2].future.result()
    assert fake.calls == [[0], [1], [3]]


# ---- the batched pipeline call equals the requests alone ------------------------------------------


@pytest.mark.parametrize("name", ["flux_schnell", "qwen_image", pytest.param("wan_t2v", marks=pytest.mark.slow)])
def test_batched_call_equals_each_request_alone(name):
    """Three requests (one with two images; prompts of different lengths; their own seeds) in one
    call of batch 4 vs each alone: float32 outputs within 1e-5 (measured: 1.1e-6 for Qwen-Image,
    7.6e-6 for Wan), and within 1e-5 of the pipeline's own seeded call (1.9e-6 measured for
    FLUX: two prompts vs one prompt twice)."""
    import jax.numpy as jnp

    from difflet_tpu.pipeline import diffusion as D
    from difflet_tpu.serve.backend import PipelineBackend

    pipe = D.DiffusionPipeline.from_pretrained(FIXTURES / name, dtype=jnp.float32)
    b = PipelineBackend(pipe, max_batch=4)
    base = dict(height=32, width=32, num_inference_steps=2)
    if b.kind == "video":
        base["num_frames"] = 5
    ps = [dict(base, prompt="a cat", seed=1), dict(base, prompt="a red dog running far away", seed=2),
          dict(base, prompt="x", seed=3)]
    if b.kind == "image":
        ps[1]["n"] = 2
        batched, alone = b._images(ps, 4), [b._images([p], p.get("n", 1)) for p in ps]
        own = pipe(prompt="a red dog running far away", seed=2, num_images_per_prompt=2, output_type="np",
                   **base).images
    else:
        batched, alone = b._videos(ps, 4), [b._videos([p], 1) for p in ps]
        own = pipe(prompt="a red dog running far away", seed=2, output_type="np", **base).frames
    alone = np.concatenate([np.asarray(a) for a in alone])
    batched = np.asarray(batched)[:len(alone)]
    assert np.abs(batched - alone).max() <= 1e-5
    np.testing.assert_allclose(alone[1:1 + len(own)], np.asarray(own), rtol=0, atol=1e-5)
    # the rows differ (their own seeds and prompts), so equality above is not trivial
    assert np.abs(alone[0] - alone[1]).max() > 0.01
