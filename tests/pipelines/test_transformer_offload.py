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


def load(name, setting, **config):
    return DiffusionPipeline.from_pretrained(FIXTURES / name, dtype=jnp.float32,
                                             config=Config(transformer_offload=setting, **config),
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
    decode = pipe.vae.decode_video
    at_decode = []

    def watched(*a, **k):
        at_decode.append(kinds(pipe.transformer))
        return decode(*a, **k)

    monkeypatch.setattr(pipe.vae, "decode_video", watched)
    outs = [pipe(**kw) for _ in range(2)]  # the second call drops the device arrays again (host copy kept)
    assert seen and all(s == {runtime.HOST_MEMORY_KIND} for s in seen), seen
    # "on": in host memory for the decode too, and left there until the next encode is done
    assert at_decode == [{runtime.HOST_MEMORY_KIND}] * 2 and pipe.transformer.resident == "host"
    assert pipe.transformer_offload and pipe.transformer_offload_reason == "on"
    assert pipe.timings.transformer_moves > 0 and pipe.timings.as_dict()["transformer_moves_s"] > 0
    # "auto" encoder offload: they did not fit beside the transformer, so they leave after the encode
    assert pipe.encoder_offload and "staged" in pipe.encoder_offload_reason
    assert pipe.encoder_home.memory_kinds() == {runtime.HOST_MEMORY_KIND}
    # the same pipeline with the transformer left on the devices: the same programs, bit-identical
    monkeypatch.setattr(pipe, "transformer_offload", False)
    monkeypatch.setattr(pipe, "transformer_offload_setting", "off")
    pipe.transformer.load()
    seen.clear()
    want = pipe(**kw)
    assert at_decode[-1] == {"device"}
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
    monkeypatch.setattr(pipe, "transformer_offload_setting", "off")  # so it is found on the devices after
    out = pipe(**kw)
    assert pipe.transformer.resident == "device"
    assert float(np.abs(np.asarray(out.frames) - z["c0.out.frames"]).max()) <= 1e-3


def test_auto_follows_the_memory_limit(monkeypatch, decided_peaks):
    kw, _ = ltx2_kwargs()
    pipe = staged_ltx2()
    monkeypatch.setattr(pipe, "transformer_offload_setting", "auto")
    monkeypatch.setattr(pipe, "encode_prompt", pipe.encode_prompt)
    need = decided_peaks
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


def out_of_memory_unless(pipe, monkeypatch, roomy):
    """The VAE decode raising XLA's out-of-memory error unless `roomy()` (as HunyuanVideo's
    720x1280x129 decode beside its transformer would on a v5e-4: 11.90 + 6.57 GiB per chip,
    estimate); the decode calls, with where the transformer and the encoders were at each."""
    import jax

    decode, calls = pipe.vae.decode_video, []

    def decode_video(*a, **k):
        calls.append((pipe.transformer.resident, "host" if pipe.encoder_home.offloaded else "device"))
        if not roomy():
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory "
                                             "on HBM (injected)")
        return decode(*a, **k)

    monkeypatch.setattr(pipe.vae, "decode_video", decode_video)
    return calls


def resident_auto(pipe, monkeypatch):
    for name, value in (("transformer_offload_setting", "auto"), ("transformer_offload", False), ("_room_for", {}),
                        ("encoder_offload_setting", "auto"), ("encoder_offload", False)):
        monkeypatch.setattr(pipe, name, value)
    pipe.transformer.load()
    pipe.encoder_home.load()


def test_auto_makes_room_for_a_decode_out_of_memory(monkeypatch):
    kw, z = ltx2_kwargs()
    pipe = staged_ltx2()
    resident_auto(pipe, monkeypatch)
    calls = out_of_memory_unless(pipe, monkeypatch, lambda: pipe.transformer.resident == "host")
    out = pipe(**kw)
    # out of memory; the encoders out, still out of memory; the transformer out too, the decode again
    assert calls == [("device", "device"), ("device", "host"), ("host", "host")]
    assert pipe.encoder_home.offloaded and pipe.transformer.resident == "host"
    assert float(np.abs(np.asarray(out.frames) - z["c0.out.frames"]).max()) <= 1e-3
    calls.clear()
    pipe(**kw)  # later calls make that room first
    assert calls == [("host", "host")]
    # "off": the error is the caller's, named as XLA gave it
    monkeypatch.setattr(pipe, "transformer_offload_setting", "off")
    monkeypatch.setattr(pipe, "_room_for", {})
    pipe.transformer.load()
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        pipe(**kw)


def test_auto_moves_only_the_encoders_when_that_is_room_enough(monkeypatch):
    """LTX-2 at 512x768x121 with Gemma-3 streamed on a v5e-4: the decode needs 16.18 GiB per chip
    beside the transformer and the connectors (estimate); without the connectors it fits, so the
    transformer stays on the devices."""
    kw, z = ltx2_kwargs()
    pipe = staged_ltx2()
    resident_auto(pipe, monkeypatch)
    calls = out_of_memory_unless(pipe, monkeypatch, lambda: pipe.encoder_home.offloaded)
    out = pipe(**kw)
    assert calls == [("device", "device"), ("device", "host")] and pipe.transformer.resident == "device"
    assert pipe._room_for == {"decode": 1} and pipe.timings.transformer_moves == 0
    assert float(np.abs(np.asarray(out.frames) - z["c0.out.frames"]).max()) <= 1e-3
    calls.clear()
    pipe(**kw)  # the encoders came back for the encode and leave before the decode
    assert calls == [("device", "host")]


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
    assert all(r.resident == "host" for r in pipe.experts)  # "on": both left in host memory by the decode
    np.testing.assert_array_equal(got, want)
    # with the expert home offloading too, only the expert the step needs comes back after the encode
    # (both are on the devices from the load until the home's first step: the second call shows it)
    pipe = load("wan22_a14b", "on", expert_offload="on")
    np.testing.assert_array_equal(pipe(**kw).frames, want)
    resident, step = [], pipe.expert_home.activate
    pipe.expert_home.activate = lambda e, *a, **k: (resident.append([r.resident for r in pipe.experts]),
                                                    step(e, *a, **k))[1]
    np.testing.assert_array_equal(pipe(**kw).frames, want)
    assert resident and all(r.count("device") == 1 for r in resident), resident


def test_on_without_host_memory_is_refused_at_load(monkeypatch):
    monkeypatch.setattr(runtime, "host_memory_kind", lambda devices: None)
    with pytest.raises(PipelineError, match="transformer_offload='on'.*no pinned_host memory"):
        load("ltx2", "on")
