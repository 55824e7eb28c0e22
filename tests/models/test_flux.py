"""FLUX.1 port (difflet_tpu.models.flux): parity with interleaved RoPE (split RoPE
off); the Pallas kernels' fallback and interpret-mode runs; each FLUX mechanism
against the plain model in float64, and shown to matter by removing it; input
errors before compilation; config, presets, FLOPs.

Fixture parity (one device, TP and SP on 2 and 4 devices, sp-xla, SP == TP at
padded counts) and the deviceless v5e:2x2 compile of FLUX.1-dev are in the
conformance suite (tests/test_conformance.py), as for every port.

Compiles use XLA's CPU optimisation level 0 (Runner(compiler_options=...)) to keep
the file fast; the numbers do not depend on it (checked: identical parity).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from difflet_tpu import testing
from difflet_tpu.testing import fixture_sample, load_fixture_transformer, rel_l2
from difflet_tpu import loading, models
from difflet_tpu.config import Config
from difflet_tpu.layers import mmdit
from difflet_tpu.layers.normalization import MATMUL_ROWS, few_rows
from difflet_tpu.parallel.mesh import TP, make_mesh
from difflet_tpu.models import flux
from difflet_tpu.models.flux import model as tf
from difflet_tpu.parallel.modes import Parallel

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
FAST = {"xla_backend_optimization_level": 0}
TOL = 1e-5
# The float64 port against itself agrees to ~5e-8, not 1e-15: jax.nn.dot_product_attention
# (the attention off TPU) always runs its softmax in float32, and the SP reduce-scatter
# ring accumulates each hop in float32 (collective_matmul._rs_ring). Every mechanism
# removed moves the result by > 1e-4, so 1e-6 still separates right from wrong.
TOL64 = 1e-6


rel = rel_l2


def fixture(case):
    return fixture_sample(FIXTURES / case)


def load(case, tp=None, *, split_rope=True, dtype=jnp.float32):
    return load_fixture_transformer(FIXTURES / case, tp, split_rope=split_rope, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _model(tp, split_rope):
    # flux, flux_batch2 and flux_pad share one config and one weights file.
    return load("flux", tp, split_rope=split_rope)


def runner(model, mesh, mode=None, config=None, **kw):
    return flux.Runner(model, mesh, config or Config(), mode=mode, compiler_options=FAST, **kw)


@functools.lru_cache(maxsize=None)
def run(case, tp=None, mode=None, split_rope=True, config=None):
    model, mesh = _model(tp, split_rope)
    kwargs, _ = fixture(case)
    return np.asarray(runner(model, mesh, mode, config)(**kwargs).sample)


def f64_kwargs(case):
    kwargs, _ = fixture(case)
    return {k: (v.astype(np.float64) if k in ("hidden_states", "encoder_hidden_states", "pooled_projections")
                else v) for k, v in kwargs.items()}


# --------------------------------------------------------------------------
# Parity with diffusers (float32) beyond the conformance suite; the kernels
# --------------------------------------------------------------------------

def test_parity_split_rope_off():
    """Interleaved RoPE (DIFFLET_TPU_SPLIT_ROPE=0): checkpoint order, pairwise rotation."""
    _, ref = fixture("flux")
    assert rel(run("flux", split_rope=False), ref) <= TOL
    assert rel(run("flux", 2, "sp", split_rope=False), ref) <= TOL


def test_pallas_kernels_fall_back_at_fixture_sizes(caplog):
    """Config(sp_kernel="pallas", sp_rs_kernel="pallas"): the kernels' unsupported_reason
    rejects the tiny model (K = 64 is not a multiple of 128), so the JAX rings run, with
    one notice per shape; the streams are padded to whole (8, 128) tiles (64 rows)."""
    from difflet_tpu.kernels import all_gather_matmul_stream as ag_kernel
    from difflet_tpu.kernels import matmul_reduce_scatter_stream as rs_kernel

    assert ag_kernel.unsupported_reason((1, 16, 64), [16, 16, 16], jnp.float32, 4) is not None
    assert rs_kernel.unsupported_reason([(1, 64, 16)], [(16, 64)], jnp.float32, 4) is not None
    conf = Config(sp=True, sp_kernel="pallas", sp_rs_kernel="pallas")
    model, mesh = _model(4, True)
    r = runner(model, mesh, "sp", conf)
    assert (r.par.ag_impl, r.par.rs_impl) == ("pallas", "pallas")
    assert r.row_multiple() == 64
    kwargs, ref = fixture("flux")
    with caplog.at_level(logging.WARNING, logger="difflet_tpu.parallel.site_plan"):
        out = r(**kwargs).sample
    assert rel(out, ref) <= TOL
    assert not caplog.records or any("using the JAX ring" in m.getMessage() for m in caplog.records)


@pytest.mark.slow
def test_sp_pallas_kernels_run_in_the_model(caplog, monkeypatch):
    """The Pallas AG and RS kernels themselves (TPU interpret mode), inside the model:
    a random 1 double + 1 single block config whose widths the kernels take at P=2
    (D = 256 = 4 heads x 64, so 128-wide q/k/v shards; MLP 1024 -> 512 a rank), 32
    image + 24 text tokens (text padded to 32: 8-row halves a rank); SP on 2 devices
    equals one device, every collective matmul ran a kernel and none fell back."""
    from difflet_tpu.parallel import site_plan
    from difflet_tpu.kernels import all_gather_matmul_stream as ag_kernel
    from difflet_tpu.kernels import matmul_reduce_scatter_stream as rs_kernel

    c = flux.config_from_diffusers(dict(flux.PRESETS["tiny"], num_attention_heads=4, attention_head_dim=64,
                                        axes_dims_rope=[16, 24, 24], num_layers=1, num_single_layers=1))
    assert (c.inner_dim, c.mlp_hidden_dim) == (256, 1024)
    model = flux.build(c, dtype=jnp.float32, rngs=nnx.Rngs(0))
    kwargs = flux.example_inputs(c, height=64, width=128, text_len=24)
    assert (kwargs["hidden_states"].shape[1], kwargs["encoder_hidden_states"].shape[1]) == (32, 24)
    ref = np.asarray(runner(model, None)(**kwargs).sample)

    calls = {"ag": 0, "rs": 0}

    def counted(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    # the dispatch's kernels
    monkeypatch.setattr(ag_kernel, "all_gather_matmul_stream", counted("ag", ag_kernel.all_gather_matmul_stream))
    monkeypatch.setattr(rs_kernel, "matmul_reduce_scatter_stream", counted("rs", rs_kernel.matmul_reduce_scatter_stream))
    site_plan._NOTICED.clear()
    r = runner(model, make_mesh(2), "sp", Config(sp=True, sp_kernel="pallas", sp_rs_kernel="pallas"))
    assert (r.par.ag_impl, r.par.rs_impl, r.par.interpret) == ("pallas", "pallas", True)
    assert r.row_multiple() == 32
    with caplog.at_level(logging.WARNING, logger="difflet_tpu.parallel.site_plan"):
        out = np.asarray(r(**kwargs).sample)
    assert not [rec for rec in caplog.records if "unsupported" in rec.getMessage()], caplog.text
    assert not site_plan._NOTICED, f"a kernel fell back to the ring: {site_plan._NOTICED}"
    # double block: 2 AG (qkv, add_qkv) + 2 AG (ff, ff_context), 4 RS; single block: 1 AG, 1 RS
    assert calls == {"ag": 5, "rs": 5}, calls
    assert out.shape == ref.shape == (1, 32, 16) and np.linalg.norm(ref) > 0
    assert rel(out, ref) <= TOL


def test_schnell_variant_runs_without_guidance():
    """FLUX.1-schnell (no guidance embedder; no diffusers fixture): the fixture weights
    without guidance_embedder in a schnell-config model; one device and SP agree, and
    guidance must be None."""
    c = flux.config_from_diffusers(dict(flux.PRESETS["tiny"], guidance_embeds=False))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: flux.build(c, dtype=jnp.float32, rngs=nnx.Rngs(0))))
    dev, _ = load("flux")
    state = nnx.state(dev)
    state["time_text_embed"].pop("guidance_embedder")
    model = nnx.merge(graphdef, state)
    assert not hasattr(model.time_text_embed, "guidance_embedder")
    kwargs, _ = fixture("flux_pad")
    kwargs = {k: v for k, v in kwargs.items() if k != "guidance"}
    plain = np.asarray(runner(model, None)(**kwargs).sample)
    out = runner(nnx.merge(graphdef, state), make_mesh(2), "sp")(**kwargs).sample
    assert rel(out, plain) <= TOL
    with pytest.raises(ValueError, match="guidance must be None"):
        runner(model, None)(**kwargs, guidance=np.array([3.5], np.float32)).sample


# --------------------------------------------------------------------------
# Mechanisms against the plain model (float64); each removed, the result differs
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain64():
    """The one-device port in float64 on flux and flux_pad (the plain model)."""
    with jax.enable_x64(True):
        model, _ = load("flux", dtype=jnp.float64)
        r = runner(model, None)
        return {case: np.asarray(r(**f64_kwargs(case)).sample) for case in ("flux", "flux_pad")}


def run64(case, tp, mode, **kw):
    with jax.enable_x64(True):
        model, mesh = load(case, tp, dtype=jnp.float64)
        r = runner(model, mesh, mode, **kw)
        return np.asarray(r(**f64_kwargs(case)).sample), r


def test_plain64_matches_diffusers(plain64):
    for case in plain64:
        assert rel(plain64[case], fixture(case)[1]) <= TOL


def test_sp_pad_key_mask_float64(plain64):
    """SP pads each stream (15 -> 16 image, 7 -> 8 text rows at P=2) and masks the pad
    keys; without the mask the pad rows are attended to and the result differs."""
    out, r = run64("flux_pad", 2, "sp")
    assert rel(out, plain64["flux_pad"]) <= TOL64
    with jax.enable_x64(True):
        r.mask_pad_keys = False
        bad = np.asarray(r(**f64_kwargs("flux_pad")).sample)
    assert rel(bad, plain64["flux_pad"]) > 1e-4


def test_sp_refuses_unsplittable_streams_without_padding():
    model, mesh = _model(4, True)
    kwargs, _ = fixture("flux_pad")
    with pytest.raises(ValueError, match=r"cannot split 15 image tokens over tp=4.*multiple of 2\*P = 8"):
        runner(model, mesh, "sp", pad=False)(**kwargs).sample
    # an evenly splitting input runs without padding
    kwargs, ref = fixture("flux")
    assert rel(runner(model, mesh, "sp", pad=False)(**kwargs).sample, ref) <= TOL


def test_single_block_row_order():
    """Rank r holds [txt_r | img_r]; the all-gather ring returns [txt_0, img_0, txt_1, img_1, ...]."""
    order = mmdit.single_stream_order(8, 16, 4)
    assert list(order[:6]) == [0, 1, 8, 9, 10, 11] and list(order[6:12]) == [2, 3, 12, 13, 14, 15]
    assert sorted(order) == list(range(24))
    assert list(mmdit.single_stream_order(8, 16, 1)) == list(range(24))
    n_txt, n_img, D = 8, 16, 8
    joint = np.arange((n_txt + n_img) * D, dtype=np.float32).reshape(1, n_txt + n_img, D)
    par = Parallel(mode="sp", size=4)

    def gathered(txt_r, img_r):
        (y,) = par.column(jnp.concatenate([txt_r, img_r], axis=1), [jnp.eye(D, dtype=jnp.float32)])
        return y

    fn = jax.jit(jax.shard_map(gathered, mesh=make_mesh(4), in_specs=(P(None, TP), P(None, TP)), out_specs=P(),
                               check_vma=False))
    out = fn(joint[:, :n_txt], joint[:, n_txt:])
    np.testing.assert_array_equal(np.asarray(out), joint[:, order])


def test_single_block_tables_follow_row_order_float64(plain64, monkeypatch):
    """SP (P=2) matches the plain model; with the cos/sin rows and mask left in [txt | img]
    order (mechanism removed) the single blocks rotate tokens by other tokens' angles."""
    out, _ = run64("flux", 2, "sp")
    assert rel(out, plain64["flux"]) <= TOL64
    monkeypatch.setattr(mmdit, "single_stream_order", lambda n_txt, n_img, ranks: np.arange(n_txt + n_img))
    bad, _ = run64("flux", 2, "sp")
    assert rel(bad, plain64["flux"]) > 1e-4


