"""LoRA adapters (difflet_tpu/loading/lora.py) against diffusers + peft on the tiny FLUX.1-dev
folder of tests/fixtures/pipelines: tests/fixtures/lora's adapters (made with peft, saved with
`FluxPipeline.save_lora_weights`) and diffusers' float32 transformer outputs with them, on one
device and over 4 CPU devices under TP and SP; two adapters combined; switching and unloading
without recompiling the step; unload bit-exact; bad files refused with the keys named."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from difflet_tpu.config import Config
from difflet_tpu.loading import load_transformer
from difflet_tpu.loading.lora import LoraError
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.pipeline.denoise import CompileCounter
from difflet_tpu.runner import Runner

LORA = Path(__file__).resolve().parent / "fixtures" / "lora"
FLUX = Path(__file__).resolve().parent / "fixtures" / "pipelines" / "flux_dev"
FAST = {"xla_backend_optimization_level": 0}
TOL = 2e-4  # max abs over outputs of std ~1-10 in float32 (measured below 5e-5)
KWARGS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance", "img_ids",
          "txt_ids")


@functools.lru_cache(maxsize=None)
def io():
    return dict(np.load(LORA / "io.npz"))


def flux_kwargs():
    z = io()
    return {k: z[f"flux.{k}"] for k in KWARGS}


def runner(tp=None, mode=None):
    mesh = None if tp is None else make_mesh(tp)
    model = load_transformer(FLUX / "transformer", dtype=jnp.float32, mesh=mesh, config=Config())
    return Runner(model, mesh, Config(), mode=mode, compiler_options=FAST)


def out(run):
    return np.asarray(run(**flux_kwargs()).sample)


def check(got, tag):
    want = io()[f"flux.{tag}"]
    err = float(np.abs(got - want).max())
    print(f"{tag}: max abs {err:.2e} (output std {want.std():.2f})")
    assert err <= TOL, f"{tag}: max abs {err:.2e}"


@pytest.mark.parametrize("tp,mode", [(None, None), (4, "tp"), (4, "sp")])
def test_flux_adapters_match_diffusers_and_switch_without_recompiling(tp, mode):
    run = runner(tp, mode)
    base = out(run)
    check(base, "base")
    params = jax.tree.leaves(run._state)
    compiles = CompileCounter.count()
    run.load_lora_weights(LORA / "flux_a.safetensors", adapter_name="a")
    assert run.get_active_adapters() == ["a"]
    check(out(run), "a")
    run.set_adapters(["a"], adapter_weights=[0.6])
    check(out(run), "a_0.6")
    run.load_lora_weights(LORA / "flux_b.safetensors", adapter_name="b")
    run.set_adapters(["a", "b"], adapter_weights=[0.7, -0.4])
    check(out(run), "a_0.7_b_-0.4")
    run.unload_lora_weights()
    after = jax.tree.leaves(run._state)
    assert all(x is y for x, y in zip(after, params)), "unload must give back the base arrays"
    assert np.array_equal(out(run), base)
    run.load_lora_weights(LORA / "flux_nometa.safetensors")  # no metadata: alpha = r (diffusers)
    check(out(run), "nometa")
    run.unload_lora_weights()
    run.load_lora_weights(load_file(str(LORA / "flux_nometa.safetensors")))  # a state dict, as diffusers takes it
    check(out(run), "nometa")
    run.unload_lora_weights()
    run.load_lora_weights(LORA / "flux_kohya.safetensors")  # the community format, converted as diffusers does
    check(out(run), "kohya")
    assert len(run._steps) == 1 and next(iter(run._steps.values()))._cache_size() == 1

    # warm: every fuse shape has been compiled once; switching and unloading compile nothing
    run.unload_lora_weights()
    run.load_lora_weights(LORA / "flux_a.safetensors", adapter_name="a")
    run.load_lora_weights(LORA / "flux_b.safetensors", adapter_name="b")
    compiles = CompileCounter.count()
    for names, weights, tag in ((["a"], [0.6], "a_0.6"), (["a", "b"], [0.7, -0.4], "a_0.7_b_-0.4"),
                                (["a"], 1.0, "a")):
        run.set_adapters(names, adapter_weights=weights)
        check(out(run), tag)
    run.unload_lora_weights()
    assert np.array_equal(out(run), base)
    assert CompileCounter.count() == compiles, "switching adapters or scales compiled something"


def test_factors_are_placed_with_the_weights_plan_and_fused_without_communication():
    """Under TP each chip holds A with the kernel's input sharding and B with its output
    sharding; the fuse's compiled HLO has no collective, and the fused weight keeps the
    weight's sharding (the step's parameters are unchanged)."""
    from jax.sharding import NamedSharding

    from difflet_tpu.loading import lora

    run = runner(4, "tp")
    before = {lora.leaf_path(p): x.sharding for p, x in jax.tree_util.tree_flatten_with_path(run._state)[0]}
    run.load_lora_weights(LORA / "flux_a.safetensors")
    specs = lora.state_leaves(run._param_specs, run._lora.base)
    sharded = 0
    for path, base in run._lora.base.items():
        fused = lora.state_leaves(run._state, [path])[path]
        assert fused is not base and fused.sharding == before[path] == base.sharding
        sa, sb, ss = lora.factor_specs(specs[path], base.ndim)
        a, b, s = run._lora.loaded["default_0"][path]
        args = [jax.device_put(x, NamedSharding(run.mesh, sp)) for x, sp in ((a, sa), (b, sb), (s, ss))]
        hlo = lora._fuse.lower(base, *args).compile().as_text()
        for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
            assert op not in hlo, f"{path}: the fuse communicates ({op})"
        sharded += "tp" in tuple(specs[path])
    assert sharded >= 10  # column- and row-parallel kernels among them


def _write(tmp_path, tensors, name="bad.safetensors", metadata=None):
    p = tmp_path / name
    save_file(tensors, str(p), metadata=metadata)
    return p


@pytest.fixture(scope="module")
def one_device():
    return runner()


def test_bad_lora_files_are_refused_with_every_key_named(tmp_path, one_device):
    run = one_device
    good = load_file(str(LORA / "flux_b.safetensors"))
    before = jax.tree.leaves(run._state)
    cases = []
    t = dict(good)
    t["transformer.transformer_blocks.0.attn.to_zz.lora_A.weight"] = np.zeros((2, 32), np.float32)
    t["transformer.transformer_blocks.0.attn.to_zz.lora_B.weight"] = np.zeros((32, 2), np.float32)
    t["transformer.single_transformer_blocks.7.proj_mlp.lora_A.weight"] = np.zeros((2, 32), np.float32)
    t["transformer.single_transformer_blocks.7.proj_mlp.lora_B.weight"] = np.zeros((128, 2), np.float32)
    cases.append((t, ["transformer_blocks.0.attn.to_zz: no Linear", "single_transformer_blocks.7.proj_mlp: no Linear"]))
    t = dict(good)
    t["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"] = np.zeros((2, 32), np.float32)
    t["transformer.single_transformer_blocks.0.attn.to_q.alpha"] = np.zeros((), np.float32)
    cases.append((t, ["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight",
                      "single_transformer_blocks.0.attn.to_q.alpha"]))
    t = dict(good)
    del t["transformer.single_transformer_blocks.0.attn.to_v.lora_B.weight"]
    cases.append((t, ["single_transformer_blocks.0.attn.to_v: lora_B.weight is missing"]))
    t = dict(good)
    t["transformer.single_transformer_blocks.1.attn.to_q.lora_A.weight"] = np.zeros((2, 31), np.float32)
    cases.append((t, ["single_transformer_blocks.1.attn.to_q: lora_A (2, 31) / lora_B (32, 2) do not fit"]))
    for tensors, expected in cases:
        with pytest.raises(LoraError) as e:
            run.load_lora_weights(_write(tmp_path, tensors))
        for s in expected:
            assert s in str(e.value), (s, str(e.value))
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 3, "transformer.lora_alpha": 3})}
    with pytest.raises(LoraError, match="rank 2 in the file, 3 in its LoraConfig"):
        run.load_lora_weights(_write(tmp_path, good, metadata=meta))
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 2, "transformer.use_dora": True})}
    with pytest.raises(LoraError, match="use_dora"):
        run.load_lora_weights(_write(tmp_path, good, metadata=meta))
    (tmp_path / "trunc.safetensors").write_bytes((LORA / "flux_b.safetensors").read_bytes()[:500])
    with pytest.raises(LoraError, match="cannot read as safetensors"):
        run.load_lora_weights(tmp_path / "trunc.safetensors")
    with pytest.raises(LoraError, match="does not exist"):
        run.load_lora_weights(tmp_path / "nope.safetensors")
    with pytest.raises(LoraError, match="pytorch_lora_weights.safetensors does not exist"):
        run.load_lora_weights(tmp_path)
    assert all(x is y for x, y in zip(jax.tree.leaves(run._state), before)) and not run._lora.loaded


def test_kohya_modules_diffusers_has_no_reference_for_are_the_diffusers_split(tmp_path, one_device):
    """A single block's fused `linear1` (q, k, v, mlp rows: diffusers' converter hard-codes
    FLUX.1's widths) and the top-level modules (diffusers 0.42.1 drops them: see lora_kohya.py)
    fuse to the same parameters as the diffusers-format file diffusers' converter describes: A
    shared and B split by rows, final_layer's adaLN rows swapped to (scale, shift); alpha 6 / r 4."""
    from difflet_tpu.loading import lora

    run = one_device
    rng = np.random.default_rng(0)
    D, M = run.cfg.inner_dim, run.cfg.mlp_hidden_dim
    modules = {"single_blocks_1_linear1": (D, 3 * D + M), "img_in": (16, D), "time_in_in_layer": (256, D),
               "final_layer_linear": (D, 16), "final_layer_adaLN_modulation_1": (D, 2 * D)}
    kohya, peft = {}, {}
    for name, (n_in, n_out) in modules.items():
        down = rng.standard_normal((4, n_in)).astype(np.float32)
        up = rng.standard_normal((n_out, 4)).astype(np.float32)
        kohya.update({f"lora_unet_{name}.lora_down.weight": down, f"lora_unet_{name}.lora_up.weight": up,
                      f"lora_unet_{name}.alpha": np.array(6.0, np.float32)})
        if name == "single_blocks_1_linear1":
            targets = [f"single_transformer_blocks.1.{m}" for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]
            rows = np.split(up, [D, 2 * D, 3 * D])
        else:
            targets = [{"img_in": "x_embedder", "time_in_in_layer": "time_text_embed.timestep_embedder.linear_1",
                        "final_layer_linear": "proj_out", "final_layer_adaLN_modulation_1": "norm_out.linear"}[name]]
            rows = [np.concatenate([up[D:], up[:D]]) if name.endswith("modulation_1") else up]
        for m, b in zip(targets, rows):
            peft[f"transformer.{m}.lora_A.weight"] = down
            peft[f"transformer.{m}.lora_B.weight"] = b
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 4, "transformer.lora_alpha": 6})}
    fused = []
    for tensors, metadata in ((kohya, None), (peft, meta)):
        run.load_lora_weights(_write(tmp_path, tensors, metadata=metadata))
        paths = sorted(run._lora.base)
        fused.append({p: np.asarray(x) for p, x in lora.state_leaves(run._state, paths).items()})
        run.unload_lora_weights()
    assert sorted(fused[0]) == sorted(fused[1]) and len(fused[0]) == 8
    for p in fused[0]:
        np.testing.assert_array_equal(fused[0][p], fused[1][p])
    down = kohya["lora_unet_single_blocks_1_linear1.lora_down.weight"]
    up = kohya["lora_unet_single_blocks_1_linear1.lora_up.weight"]
    with pytest.raises(LoraError) as e:
        run.load_lora_weights(_write(tmp_path, {**kohya, "lora_unet_single_blocks_1_linear9.lora_down.weight": down,
                                                "lora_unet_single_blocks_1_linear9.lora_up.weight": up,
                                                "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": down}))
    assert "lora_unet_single_blocks_1_linear9: no FLUX module" in str(e.value)
    assert "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight (text-encoder" in str(e.value)
    bad = dict(kohya, **{"lora_unet_single_blocks_1_linear1.lora_up.weight": up[:-1]})
    with pytest.raises(LoraError, match=r"lora_up has 223 rows, the model's .* take 224"):
        run.load_lora_weights(_write(tmp_path, bad))


