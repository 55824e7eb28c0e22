"""The text encoders in host memory between prompts (Config.encoder_offload), on CPU devices
(jax's CPU client has the pinned_host memory kind): the images are bit-identical to the
encoders staying on the devices, the encoders' device arrays are freed after the encode, they
come back for the next prompt without recompiling, "auto" follows the memory limit, and "on"
without host memory is refused at load."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from difflet_tpu import runtime
from difflet_tpu.config import Config
from difflet_tpu.pipeline import placement
from difflet_tpu.pipeline.diffusion import DiffusionPipeline, PipelineError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
FAST = {"xla_backend_optimization_level": 0}
KW = dict(prompt="a small robot holding a sign", height=32, width=32, num_inference_steps=2, output_type="np",
          seed=3)


def load(setting, name="flux_schnell"):
    return DiffusionPipeline.from_pretrained(FIXTURES / name, dtype=jnp.float32, config=Config(encoder_offload=setting),
                                             runner_options=dict(compiler_options=FAST))


def encoder_leaves(pipe):
    return [x for m in pipe.encoder_home.encoders for x in jax.tree.leaves(nnx.state(m, nnx.Param))]


@pytest.mark.parametrize("name,kw", [("flux_schnell", {}),
                                     ("qwen_image", dict(negative_prompt="blurry", true_cfg_scale=4.0))])
def test_offloaded_encoders_give_identical_images_and_free_device_memory(name, kw):
    want = load("off", name)(**KW, **kw).images
    pipe = load("on", name)
    device = [weakref.ref(x) for x in encoder_leaves(pipe)]
    assert {x.sharding.memory_kind for x in encoder_leaves(pipe)} == {"device"}
    first = pipe(**KW, **kw).images
    assert pipe.encoder_offload and pipe.encoder_offload_reason == "on"
    assert pipe.encoder_home.memory_kinds() == {runtime.HOST_MEMORY_KIND}
    gc.collect()
    assert sum(r() is not None for r in device) == 0, "an offloaded encoder's device array is still alive"
    second = pipe(**KW, **kw).images  # loads them back for the encode, offloads again
    assert pipe.encoder_home.memory_kinds() == {runtime.HOST_MEMORY_KIND}
    assert pipe.timings.encoder_moves > 0
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(second, want)


def test_auto_follows_the_memory_limit(monkeypatch, decided_peaks):
    pipe = load("auto")
    pipe(**KW)  # CPU: no memory limit, nothing moves
    assert pipe.encoder_offload is False and "no device memory limit" in pipe.encoder_offload_reason
    assert pipe.encoder_home.memory_kinds() == {"device"}

    need = decided_peaks
    for limit, offloaded in (("huge", False), ("small", True)):
        pipe = load("auto")
        monkeypatch.setattr(runtime, "device_memory_limit",
                            lambda devices, limit=limit: 2**40 if limit == "huge" else 1024)
        pipe(**KW)
        assert pipe.encoder_offload is offloaded, pipe.encoder_offload_reason
        want_kinds = {runtime.HOST_MEMORY_KIND} if offloaded else {"device"}
        assert pipe.encoder_home.memory_kinds() == want_kinds
    # the denoise stage's peak: the compiled step + the encoders' and the VAE's parameters
    enc = pipe.encoder_home.bytes_per_chip()
    assert need[placement.DENOISE] > enc + placement.bytes_per_chip(pipe.vae) > 0


def test_on_without_host_memory_is_refused_at_load(monkeypatch):
    monkeypatch.setattr(runtime, "host_memory_kind", lambda devices: None)
    with pytest.raises(PipelineError, match="encoder_offload='on'.*no pinned_host memory"):
        load("on")