def test_split_rope_float64(plain64):
    """Split-halves RoPE (weights permuted at load, tables permuted per forward) equals
    interleaved RoPE on the checkpoint order; permuted weights rotated as interleaved
    pairs (mechanism removed) differ."""
    with jax.enable_x64(True):
        model, _ = load("flux", split_rope=False, dtype=jnp.float64)
        assert not model.config.split_rope
        interleaved = np.asarray(runner(model, None)(**f64_kwargs("flux")).sample)
        model, _ = load("flux", split_rope=True, dtype=jnp.float64)
        model.config = dataclasses.replace(model.config, split_rope=False)
        bad = np.asarray(runner(model, None)(**f64_kwargs("flux")).sample)
    assert rel(interleaved, plain64["flux"]) <= TOL64
    assert rel(bad, plain64["flux"]) > 1e-4


def test_split_rope_permutes_q_k_and_their_norms():
    c = flux.config_from_diffusers(flux.PRESETS["tiny"])
    abstract = nnx.eval_shape(lambda: flux.build(c, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    km = flux.key_map(c, abstract)
    permuted = {p for p, k in km.items() if k.perm is not None}
    expect = set()
    for m in ("to_q", "to_k", "add_q_proj", "add_k_proj"):
        expect |= {f"transformer_blocks.attn.{m}.kernel", f"transformer_blocks.attn.{m}.bias"}
    for m in ("to_q", "to_k"):
        expect |= {f"single_transformer_blocks.attn.{m}.kernel", f"single_transformer_blocks.attn.{m}.bias"}
    for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        expect.add(f"transformer_blocks.attn.{n}.scale")
    for n in ("norm_q", "norm_k"):
        expect.add(f"single_transformer_blocks.attn.{n}.scale")
    assert permuted == expect
    assert km["transformer_blocks.attn.to_q.kernel"].perm[:8] == (0, 2, 4, 6, 8, 10, 12, 14)
    assert km["single_transformer_blocks.attn.norm_k.scale"].perm[8] == 1
    plain = flux.key_map(dataclasses.replace(c, split_rope=False), abstract)
    assert all(k.perm is None for k in plain.values())


def test_proj_out_key_map_slices_the_packed_weight():
    """proj_out.attn / proj_out.mlp are input features [0, D) / [D, 5D) of the one
    diffusers weight, the bias with the MLP part; both row-parallel in PLAN."""
    c = flux.config_from_diffusers(flux.PRESETS["tiny"])
    abstract = nnx.eval_shape(lambda: flux.build(c, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    km = flux.key_map(c, abstract)
    attn, mlp = km["single_transformer_blocks.proj_out.attn.kernel"], km["single_transformer_blocks.proj_out.mlp.kernel"]
    assert attn.template == mlp.template == "single_transformer_blocks.{i}.proj_out.weight"
    assert (attn.in_range, mlp.in_range) == ((0, 64), (64, 320))
    assert km["single_transformer_blocks.proj_out.mlp.bias"].template == "single_transformer_blocks.{i}.proj_out.bias"
    assert "single_transformer_blocks.proj_out.attn.bias" not in km
    assert flux.PLAN["single_transformer_blocks.proj_out.attn"] == flux.PLAN["single_transformer_blocks.proj_out.mlp"] \
        == "row"


def test_packed_proj_out_float64(plain64):
    """TP (P=4): each rank's proj_out.attn / proj_out.mlp rows are the inputs it holds
    (its heads, its MLP columns), summed in one all-reduce: matches the plain model.
    With contiguous 1/P row shards of the packed weight (mechanism removed) it differs."""
    out, r = run64("flux", 4, "tp")
    assert rel(out, plain64["flux"]) <= TOL64
    with jax.enable_x64(True):
        testing.contiguous_proj_out_rows(r.model, 4)
        bad = np.asarray(runner(r.model, r.mesh, "tp")(**f64_kwargs("flux")).sample)
    assert rel(bad, plain64["flux"]) > 1e-4


def test_runner_leaves_params_alone_cache_restores_on_other_mesh(tmp_path, monkeypatch):
    """Nothing P-dependent is baked into the parameters: a model loaded on 4 devices and
    run by a 4-device SP Runner keeps its loaded values; saved then (the orbax cache of
    load_transformer) and restored onto 2 devices without reading the safetensors, it
    matches diffusers under SP and TP on 2 devices."""
    from difflet_tpu.loading import cache as checkpoint

    path = FIXTURES / "flux" / "transformer"
    mesh4 = make_mesh(4)
    model = loading.load_transformer(path, dtype=jnp.float32, mesh=mesh4, config=Config())
    loaded = {p: np.asarray(v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    kwargs, ref = fixture("flux")
    assert rel(runner(model, mesh4, "sp")(**kwargs).sample, ref) <= TOL
    after = {p: np.asarray(v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert sorted(after) == sorted(loaded)
    for p in loaded:
        np.testing.assert_array_equal(after[p], loaded[p], err_msg=str(p))
    port = models.spec_for_class("FluxTransformer2DModel")
    assert checkpoint.save(tmp_path, path, port, model.config, model, dtype=jnp.float32) is not None

    def no_read(*a, **k):
        raise AssertionError("read the safetensors instead of restoring the cache")

    monkeypatch.setattr(loading.Checkpoint, "read", no_read)
    mesh2 = make_mesh(2)
    restored = loading.load_transformer(path, dtype=jnp.float32, mesh=mesh2, config=Config(), cache_dir=tmp_path)
    kernel = restored.single_transformer_blocks.proj_out.mlp.kernel.get_value()
    assert kernel.sharding.mesh.shape[TP] == 2
    for mode in ("sp", "tp"):
        assert rel(runner(restored, mesh2, mode)(**kwargs).sample, ref) <= TOL, mode


def test_timestep_cast_to_model_dtype_before_x1000():
    """diffusers: timestep.to(dtype) * 1000 -- in bf16 the timestep is rounded first, and
    the product rounded to bf16 again; then the sinusoid in float32."""
    t = np.array([0.7531, 0.3], np.float32)
    got = tf.timestep_proj(t, jnp.bfloat16)
    t_bf16 = (t.astype(jnp.bfloat16) * np.asarray(1000, jnp.bfloat16)).astype(np.float32)
    assert t_bf16[0] == 752.0  # bf16(0.7531) = 0.75390625, * 1000 = 753.90625 -> bf16 752
    freqs = np.exp(-np.log(10000.0) * np.arange(128) / 128)
    want = np.concatenate([np.cos(t_bf16[:, None] * freqs), np.sin(t_bf16[:, None] * freqs)], -1)
    assert np.abs(got - want).max() < 1e-3  # float32 vs float64 angles up to 752 rad
    no_cast = tf.timestep_proj(t, jnp.float32)  # mechanism removed: 753.1
    assert np.abs(no_cast - got).max() > 0.1


def test_timestep_sinusoid_is_the_layers_policy():
    """FLUX's sinusoid is `layers.get_timestep_embedding` of the scaled timestep (the one
    float32 rounding policy of every port; tests/test_layers.py checks it)."""
    t = np.array([1.0, 0.75], np.float32)
    got = tf.timestep_proj(t, jnp.float32)
    np.testing.assert_array_equal(got, np.asarray(tf.get_timestep_embedding(t * np.float32(1000))))


# --------------------------------------------------------------------------
# Errors before compilation, config, FLOPs
# --------------------------------------------------------------------------

def test_input_errors_before_compilation():
    model, _ = _model(None, True)
    r = flux.Runner(model, None, Config())
    kwargs, _ = fixture("flux")
    bad = [
        (dict(hidden_states=kwargs["hidden_states"][..., :8]), r"hidden_states: shape \(1, 24, 8\)"),
        (dict(encoder_hidden_states=kwargs["encoder_hidden_states"][..., :16]), "joint_attention_dim=32"),
        (dict(pooled_projections=kwargs["pooled_projections"][:, :4]), "pooled_projections"),
        (dict(img_ids=kwargs["img_ids"][:5]), r"img_ids: shape \(5, 3\), expected \(24, 3\)"),
        (dict(txt_ids=kwargs["txt_ids"][:, :2]), "txt_ids"),
        (dict(timestep=np.zeros((3,), np.float32)), "timestep: shape"),
        (dict(guidance=None), "guidance is required"),
        (dict(controlnet_block_samples=[np.zeros(1)]), "ControlNet"),
        (dict(joint_attention_kwargs={"scale": 1.0}), "joint_attention_kwargs"),
    ]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            r(**{**kwargs, **change}).sample
    with pytest.raises(ValueError, match="4 heads do not divide over tp=3"):
        flux.Runner(model, make_mesh(3), Config(), mode="tp")


def test_config_presets_and_errors():
    dev = flux.config_from_diffusers(flux.PRESETS["flux.1-dev"])
    schnell = flux.config_from_diffusers(flux.PRESETS["flux.1-schnell"], split_rope=False)
    assert dev.guidance_embeds and not schnell.guidance_embeds and not schnell.split_rope
    assert (dev.inner_dim, dev.mlp_hidden_dim, dev.out_features) == (3072, 12288, 64)
    import json

    tiny = json.loads((FIXTURES / "flux" / "transformer" / "config.json").read_text())
    assert flux.config_from_diffusers(tiny) == flux.config_from_diffusers(flux.PRESETS["tiny"])
    for change, msg in [(dict(axes_dims_rope=[4, 6, 8]), "axes_dims_rope"),
                        (dict(axes_dims_rope=[5, 5, 6]), "even"),
                        (dict(num_layers=0), "num_layers"),
                        (dict(qk_norm="layer_norm"), "qk_norm"),
                        (dict(_class_name="WanTransformer3DModel"), "_class_name")]:
        with pytest.raises(ValueError, match=msg):
            flux.config_from_diffusers(dict(flux.PRESETS["tiny"], **change))


@pytest.mark.parametrize("preset,count", [("flux.1-dev", 11_901_408_320), ("flux.1-schnell", 11_891_178_560)])
def test_released_parameter_count(preset, count):
    c = flux.config_from_diffusers(flux.PRESETS[preset])
    abstract = nnx.eval_shape(lambda: flux.build(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert sum(int(np.prod(s)) for s in loading.param_paths(abstract).values()) == count


def test_flops_match_the_brief():
    c = flux.config_from_diffusers(flux.PRESETS["flux.1-dev"])
    f = flux.flops(c, flux.example_inputs(c, height=1024, width=1024, abstract=True))
    assert abs(f / 74.38e12 - 1) < 2e-3


def test_example_inputs_run():
    c = flux.config_from_diffusers(flux.PRESETS["tiny"])
    kwargs = flux.example_inputs(c, height=64, width=96, text_len=8)
    assert kwargs["hidden_states"].shape == (1, 24, 16) and kwargs["img_ids"][7].tolist() == [0, 1, 1]
    model, _ = _model(None, True)
    assert runner(model, None)(**kwargs).sample.shape == (1, 24, 16)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_embedders_over_padded_rows(batch):
    """The model runs its embedders over `few_rows` (rows zero-padded to a multiple of 8):
    the first rows are the inputs, and temb of the padded rows sliced back is temb of
    the given rows (float32, against the embedders run on the rows alone and a float64
    numpy pass of one linear)."""
    dim = 16
    emb = tf.CombinedTimestepGuidanceTextProjEmbeddings(dim, 12, dtype=jnp.float32, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(4), 3)
    t, g = (jax.random.normal(k, (batch, 256)) for k in keys[:2])
    pooled = jax.random.normal(keys[2], (batch, 12))
    padded = few_rows(t)
    assert padded.shape[0] % MATMUL_ROWS == 0 and padded.shape[0] >= batch
    np.testing.assert_array_equal(np.asarray(padded[:batch]), np.asarray(t))
    got = emb(padded, few_rows(g), few_rows(pooled))[:batch]
    np.testing.assert_allclose(np.asarray(got), np.asarray(emb(t, g, pooled)), rtol=1e-5, atol=1e-5)
    lin = emb.timestep_embedder.linear_1
    ref = np.asarray(t, np.float64) @ np.asarray(lin.kernel[...], np.float64) + np.asarray(lin.bias[...], np.float64)
    np.testing.assert_allclose(np.asarray(lin(padded)[:batch]), ref, rtol=1e-5, atol=1e-5)