def test_adapter_names_and_weights_are_checked(tmp_path, one_device):
    run = one_device
    shutil.copy(LORA / "flux_b.safetensors", tmp_path / "pytorch_lora_weights.safetensors")
    assert run.load_lora_weights(tmp_path) == "default_0"  # a folder: diffusers' default weight name
    try:
        with pytest.raises(LoraError, match="already in use"):
            run.load_lora_weights(LORA / "flux_b.safetensors", adapter_name="default_0")
        with pytest.raises(LoraError, match=r"\['c'\] not loaded"):
            run.set_adapters(["default_0", "c"])
        with pytest.raises(LoraError, match="1 adapters and 2 adapter_weights"):
            run.set_adapters(["default_0"], [1.0, 2.0])
        with pytest.raises(LoraError, match="finite"):
            run.set_adapters(["default_0"], [float("nan")])
    finally:
        run.unload_lora_weights()


@pytest.mark.parametrize("tp,mode", [(None, None), (4, "tp"), (4, "sp")])
def test_flux_pipeline_with_a_lora_matches_diffusers(tp, mode):
    """FluxPipeline (flux_dev's `images_per_prompt` call) with flux_a at 0.8, as diffusers'
    FluxPipeline.load_lora_weights + set_adapters gives it; unload gives the base images back."""
    from difflet_tpu.pipeline.diffusion import DiffusionPipeline

    mesh = None if tp is None else make_mesh(tp)
    pipe = DiffusionPipeline.from_pretrained(FLUX, mesh=mesh, dtype=jnp.float32, config=Config(),
                                             runner_options=dict(compiler_options=FAST,
                                                                 **({"mode": mode} if mode else {})))
    call = json.loads((FLUX / "calls.json").read_text())["calls"]["images_per_prompt"]["kwargs"]
    latents = np.load(FLUX / "io.npz")["images_per_prompt.latents"]
    base = pipe(**call, latents=latents, output_type="np").images
    assert pipe.load_lora_weights(LORA / "flux_a.safetensors", adapter_name="a") == "a"
    pipe.set_adapters("a", 0.8)
    assert pipe.get_active_adapters() == ["a"]
    images = pipe(**call, latents=latents, output_type="np").images
    z = io()
    err = float(np.abs(np.asarray(pipe.final_latents) - z["flux_pipe.final_latents"]).max())
    assert err <= 1e-4, f"final latents max abs {err:.2e}"
    err = float(np.abs(images - z["flux_pipe.images"]).max())
    print(f"pipeline tp={tp} {mode}: images max abs {err:.2e}")
    assert err <= 1e-3
    assert float(np.abs(images - base).max()) > 0.05  # the adapter changes the images
    pipe.unload_lora_weights()
    assert np.array_equal(pipe(**call, latents=latents, output_type="np").images, base)


