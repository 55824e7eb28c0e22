"""The decoder-LM text encoder streaming its layers from host memory (Config.encoder_stream,
encoders/streaming.py) inside the pipelines, on 4 CPU devices under SP (jax's CPU client has the
pinned_host memory kind): LTX-2 with "auto" and a memory limit the whole LM does not fit beside
the rest streams Gemma-3 instead of staging the transformer, and its frames and audio still equal
diffusers' (the fixtures'); HunyuanVideo's Llama and Qwen-Image's Qwen2.5-VL with "on" likewise."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu import runtime
from difflet_tpu.config import Config
from difflet_tpu.encoders import streaming
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.pipeline import placement
from difflet_tpu.pipeline.diffusion import DiffusionPipeline

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
FAST = {"xla_backend_optimization_level": 0}
MAX_ABS, REL_L2 = 1e-3, 1e-4  # the bar on pixels and the waveform


def load(name, **config):
    return DiffusionPipeline.from_pretrained(FIXTURES / name, mesh=make_mesh(4), dtype=jnp.float32,
                                             config=Config(**config),
                                             runner_options=dict(compiler_options=FAST, mode="sp"))


def close(got, want, what):
    got = np.asarray(got, np.float64)
    err, rel = float(np.abs(got - want).max()), float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert got.shape == want.shape and err <= MAX_ABS and rel <= REL_L2, f"{what}: max abs {err:.2e}, rel L2 {rel:.2e}"


def watch(pipe, monkeypatch):
    """Per streamed group: where the transformer's parameters and the group's were."""
    seen, forward = [], streaming._group_forward

    def spy(graphdef, params, *a):
        seen.append(({x.sharding.memory_kind for x in jax.tree.leaves(pipe.transformer._state)},
                     {x.sharding.memory_kind for x in jax.tree.leaves(params)}))
        return forward(graphdef, params, *a)

    monkeypatch.setattr(streaming, "_group_forward", spy)
    return seen


def spy_lm_loads(monkeypatch):
    """The memory kind each decoder LM was loaded into (None: the devices)."""
    from difflet_tpu.encoders import decoder_lm

    kinds, real = [], decoder_lm.from_pretrained

    def from_pretrained(*a, memory_kind=None, **k):
        kinds.append(memory_kind)
        return real(*a, memory_kind=memory_kind, **k)

    monkeypatch.setattr(decoder_lm, "from_pretrained", from_pretrained)
    return kinds


def test_ltx2_auto_streams_gemma_instead_of_staging_the_transformer(monkeypatch, decided_peaks):
    folder = FIXTURES / "ltx2"
    calls, z = json.loads((folder / "calls.json").read_text()), np.load(folder / "io.npz")
    sizes = load("ltx2", encoder_stream="off")  # (loaded, never called: its parts' sizes)
    lm = placement.bytes_per_chip(sizes.text_encoder)
    parts = sizes.stage_parts_bytes()
    # a chip that holds every part but the LM's layers and embedding: too small for the whole LM
    limit = parts + placement.ENCODE_MARGIN - lm // 2
    monkeypatch.setattr(runtime, "device_memory_limit", lambda devices: limit)
    loaded_into = spy_lm_loads(monkeypatch)
    pipe = load("ltx2")  # every setting "auto"
    assert loaded_into == [runtime.HOST_MEMORY_KIND]  # never whole on the devices, even while loading
    seen = watch(pipe, monkeypatch)
    encodes, encode_prompt = [], pipe.encode_prompt
    monkeypatch.setattr(pipe, "encode_prompt", lambda *a, **k: encodes.append(1) or encode_prompt(*a, **k))
    out = pipe(**calls[0], latents=z["in.latents"], audio_latents=z["in.audio_latents"], output_type="np")
    assert pipe.encoder_stream and "over the" in pipe.encoder_stream_reason
    assert decided_peaks[placement.ENCODE] == parts - lm + placement.ENCODE_MARGIN  # then asked for the transformer
    assert pipe.transformer_offload is False and pipe.timings.transformer_moves == 0
    assert 0 < pipe.timings.as_dict()["encoder_stream_s"] <= pipe.timings.encode
    # each group of Gemma-3's layers on the devices for its turn, the transformer there throughout
    assert len(seen) == len(pipe.text_stream.groups) * len(encodes) and all(s == ({"device"}, {"device"}) for s in seen), seen
    assert pipe.text_stream.memory_kinds() == {runtime.HOST_MEMORY_KIND}
    assert pipe.text_encoder_for(pipe.text_encoder) is pipe.text_stream
    assert pipe.encoder_home.encoders == [pipe.connectors]  # the rest of the text path stays where it is
    close(out.frames, z["c0.out.frames"], "frames")
    close(out.audio, z["c0.out.audio"], "audio")


def test_auto_with_room_loads_through_host_memory_and_keeps_the_lm_whole(monkeypatch):
    """On a chip with a memory limit the LM is loaded into host memory (it might stream); when
    every part fits it moves to the devices at load's end and encodes whole."""
    monkeypatch.setattr(runtime, "device_memory_limit", lambda devices: 2**40)
    loaded_into = spy_lm_loads(monkeypatch)
    pipe = load("qwen_image")
    assert loaded_into == [runtime.HOST_MEMORY_KIND]
    assert not pipe.encoder_stream and "within the" in pipe.encoder_stream_reason and pipe.text_stream is None
    assert {x.sharding.memory_kind for x in jax.tree.leaves(placement._params(pipe.text_encoder))} == {"device"}
    assert pipe.text_encoder_for(pipe.text_encoder) is pipe.text_encoder


@pytest.mark.parametrize("name", ["hunyuan_video", "qwen_image"])
def test_on_streams_llama_and_qwen2_5_vl(name, monkeypatch):
    folder = FIXTURES / name
    calls, z = json.loads((folder / "calls.json").read_text())["calls"], np.load(folder / "io.npz")
    call = "true_cfg"  # both fixtures have one: a negative prompt encoded too
    loaded_into = spy_lm_loads(monkeypatch)
    pipe = load(name, encoder_stream="on")
    assert loaded_into == [runtime.HOST_MEMORY_KIND]
    seen = watch(pipe, monkeypatch)
    out = pipe(**calls[call]["kwargs"], latents=z[f"{call}.latents"], output_type="np")
    assert pipe.encoder_stream and pipe.encoder_stream_reason == "on" and seen
    assert all(kinds == {"device"} for _, kinds in seen)
    if name == "qwen_image":  # its only encoder streams: the encoders' home is empty but knows the devices
        assert pipe.encoder_home.encoders == [] and pipe.encoder_home.devices() == pipe.text_stream.devices
    what = "frames" if name == "hunyuan_video" else "images"
    close(getattr(out, what), z[f"{call}.{what}"], name)


def test_on_without_a_decoder_lm_is_a_no_op_and_bad_values_refused():
    from difflet_tpu.config import ConfigError

    with pytest.raises(ConfigError, match="encoder_stream"):
        Config(encoder_stream="yes")
    pipe = DiffusionPipeline.from_pretrained(FIXTURES / "wan_t2v", dtype=jnp.float32, config=Config(encoder_stream="on"),
                                             runner_options=dict(compiler_options=FAST))
    assert pipe.encoder_stream is False and "no decoder-LM" in pipe.encoder_stream_reason
