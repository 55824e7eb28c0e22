"""Block-sparse attention on the pipeline call (`attention=`, difflet_tpu.pipeline.caching) on the
tiny Wan T2V folder: the first `full_steps` steps dense and the rest sparse (counted, and the
output equal to the dense call exactly when every step is dense), the quality gate against the
dense run, a window the video cannot take refused before any work, a transformer without it
refused by name; the same on the tiny HunyuanVideo and LTX-2 folders. The sparse step itself against
masked softmax: tests/test_sparse_attention.py (Wan), tests/test_sparse_joint.py (HunyuanVideo),
tests/test_sparse_ltx2.py (LTX-2)."""

from __future__ import annotations

import functools
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.arguments import ArgumentError
from difflet_tpu.pipeline.diffusion import DiffusionPipeline, PipelineError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
FAST = {"xla_backend_optimization_level": 0}
# 128x256 pixels x 9 frames: a 3 x 8 x 16 latent grid; tiles of 2x4x16 tokens (128), 2 x 2 x 1 of them
STA = "sta:window=1,2,1,tile=2,4,16"


@functools.lru_cache(maxsize=None)
def wan():
    return DiffusionPipeline.from_pretrained(FIXTURES / "wan_t2v", dtype=jnp.float32,
                                             runner_options=dict(compiler_options=FAST))


def call(**kw):
    return dict(prompt="a cat", height=128, width=256, num_frames=9, num_inference_steps=3, guidance_scale=5.0,
                max_sequence_length=16, seed=0, output_type="np", **kw)


def test_full_steps_then_sparse_steps():
    pipe = wan()
    dense = pipe(**call())
    assert "attention" not in dense.stats
    all_dense = pipe(**call(attention=f"{STA},full_steps=3"))
    np.testing.assert_array_equal(all_dense.frames, dense.frames)  # every step dense: the dense call
    assert all_dense.stats["sparse_calls"] == 0
    one = pipe(**call(attention=f"{STA},full_steps=1"))
    assert one.stats["sparse_calls"] == 2 and one.stats["attention"] == f"{STA},full_steps=1"
    none = pipe(**call(attention=STA))
    assert none.stats["sparse_calls"] == 3
    for a, b in ((one, dense), (none, one)):
        assert np.abs(a.frames - b.frames).max() > 1e-4  # each sparse step changes the video
    assert np.isfinite(none.frames).all()


def test_quality_gate_compares_with_the_dense_run():
    pipe = wan()
    out = pipe(**call(attention=STA, quality_gate=200.0))
    gate = out.stats["quality_gate"]
    dense = pipe(**call())
    from difflet_tpu.pipeline import quality

    assert gate["psnr_db"] == pytest.approx(quality.psnr(quality.as_pixels(out.frames),
                                                         quality.as_pixels(dense.frames)))
    assert not gate["passed"] and gate["calls_saved"] == 0


def test_quality_gate_with_attention_and_the_step_cache_compares_with_the_plain_run():
    """Sparse attention and the step cache together: the gate's reference is the dense, uncached
    trajectory, and its calls saved are the cache's."""
    from difflet_tpu.pipeline import quality

    pipe = wan()
    out = pipe(**call(attention=STA, cache="first-block:threshold=1e9,warmup=1,max_skips=100", quality_gate=0.0))
    plain = pipe(**call())
    gate = out.stats["quality_gate"]
    assert out.stats["sparse_calls"] >= 1 and out.stats["cached_calls"] >= 1
    assert gate["passed"] and gate["calls_saved"] == out.stats["cached_calls"]
    assert gate["psnr_db"] == pytest.approx(quality.psnr(quality.as_pixels(out.frames), quality.as_pixels(plain.frames)))


def test_bad_attention_is_refused_before_any_work():
    pipe = wan()
    stages = []
    pipe.on_stage = lambda stage, info: stages.append(stage)
    try:
        with pytest.raises(PipelineError, match=r"wider than the \(2, 2, 1\) tiles"):
            pipe(**call(attention="sta:tile=2,4,16,window=3,1,1"))
        with pytest.raises(ArgumentError, match="unknown option 'decay' for sta"):
            pipe(**call(attention="sta:decay=1"))
    finally:
        pipe.on_stage = None
    assert "encode" not in stages and "denoise" not in stages