PAIRS = {"qwen_image": ("no_cfg_batch2", "images"), "wan_t2v": ("no_cfg_videos2", "frames")}


@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("tp,mode", [(None, None), (4, "tp"), (4, "sp")])
def test_two_adapters_on_qwen_image_and_wan_pipelines_match_diffusers(name, tp, mode):
    """QwenImagePipeline / WanPipeline with two peft adapters (one on every Linear, one with a
    rank_pattern) combined at [0.8, -0.5], against diffusers' call with the same set_adapters."""
    from difflet_tpu.pipeline.diffusion import DiffusionPipeline

    folder = FLUX.parent / name
    call, what = PAIRS[name]
    mesh = None if tp is None else make_mesh(tp)
    pipe = DiffusionPipeline.from_pretrained(folder, mesh=mesh, dtype=jnp.float32, config=Config(),
                                             runner_options=dict(compiler_options=FAST,
                                                                 **({"mode": mode} if mode else {})))
    kw = json.loads((folder / "calls.json").read_text())["calls"][call]["kwargs"]
    latents = np.load(folder / "io.npz")[f"{call}.latents"]
    base = getattr(pipe(**kw, latents=latents, output_type="np"), what)  # fills Wan's text K/V cache
    assert float(np.abs(np.asarray(base) - np.load(folder / "io.npz")[f"{call}.{what}"]).max()) <= 1e-3
    pipe.load_lora_weights(LORA / f"{name}_a.safetensors", adapter_name="a")
    pipe.load_lora_weights(LORA / f"{name}_b.safetensors", adapter_name="b")
    pipe.set_adapters(["a", "b"], adapter_weights=[0.8, -0.5])
    got = getattr(pipe(**kw, latents=latents, output_type="np"), what)
    z = io()
    err = float(np.abs(np.asarray(pipe.final_latents) - z[f"{name}.final_latents"]).max())
    assert err <= 1e-4, f"final latents max abs {err:.2e}"
    want = z[f"{name}.{what}"]
    err = float(np.abs(np.asarray(got) - want).max())
    print(f"{name} tp={tp} {mode}: {what} max abs {err:.2e}")
    assert np.shape(got) == want.shape and err <= 1e-3
    assert float(np.abs(want - np.asarray(base)).max()) > 0.05  # the adapters change the output


