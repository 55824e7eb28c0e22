"""The transformer staged through host memory while the text encoders run
(Config.transformer_offload), on CPU devices (jax's CPU client has the pinned_host memory kind):
LTX-2's frames and audio equal diffusers' (the fixture's) and the unstaged call's bit for bit;
during the encode every transformer parameter is in host memory and after it on the devices
again; the encoders then leave ("auto" encoder offload follows); a call that fails mid-encode
leaves nothing behind; "auto" follows the memory limit on the parameters' arithmetic; a
two-expert pipeline stages the experts on the devices."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu import runtime
from difflet_tpu.config import Config
from difflet_tpu.pipeline import placement
from difflet_tpu.pipeline.diffusion import DiffusionPipeline, PipelineError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
FAST = {"xla_backend_optimization_level": 0}


def load(name, setting):
    return DiffusionPipeline.from_pretrained(FIXTURES / name, dtype=jnp.float32,
                                             config=Config(transformer_offload=setting),
                                             runner_options=dict(compiler_options=FAST))


def ltx2_kwargs():
    folder = FIXTURES / "ltx2"
    calls, z = json.loads((folder / "calls.json").read_text()), np.load(folder / "io.npz")
    return {**calls[0], "latents": z["in.latents"], "audio_latents": z["in.audio_latents"], "output_type": "np"}, z


def kinds(runner):
    return {x.sharding.memory_kind for x in jax.tree.leaves(runner._state)}


def watch_encode(pipe, seen):
    """Records where the transformer's parameters are each time a prompt is encoded."""
    encode = pipe.encode_prompt

    def spy(*args, **kw):
        seen.append(set().union(*(kinds(r) for r in getattr(pipe, "experts", [pipe.transformer]))))
        return encode(*args, **kw)

    pipe.encode_prompt = spy


@functools.lru_cache(maxsize=None)
def staged_ltx2():
    """One LTX-2 pipeline for these tests (each load compiles anew); the tests that change its
    decisions put them back (monkeypatch)."""
    return load("ltx2", "on")


def test_ltx2_staged_transformer_gives_identical_frames_and_audio(monkeypatch):
    kw, z = ltx2_kwargs()
    pipe = staged_ltx2()
    seen = []
    monkeypatch.setattr(pipe, "encode_prompt", pipe.encode_prompt)
    watch_encode(pipe, seen)
    outs = [pipe(**kw) for _ in range(2)]  # the second call drops the device arrays again (host copy kept)
    assert seen and all(s == {runtime.HOST_MEMORY_KIND} for s in seen), seen
    assert kinds(pipe.transformer) == {"device"} and pipe.transformer.resident == "device"
    assert pipe.transformer_offload and pipe.transformer_offload_reason == "on"
    assert pipe.timings.transformer_moves > 0 and pipe.timings.as_dict()["transformer_moves_s"] > 0
    # "auto" encoder offload: they did not fit beside the transformer, so they leave after the encode
    assert pipe.encoder_offload and "staged" in pipe.encoder_offload_reason
    assert pipe.encoder_home.memory_kinds() == {runtime.HOST_MEMORY_KIND}
    # the same pipeline with the transformer left on the devices: the same programs, bit-identical
    monkeypatch.setattr(pipe, "transformer_offload", False)
    seen.clear()
    want = pipe(**kw)
    assert seen and all(s == {"device"} for s in seen) and pipe.timings.transformer_moves == 0
    for out in outs:
        np.testing.assert_array_equal(out.frames, want.frames)
        np.testing.assert_array_equal(out.audio, want.audio)
    # and that is diffusers' output (the fixture's)
    assert float(np.abs(np.asarray(want.frames) - z["c0.out.frames"]).max()) <= 1e-3


def test_a_failed_encode_leaves_the_transformer_to_the_next_call(monkeypatch):
    kw, z = ltx2_kwargs()
    pipe = staged_ltx2()

    def broken(*args, **kwargs):
        raise FloatingPointError("a non-finite prompt embedding (injected)")

    encode = pipe.encode_prompt
    monkeypatch.setattr(pipe, "encode_prompt", broken)
    with pytest.raises(FloatingPointError, match="injected"):
        pipe(**kw)
    assert pipe.transformer.resident == "host"  # staged when the encode failed
    monkeypatch.setattr(pipe, "encode_prompt", encode)
    out = pipe(**kw)
    assert pipe.transformer.resident == "device"
    assert float(np.abs(np.asarray(out.frames) - z["c0.out.frames"]).max()) <= 1e-3


def test_auto_follows_the_memory_limit(monkeypatch):
    kw, _ = ltx2_kwargs()
    pipe = staged_ltx2()
    monkeypatch.setattr(pipe, "transformer_offload_setting", "auto")
    monkeypatch.setattr(pipe, "encode_prompt", pipe.encode_prompt)
    need = {}
    real = placement.decide

    def spy(setting, peaks, *a):
        need.update(peaks)
        return real(setting, peaks, *a)

    monkeypatch.setattr(placement, "decide", spy)
    for limit, staged in ((None, False), (2**40, False), (1024, True)):
        monkeypatch.setattr(runtime, "device_memory_limit", lambda devices, limit=limit: limit)
        monkeypatch.setattr(pipe, "transformer_offload", None)  # decided again at this call
        seen = []
        watch_encode(pipe, seen)
        pipe(**kw)
        assert pipe.transformer_offload is staged, pipe.transformer_offload_reason
        assert seen[0] == ({runtime.HOST_MEMORY_KIND} if staged else {"device"})
        if limit is None:  # CPU: no memory limit, nothing is staged
            assert "no device memory limit" in pipe.transformer_offload_reason
    # the encode's peak: every part's parameters (encoders, transformer, video + audio VAEs, vocoder)
    # plus the margin for the encode's activations
    enc, tr = pipe.encoder_home.bytes_per_chip(), pipe.transformer.param_bytes()
    vaes = sum(placement.bytes_per_chip(m) for m in (pipe.vae, pipe.audio_vae, pipe.vocoder))
    assert pipe.stage_parts_bytes() == enc + tr + vaes and min(enc, tr, vaes) > 0
    assert need[placement.ENCODE] == enc + tr + vaes + placement.ENCODE_MARGIN


def test_two_experts_stage_those_on_the_devices():
    """Wan2.2 A14B: both experts leave for the encode and come back (the expert home then keeps
    the idle one where its own setting says)."""
    folder = FIXTURES / "wan22_a14b"
    call = next(iter(json.loads((folder / "calls.json").read_text())["calls"].values()))
    z = np.load(folder / "io.npz")
    kw = dict(call["kwargs"], output_type="np")
    kw["latents"] = z[f"{next(iter(json.loads((folder / 'calls.json').read_text())['calls']))}.latents"]
    want = load("wan22_a14b", "off")(**kw).frames
    pipe = load("wan22_a14b", "on")
    seen = []
    watch_encode(pipe, seen)
    got = pipe(**kw).frames
    assert len(pipe.experts) == 2 and seen and all(s == {runtime.HOST_MEMORY_KIND} for s in seen), seen
    assert all(r.resident == "device" for r in pipe.experts)  # expert offload "auto": nothing moves on CPU
    np.testing.assert_array_equal(got, want)


def test_on_without_host_memory_is_refused_at_load(monkeypatch):
    monkeypatch.setattr(runtime, "host_memory_kind", lambda devices: None)
    with pytest.raises(PipelineError, match="transformer_offload='on'.*no pinned_host memory"):
        load("ltx2", "on")
