"""LoRA adapters (difflet_tpu/loading/lora.py) on the video pipelines against diffusers + peft:
WanImageToVideoPipeline (Wan 2.1 I2V with CLIP image tokens), HunyuanVideoPipeline (two adapters
combined, a switch and unload without recompiling) and LTX2Pipeline (frames and waveform), each
on one device and over 4 CPU devices under TP and SP, with tests/fixtures/lora's adapters (made
with peft, saved with `<Pipeline>.save_lora_weights`) and diffusers' outputs with them loaded
(`io_video.npz`, tests/fixtures/lora/README.md). Then `generate --lora` on a video folder and
the error for a file whose keys do not fit each family's transformer."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from difflet_tpu.config import Config
from difflet_tpu.loading.lora import LoraError
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.pipeline.denoise import CompileCounter
from difflet_tpu.pipeline.diffusion import DiffusionPipeline

LORA = Path(__file__).resolve().parent / "fixtures" / "lora"
PIPES = Path(__file__).resolve().parent / "fixtures" / "pipelines"
FAST = {"xla_backend_optimization_level": 0}
LATENT_TOL = 2e-5  # of the largest |latent| (~25 for Wan I2V: float32 rounding over the steps)
FRAMES_TOL = 1e-3  # the reference frames are stored as float16 (rounding <= 2.5e-4 in [0, 1])
MODES = [(None, None), (4, "tp"), (4, "sp")]


@functools.lru_cache(maxsize=None)
def io():
    return dict(np.load(LORA / "io_video.npz"))


def pipeline(name, tp=None, mode=None):
    mesh = None if tp is None else make_mesh(tp)
    return DiffusionPipeline.from_pretrained(PIPES / name, mesh=mesh, dtype=jnp.float32, config=Config(),
                                             runner_options=dict(compiler_options=FAST,
                                                                 **({"mode": mode} if mode else {})))


def call_kwargs(name, call):
    kw = json.loads((PIPES / name / "calls.json").read_text())["calls"][call]["kwargs"]
    kw = dict(kw, latents=np.load(PIPES / name / "io.npz")[f"{call}.latents"])
    if "image" in kw:
        kw["image"] = str(PIPES / name / kw["image"])
    return kw


def close(what, got, want, tol):
    """max abs <= tol, times the largest |want| when that is above 1."""
    got, want = np.asarray(got, np.float32), want.astype(np.float32)
    assert got.shape == want.shape, f"{what}: {got.shape} != {want.shape}"
    err, scale = float(np.abs(got - want).max()), max(1.0, float(np.abs(want).max()))
    print(f"{what}: max abs {err:.2e} (largest |want| {scale:.1f})")
    assert err <= tol * scale, f"{what}: max abs {err:.2e}"


@pytest.mark.parametrize("tp,mode", MODES)
def test_wan_i2v_with_a_lora_matches_diffusers(tp, mode):
    """WanImageToVideoPipeline (wan_i2v's `batch2` call) with wan_i2v_a (every Linear, the image
    cross-attention's add_k_proj / add_v_proj and the CLIP image embedder's MLP among them)."""
    tensors = load_file(str(LORA / "wan_i2v_a.safetensors"))
    for module in ("blocks.0.attn2.add_k_proj", "blocks.1.attn2.add_v_proj", "condition_embedder.image_embedder.ff.net.0.proj"):
        assert f"transformer.{module}.lora_B.weight" in tensors
    pipe = pipeline("wan_i2v", tp, mode)
    kw = call_kwargs("wan_i2v", "batch2")
    base = np.load(PIPES / "wan_i2v" / "io.npz")["batch2.frames"]
    close("wan_i2v base frames", pipe(**kw, output_type="np").frames, base, FRAMES_TOL)  # then a switch
    pipe.load_lora_weights(LORA / "wan_i2v_a.safetensors", adapter_name="a")
    frames = pipe(**kw, output_type="np").frames
    close(f"wan_i2v tp={tp} {mode} final latents", pipe.final_latents, io()["wan_i2v.final_latents"], LATENT_TOL)
    close(f"wan_i2v tp={tp} {mode} frames", frames, io()["wan_i2v.frames"], FRAMES_TOL)
    assert float(np.abs(io()["wan_i2v.frames"] - base).max()) > 0.05  # the adapter changes the video


@pytest.mark.parametrize("tp,mode", MODES)
def test_hunyuan_video_two_adapters_match_diffusers_switch_and_unload_without_recompiling(tp, mode):
    """HunyuanVideoPipeline (hunyuan_video's `embedded` call) with hunyuan_video_a (every Linear)
    and hunyuan_video_b (the RoPE'd q/k of the double and single blocks, the single blocks' packed
    proj_out and proj_mlp) at [0.7, 0.4] as diffusers' set_adapters gives it; then a alone, the
    pair again and an unload, compiling nothing; the unload gives the base arrays and latents back."""
    pipe = pipeline("hunyuan_video", tp, mode)
    kw = call_kwargs("hunyuan_video", "embedded")
    params = jax.tree.leaves(pipe.transformer._state)
    base = np.asarray(pipe(**kw, output_type="latent").frames)
    pipe.load_lora_weights(LORA / "hunyuan_video_a.safetensors", adapter_name="a")
    pipe.load_lora_weights(LORA / "hunyuan_video_b.safetensors", adapter_name="b")
    pipe.set_adapters(["a", "b"], adapter_weights=[0.7, 0.4])
    assert pipe.get_active_adapters() == ["a", "b"]
    frames = pipe(**kw, output_type="np").frames
    z = io()
    close(f"hunyuan a+b tp={tp} {mode} final latents", pipe.final_latents, z["hunyuan_video.ab.final_latents"],
          LATENT_TOL)
    close(f"hunyuan a+b tp={tp} {mode} frames", frames, z["hunyuan_video.ab.frames"], FRAMES_TOL)
    # every fuse shape (a alone, b alone, both) has compiled during the loads and set_adapters
    compiles = CompileCounter.count()
    pipe.set_adapters("a", 1.0)
    pipe(**kw, output_type="latent")
    close(f"hunyuan a tp={tp} {mode} final latents", pipe.final_latents, z["hunyuan_video.a.final_latents"],
          LATENT_TOL)
    pipe.set_adapters(["a", "b"], adapter_weights=[0.7, 0.4])
    pipe(**kw, output_type="latent")
    close(f"hunyuan a+b again tp={tp} {mode}", pipe.final_latents, z["hunyuan_video.ab.final_latents"], LATENT_TOL)
    pipe.unload_lora_weights()
    assert all(x is y for x, y in zip(jax.tree.leaves(pipe.transformer._state), params))
    assert np.array_equal(np.asarray(pipe(**kw, output_type="latent").frames), base)
    assert CompileCounter.count() == compiles, "switching adapters or unloading compiled something"
    assert float(np.abs(z["hunyuan_video.ab.final_latents"] - z["hunyuan_video.a.final_latents"]).max()) > 0.05


@pytest.mark.parametrize("tp,mode", MODES)
def test_ltx2_with_a_lora_matches_diffusers(tp, mode):
    """LTX2Pipeline (ltx2's call 1, its latents and audio latents) with ltx2_a (every Linear: the
    video and audio streams, the audio<->video cross-attentions, the embedders): frames and waveform."""
    tensors = load_file(str(LORA / "ltx2_a.safetensors"))
    for module in ("attn1.to_q", "audio_attn1.to_k", "audio_to_video_attn.to_q", "video_to_audio_attn.to_v",
                   "audio_ff.net.2"):
        assert f"transformer.transformer_blocks.0.{module}.lora_B.weight" in tensors
    pipe = pipeline("ltx2", tp, mode)
    calls, z = json.loads((PIPES / "ltx2" / "calls.json").read_text()), np.load(PIPES / "ltx2" / "io.npz")
    kw = dict(calls[1], latents=z["in.latents"], audio_latents=z["in.audio_latents"], output_type="np")
    close("ltx2 base frames", pipe(**kw).frames, z["c1.out.frames"], FRAMES_TOL)  # then a switch
    pipe.load_lora_weights(LORA / "ltx2_a.safetensors")
    out = pipe(**kw)
    close(f"ltx2 tp={tp} {mode} frames", out.frames, io()["ltx2.frames"], FRAMES_TOL)
    close(f"ltx2 tp={tp} {mode} audio", out.audio, io()["ltx2.audio"], 1e-4)  # float32: 4e-7 measured
    for what in ("frames", "audio"):  # the adapter changes both
        assert float(np.abs(io()[f"ltx2.{what}"] - z[f"c1.out.{what}"]).max()) > 0.05


def test_generate_lora_flag_on_a_video_folder(tmp_path, capsys):
    """`python -m difflet_tpu.generate <wan_t2v> --lora FILE:SCALE --out x.mp4`: the MP4 holds the
    in-process pipeline's frames with the adapter at that scale (up to H.264's loss, compared in
    luma as tests/pipelines/test_generate_video.py does), not the base frames."""
    from difflet_tpu import generate
    from difflet_tpu.pipeline import mp4

    out = tmp_path / "x.mp4"
    assert generate.main([str(PIPES / "wan_t2v"), "--prompt", "a cat walking", "--frames", "5", "--height", "32",
                          "--width", "48", "--steps", "2", "--max-sequence-length", "16", "--seed", "5",
                          "--lora", f"{LORA / 'wan_t2v_a.safetensors'}:0.7", "--out", str(out)]) == 0
    assert "LoRA" in capsys.readouterr().err
    frames, _ = mp4.read_mp4(out)
    pipe = DiffusionPipeline.from_pretrained(PIPES / "wan_t2v", dtype=jnp.float32)
    kw = dict(prompt="a cat walking", height=32, width=48, num_frames=5, num_inference_steps=2,
              max_sequence_length=16, seed=5, output_type="np")
    base = pipe(**kw).frames[0]
    pipe.load_lora_weights(LORA / "wan_t2v_a.safetensors")
    pipe.set_adapters("default_0", 0.7)
    want = pipe(**kw).frames[0]
    luma = np.array([0.299, 0.587, 0.114])

    def err(x):
        return float(np.abs(frames.astype(np.float64) @ luma - (x * 255) @ luma).mean())

    print(f"luma mean abs: adapter {err(want):.2f}, base {err(base):.2f}")
    assert err(want) < 6.0 and err(base) > 3 * err(want)


BAD = {  # family: (transformer folder, modules its transformer does not have, one that has the wrong width)
    "wan_i2v": ("blocks.0.attn2.add_q_proj", "condition_embedder.image_embedder.ff.net.4", "blocks.1.attn2.add_k_proj"),
    "hunyuan_video": ("single_transformer_blocks.0.attn.add_q_proj", "transformer_blocks.5.attn.to_q",
                      "single_transformer_blocks.1.proj_out"),
    "ltx2": ("transformer_blocks.0.audio_attn3.to_q", "transformer_blocks.0.audio_ff.net.4",
             "transformer_blocks.0.video_to_audio_attn.to_k"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_keys_that_do_not_fit_a_video_transformer_are_listed(name, tmp_path):
    from difflet_tpu.loading import load_transformer
    from difflet_tpu.runner import Runner

    run = Runner(load_transformer(PIPES / name / "transformer", dtype=jnp.float32, config=Config()), None, Config(),
                 compiler_options=FAST)
    before = jax.tree.leaves(run._state)
    *missing, narrow = BAD[name]
    tensors = {}
    for m in missing:
        tensors[f"transformer.{m}.lora_A.weight"] = np.ones((2, 8), np.float32)
        tensors[f"transformer.{m}.lora_B.weight"] = np.ones((8, 2), np.float32)
    tensors[f"transformer.{narrow}.lora_A.weight"] = np.ones((2, 3), np.float32)
    tensors[f"transformer.{narrow}.lora_B.weight"] = np.ones((7, 2), np.float32)
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(LoraError) as e:
        run.load_lora_weights(tmp_path / "bad.safetensors")
    message = str(e.value)
    for m in missing:
        assert f"{m}: no Linear of the model has this name" in message, message
    assert f"{narrow}: lora_A (2, 3) / lora_B (7, 2) do not fit its weight" in message, message
    if name == "ltx2":  # diffusers' LTX2LoraLoaderMixin would load this one into the text connectors
        good = load_file(str(LORA / "ltx2_a.safetensors"))
        good["connectors.video_connector.proj_in.lora_A.weight"] = np.ones((2, 8), np.float32)
        save_file(good, str(tmp_path / "connectors.safetensors"))
        with pytest.raises(LoraError, match=r"unexpected key connectors\.video_connector\.proj_in\.lora_A\.weight "
                                            r"\(not the transformer's"):
            run.load_lora_weights(tmp_path / "connectors.safetensors")
    assert all(x is y for x, y in zip(jax.tree.leaves(run._state), before)) and not run._lora.loaded