@pytest.mark.parametrize("tp,mode", [(None, None), (4, "sp")])
def test_wan22_two_experts_take_their_own_adapters(tp, mode):
    """Wan 2.2 A14B: one adapter into `transformer`, another into `transformer_2`
    (`load_into_transformer_2=True`), as diffusers' WanPipeline gives it."""
    from difflet_tpu.loading.lora import LoraError
    from difflet_tpu.pipeline.diffusion import DiffusionPipeline

    folder = FLUX.parent / "wan22_a14b"
    mesh = None if tp is None else make_mesh(tp)
    pipe = DiffusionPipeline.from_pretrained(folder, mesh=mesh, dtype=jnp.float32, config=Config(),
                                             runner_options=dict(compiler_options=FAST,
                                                                 **({"mode": mode} if mode else {})))
    kw = json.loads((folder / "calls.json").read_text())["calls"]["two_experts"]["kwargs"]
    latents = np.load(folder / "io.npz")["two_experts.latents"]
    pipe.load_lora_weights(LORA / "wan_t2v_a.safetensors", adapter_name="a")
    pipe.load_lora_weights(LORA / "wan_t2v_b.safetensors", adapter_name="b", load_into_transformer_2=True)
    assert pipe.transformer.get_active_adapters() == ["a"] and pipe.transformer_2.get_active_adapters() == ["b"]
    frames = pipe(**kw, latents=latents, output_type="np").frames
    want = io()["wan22_a14b.frames"]
    err = float(np.abs(np.asarray(frames) - want).max())
    print(f"wan22_a14b tp={tp} {mode}: frames max abs {err:.2e}")
    assert err <= 1e-3
    assert float(np.abs(want - np.load(folder / "io.npz")["two_experts.frames"]).max()) > 0.05
    with pytest.raises(LoraError, match=r"\['c'\] not loaded"):
        pipe.set_adapters(["a", "c"])