@functools.lru_cache(maxsize=None)
def hunyuan():
    return DiffusionPipeline.from_pretrained(FIXTURES / "hunyuan_video", dtype=jnp.float32,
                                             runner_options=dict(compiler_options=FAST))


def hunyuan_call(**kw):
    # 128x256 pixels x 9 frames: the same 3 x 8 x 16 latent grid as Wan's (VAE 4x / 8x, patch 2)
    return dict(prompt="a cat", height=128, width=256, num_frames=9, num_inference_steps=2,
                max_sequence_length=16, seed=0, output_type="np", **kw)


@functools.lru_cache(maxsize=None)
def ltx2():
    return DiffusionPipeline.from_pretrained(FIXTURES / "ltx2", dtype=jnp.float32,
                                             runner_options=dict(compiler_options=FAST))


def ltx2_call(**kw):
    # 128x256 pixels x 9 frames: a 3 x 8 x 16 latent grid again (the tiny VAE: 4x / 16x, patch 1)
    return dict(prompt="a cat", height=128, width=256, num_frames=9, num_inference_steps=2, guidance_scale=1.0,
                audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                audio_modality_scale=1.0, max_sequence_length=16, seed=0, output_type="np", **kw)


VIDEO = {"hunyuan_video": (hunyuan, hunyuan_call), "ltx2": (ltx2, ltx2_call)}


@pytest.mark.parametrize("name", sorted(VIDEO))
def test_other_video_pipelines_full_steps_then_sparse_steps(name):
    load, call_kw = VIDEO[name]
    pipe = load()
    dense = pipe(**call_kw())
    all_dense = pipe(**call_kw(attention=f"{STA},full_steps=2"))
    np.testing.assert_array_equal(all_dense.frames, dense.frames)
    one = pipe(**call_kw(attention=f"{STA},full_steps=1"))
    assert one.stats["sparse_calls"] == 1 and all_dense.stats["sparse_calls"] == 0
    assert np.abs(one.frames - dense.frames).max() > 1e-4 and np.isfinite(one.frames).all()


@pytest.mark.parametrize("name", sorted(VIDEO))
def test_other_video_pipelines_refuse_bad_attention_before_any_work(name):
    load, call_kw = VIDEO[name]
    pipe = load()
    stages = []
    pipe.on_stage = lambda stage, info: stages.append(stage)
    try:
        with pytest.raises(PipelineError, match=r"wider than the \(2, 2, 1\) tiles"):
            pipe(**call_kw(attention="sta:tile=2,4,16,window=3,1,1"))
    finally:
        pipe.on_stage = None
    assert "encode" not in stages and "denoise" not in stages


def test_a_transformer_without_sparse_attention_is_named():
    pipe = DiffusionPipeline.from_pretrained(FIXTURES / "flux_dev", dtype=jnp.float32)
    with pytest.raises(ArgumentError, match="not available for FluxPipeline's transformer"):
        pipe(prompt="a cat", height=32, width=32, num_inference_steps=1, attention="sta")


def test_generate_attention_and_its_gate(tmp_path, capsys):
    import json

    from difflet_tpu import generate

    out, report = tmp_path / "a.mp4", tmp_path / "a.json"
    argv = [str(FIXTURES / "wan_t2v"), "--prompt", "a cat", "--height", "128", "--width", "256", "--frames", "9",
            "--steps", "2", "--out", str(out), "--json", str(report), "--attention", STA + ",full_steps=1",
            "--quality-gate", "300"]
    assert generate.main(argv) == generate.EXIT_GATE_FAILED
    stats = json.loads(report.read_text())["stats"]
    assert stats["sparse_calls"] == 1 and stats["quality_gate"]["psnr_db"] < 300
    assert out.exists()  # the (sparse) video is written; the exit status says the gate failed
    assert generate.main(argv[:-4] + ["--out", str(tmp_path / "b.mp4"), "--attention", "sta:window=0,1,1"]) == 1
    assert "--attention" in capsys.readouterr().err and not (tmp_path / "b.mp4").exists()