def test_generate_lora_flag(tmp_path, capsys):
    """`python -m difflet_tpu.generate ... --lora FILE[:SCALE]` (repeatable): the PNG holds the
    in-process pipeline's image with the same adapters and scales; bad --lora values are refused
    before the work with exit 1 and no file."""
    from PIL import Image

    from difflet_tpu import generate
    from difflet_tpu.pipeline.diffusion import DiffusionPipeline

    out = tmp_path / "cat.png"
    common = [str(FLUX), "--prompt", "a photo of a cat", "--height", "32", "--width", "32", "--steps", "2",
              "--seed", "3", "--out", str(out)]
    lora = ["--lora", f"{LORA / 'flux_a.safetensors'}:0.8", "--lora", str(LORA / "flux_b.safetensors")]
    assert generate.main(common + lora) == 0
    assert "LoRA" in capsys.readouterr().err
    png = np.asarray(Image.open(out)).astype(int)
    pipe = DiffusionPipeline.from_pretrained(FLUX, dtype=jnp.float32)
    kw = dict(prompt="a photo of a cat", height=32, width=32, num_inference_steps=2, seed=3, output_type="np")
    base = pipe(**kw).images[0]
    pipe.load_lora_weights(LORA / "flux_a.safetensors", adapter_name="x")
    pipe.load_lora_weights(LORA / "flux_b.safetensors", adapter_name="y")
    pipe.set_adapters(["x", "y"], [0.8, 1.0])
    want = pipe(**kw).images[0]
    assert np.abs(png - (want * 255).round()).max() <= 1
    assert np.abs(png - (base * 255).round()).max() > 10
    out.unlink()
    bad_keys = _write(tmp_path, {"transformer.nope.lora_A.weight": np.zeros((2, 4), np.float32),
                                 "transformer.nope.lora_B.weight": np.zeros((4, 2), np.float32)})
    for arg, match in ((f"{LORA / 'flux_a.safetensors'}:x", "is not a number"),
                       (f"{LORA / 'flux_a.safetensors'}:inf", "finite"),
                       (str(tmp_path / "missing.safetensors"), "does not exist"),
                       (str(bad_keys), "nope: no Linear")):
        assert generate.main(common + ["--lora", arg]) == 1
        assert match in capsys.readouterr().err
        assert not out.exists()


def test_bench_end_to_end_lora_flag(tmp_path, capsys):
    """`python -m difflet_tpu.bench --end-to-end DIR --lora FILE[:SCALE]`: the adapters are fused
    before the timed calls and named in the report; --lora elsewhere or malformed is a usage error."""
    from difflet_tpu.bench import cli

    out = tmp_path / "e2e.json"
    assert cli.main(["--end-to-end", str(FLUX), "--height", "32", "--width", "32", "--steps", "1",
                     "--lora", f"{LORA / 'flux_a.safetensors'}:0.5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["loras"] == [[str(LORA / "flux_a.safetensors"), 0.5]] and report["lora_fuse_s"] > 0
    for argv, message in ((["--model", "flux:tiny", "--lora", str(LORA / "flux_a.safetensors")],
                           "--lora only applies to --end-to-end"),
                          (["--end-to-end", str(FLUX), "--lora", f"{LORA / 'flux_a.safetensors'}:big"],
                           "is not a number")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_wan_text_kv_cache_is_dropped_when_the_weights_change():
    """Wan's `cache_text=True` reuses the text K/V while the calls pass the same embeddings; a
    LoRA on attn2.to_k / to_v changes them, so a switch must drop the cache: the output equals a
    Runner without the cache holding the same adapter, and differs from the cached base's."""
    wan = FLUX.parent / "wan_t2v" / "transformer"
    rng = np.random.default_rng(0)
    kw = dict(hidden_states=rng.standard_normal((1, 16, 2, 4, 4)).astype(np.float32),
              timestep=np.array([500.0], np.float32),
              encoder_hidden_states=rng.standard_normal((1, 8, 32)).astype(np.float32))
    cached = Runner(load_transformer(wan, dtype=jnp.float32, config=Config()), None, Config(),
                    compiler_options=FAST, cache_text=True)
    base = np.asarray(cached(**kw).sample)
    assert "text_kv" in cached.state
    cached.load_lora_weights(LORA / "wan_t2v_b.safetensors")  # attn1/attn2 to_k, ffn, proj_out
    got = np.asarray(cached(**kw).sample)
    plain = Runner(load_transformer(wan, dtype=jnp.float32, config=Config()), None, Config(), compiler_options=FAST)
    plain.load_lora_weights(LORA / "wan_t2v_b.safetensors")
    np.testing.assert_allclose(got, np.asarray(plain(**kw).sample), rtol=0, atol=1e-5)
    assert np.abs(got - base).max() > 1e-2


@pytest.mark.slow
def test_flux_dev_rank64_compile_only_hbm_on_v5e():
    """Compile-only (deviceless v5e:2x2, tp=4) HBM of FLUX.1-dev bf16 with a rank-64 adapter on
    every Linear (difflet_tpu/tools/lora_memory.py): the base copies kept are the touched
    parameters' shards, and the fuse of the largest parameter reads only this chip's shards of
    the weight and of A / B (its arguments are the weight shard plus the factor shards, counted
    here from the shapes) with no temporary the size of a gathered weight."""
    from difflet_tpu.tools import deviceless

    out = deviceless.run_python("import json\nfrom difflet_tpu.tools.lora_memory import measure\n"
                                "print(json.dumps(measure('flux.1-dev', 64, 'v5e:2x2')))", timeout=1200)
    print(out)
    L, n_in, n_out = out["largest_shape"]
    spec = out["largest_spec"] + [None] * (3 - len(out["largest_spec"]))
    in_split, out_split = (4 if spec[1] == "tp" else 1), (4 if spec[2] == "tp" else 1)
    assert out["largest_parameter"] == "single_transformer_blocks.proj_mlp.kernel" and (in_split, out_split) == (1, 4)
    weight_shard = L * n_in * (n_out // 4) * 2  # bf16, output features split over 4 chips
    assert out["tp"] == 4 and out["lora_parameters"] >= 30
    assert out["base_copies_per_chip"] <= out["params_per_chip"] < 1.01 * out["base_copies_per_chip"]
    fuse = out["fuse_largest_compiled"]
    # float32: A^T [L, in, 64] and s whole, B^T [L, 64, out] split by output features like the weight
    factor_shards = 4 * L * 64 * (n_in // in_split + n_out // out_split) + 4 * L * 64
    assert fuse["outputs"] == weight_shard
    # (a few KB of buffer padding; a whole factor instead of its shard would add 90 MB)
    assert 0 <= fuse["arguments"] - (weight_shard + factor_shards) <= 65536
    assert fuse["temporaries"] < weight_shard


def test_offload_moves_the_base_copies_to_host_memory_too():
    """`Runner.offload()` (an idle Wan 2.2 expert) with an adapter active: the base copies go to
    host memory with the fused parameters, so no device array of the Runner stays alive; after
    `load()`, switching and unloading work from them (unload still bit-exact)."""
    from difflet_tpu import runtime

    run = runner()
    base = out(run)
    run.load_lora_weights(LORA / "flux_a.safetensors", adapter_name="a")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "device arrays are still referenced" would be one
        run.offload()
    assert {x.sharding.memory_kind for x in run._lora.base.values()} == {runtime.HOST_MEMORY_KIND}
    with pytest.raises(ValueError, match="call load"):
        run.set_adapters(["a"], [0.6])
    run.load()
    check(out(run), "a")
    run.set_adapters(["a"], [0.6])
    check(out(run), "a_0.6")
    run.unload_lora_weights()
    assert np.array_equal(out(run), base)
