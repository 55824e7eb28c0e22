"""HunyuanVideo port: SP with dense single blocks; the Pallas kernels' fallback and
interpret-mode runs; the model-specific mechanisms against the plain model
(float64), each shown to matter; input errors before compilation; config, presets,
FLOPs.

Fixture parity (one device, TP and SP on 2 and 4 devices, sp-xla, SP == TP at
padded counts) and the deviceless v5e:2x2 compile of the released config are in
the conformance suite (tests/test_conformance.py), as for every port; its
`deviceless_report("hunyuan_video", dict(height=720, width=1280, frames=129), ["sp"])`
measures other shapes (docs/models/hunyuan_video.md).

Helpers for this model live here (fixtures, cached loads and runs).
"""

import functools
import json
import logging
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from difflet_tpu import testing
from difflet_tpu.testing import fixture_sample, load_fixture_transformer, rel_l2
from difflet_tpu import loading
from difflet_tpu.config import Config
from difflet_tpu.layers import mmdit
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.models import hunyuan_video as hv
from difflet_tpu.models.hunyuan_video import model as hv_model
from difflet_tpu.models.hunyuan_video import rope as hv_rope

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
TOL = 1e-5


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------

rel = rel_l2


def fixture(case):
    """(diffusers forward kwargs, expected sample) of a fixture case."""
    return fixture_sample(FIXTURES / case)


def load(case, tp=None, *, split_rope=True, dtype=jnp.float32):
    return load_fixture_transformer(FIXTURES / case, tp or None, split_rope=split_rope, dtype=dtype)[0]


@functools.lru_cache(maxsize=None)
def _model32(case, tp):
    return load(case, tp)


@functools.lru_cache(maxsize=None)
def runner32(case, tp=None, mode=None, config=Config()):
    """A float32 Runner of a fixture case (cached with its compiled step)."""
    mesh = make_mesh(tp) if tp else None
    return hv.Runner(_model32(case, tp), mesh, config, mode=mode)


@functools.lru_cache(maxsize=None)
def run32(case, tp=None, mode=None, config=Config()):
    """float32 output of a fixture case (cached: the SP-vs-TP test reuses parity runs)."""
    kwargs, _ = fixture(case)
    return np.asarray(runner32(case, tp, mode, config)(**kwargs).sample)


def run(model, kwargs, tp=None, mode=None, config=Config()):
    mesh = make_mesh(tp) if tp else None
    return np.asarray(hv.Runner(model, mesh, config, mode=mode)(**kwargs).sample)


# --------------------------------------------------------------------------
# Parity with the diffusers fixtures (float32) beyond the conformance suite
# --------------------------------------------------------------------------

def test_sp_dense_single_blocks():
    """SP with the single blocks run TP (`Config(sp_single=False)`) on 4 devices."""
    case = "hunyuan_video"
    _, ref = fixture(case)
    assert rel(run32(case, 4, "sp", Config(sp_single=False)), ref) <= TOL


def test_pallas_kernels_fall_back_at_fixture_sizes(caplog):
    """Config(sp_kernel="pallas", sp_rs_kernel="pallas") on the fixture: the kernels
    reject its widths (64, not a multiple of 128), the ring runs, the result holds."""
    case = "hunyuan_video"
    _, ref = fixture(case)
    with caplog.at_level(logging.WARNING, logger="difflet_tpu.parallel.collective_matmul"):
        out = run32(case, 2, "sp", Config(sp_kernel="pallas", sp_rs_kernel="pallas"))
    assert rel(out, ref) <= TOL


def kernel_sized_config():
    """Widths the Pallas kernels take at P=2 (K, N multiples of 128), 32 + 32 tokens."""
    return hv.config_from_diffusers(dict(
        hv.PRESETS["tiny"], num_attention_heads=2, attention_head_dim=128, rope_axes_dim=[32, 48, 48],
        text_embed_dim=32, pooled_projection_dim=16, num_layers=1, num_single_layers=1, num_refiner_layers=1))


def random_inputs(c, shape, n_txt, valid, seed=0, batch=1):
    rng = np.random.default_rng(seed)
    mask = (np.arange(n_txt)[None] < np.asarray(valid).reshape(-1, 1)).astype(np.float32)
    out = dict(hidden_states=rng.standard_normal((batch, c.in_channels, *shape)),
               timestep=np.full((batch,), 500.0, np.float32),
               encoder_hidden_states=rng.standard_normal((batch, n_txt, c.text_embed_dim)),
               encoder_attention_mask=np.broadcast_to(mask, (batch, n_txt)).copy(),
               pooled_projections=rng.standard_normal((batch, c.pooled_projection_dim)))
    if c.guidance_embeds:
        out["guidance"] = np.full((batch,), 6000.0, np.float32)
    return {k: v.astype(np.float32) for k, v in out.items()}


@pytest.mark.slow
def test_pallas_kernels_interpret_mode(caplog):
    """The Pallas all-gather and reduce-scatter kernels (TPU interpret mode, 2 CPU
    devices) inside the whole model, at widths they support: no fallback, and the
    SP result equals one device."""
    c = kernel_sized_config()
    model = hv.build(c, dtype=jnp.float32, rngs=nnx.Rngs(0))
    kwargs = random_inputs(c, (2, 8, 8), 32, 20)
    ref = run(model, kwargs)
    with caplog.at_level(logging.WARNING, logger="difflet_tpu.parallel.collective_matmul"):
        out = run(model, kwargs, 2, "sp", Config(sp_kernel="pallas", sp_rs_kernel="pallas"))
    assert not [r for r in caplog.records if "unsupported" in r.getMessage()], caplog.text
    assert rel(out, ref) <= TOL


# --------------------------------------------------------------------------
# Model-specific mechanisms against the plain model (float64)
# --------------------------------------------------------------------------

def test_padded_text_never_changes_the_output():
    """Replacing the padded text embeddings (±100-scale noise) leaves the output
    bit-identical, on one device and under SP on 4 devices (both streams padded)."""
    case = "hunyuan_video_masks"
    kwargs, _ = fixture(case)
    noisy = dict(kwargs)
    ehs = kwargs["encoder_hidden_states"].copy()
    pad = kwargs["encoder_attention_mask"] == 0
    ehs[pad] = 100.0 * np.random.default_rng(1).standard_normal(ehs[pad].shape)
    noisy["encoder_hidden_states"] = ehs
    np.testing.assert_array_equal(np.asarray(runner32(case)(**noisy).sample), run32(case))
    np.testing.assert_array_equal(np.asarray(runner32(case, 4, "sp")(**noisy).sample), run32(case, 4, "sp"))


@pytest.fixture(scope="module")
def f64_masks():
    """The masks case in float64: its weights, inputs and the plain (one device, no
    padding, dense single blocks) output."""
    kwargs, ref32 = fixture("hunyuan_video_masks")
    with jax.enable_x64(True):
        model = load("hunyuan_video_masks", dtype=jnp.float64)
        plain = run(model, kwargs)
    assert plain.dtype == np.float64 and rel(plain, ref32) <= TOL
    return model, kwargs, plain


def test_sp_padding_and_single_stream_rows_float64(f64_masks):
    """SP on 2 devices, float64, against the plain model: 45 image tokens padded to 48
    and 10 text tokens to 12; the single blocks run on each rank's [img_r | txt_r]
    (24 + 6 rows) with the tables and mask in the gathered order. Also the dense
    single blocks (TP on the gathered sequence)."""
    model, kwargs, plain = f64_masks
    with jax.enable_x64(True):
        mesh_model = load("hunyuan_video_masks", 2, dtype=jnp.float64)
        runner = hv.Runner(mesh_model, make_mesh(2), Config(), mode="sp")
        geom = runner.geometry(**kwargs)
        assert (geom.n_img_pad, geom.n_txt_pad, geom.n_joint // 2) == (48, 12, 30)
        assert rel(runner(**kwargs).sample, plain) <= 1e-12
        assert rel(run(mesh_model, kwargs, 2, "sp", Config(sp_single=False)), plain) <= 1e-12


def test_without_pad_key_mask_sp_differs(f64_masks, monkeypatch):
    """Mechanism removed: every key valid (pad image rows, pad and masked text rows)."""
    _, kwargs, plain = f64_masks
    monkeypatch.setattr(hv_model, "joint_key_mask",
                        lambda mask, geom: jnp.ones((mask.shape[0], geom.n_joint), bool))
    with jax.enable_x64(True):
        out = run(load("hunyuan_video_masks", 2, dtype=jnp.float64), kwargs, 2, "sp")
    assert rel(out, plain) > 1e-3


def test_single_stream_tables_follow_the_gathered_order_float64(f64_masks, monkeypatch):
    """Mechanism removed: the single blocks' RoPE tables and key mask left in joint
    [image | text] order while the gathered rows are [img_0, txt_0, img_1, txt_1]:
    tokens are rotated by other tokens' angles and the wrong keys are masked."""
    _, kwargs, plain = f64_masks
    monkeypatch.setattr(mmdit, "single_stream_order", lambda a, b, ranks: np.arange(a + b))
    with jax.enable_x64(True):
        out = run(load("hunyuan_video_masks", 2, dtype=jnp.float64), kwargs, 2, "sp")
    assert rel(out, plain) > 1e-3


def test_split_rope_matches_interleaved_float64(f64_masks, monkeypatch):
    """q/k rows (+ biases, + q/k norm weights) permuted at load and split-halves
    rotation with permuted tables == diffusers' interleaved RoPE (float64); with the
    tables left interleaved (mechanism removed) the result differs."""
    model, kwargs, plain = f64_masks
    assert model.config.split_rope
    with jax.enable_x64(True):
        interleaved = load("hunyuan_video_masks", split_rope=False, dtype=jnp.float64)
        assert not interleaved.config.split_rope
        assert rel(run(interleaved, kwargs), plain) <= 1e-12
        monkeypatch.setattr(hv_rope.RopeLayout, "table", lambda self, t: t)
        assert rel(run(model, kwargs), plain) > 1e-3


def test_split_rope_permutes_every_q_and_k_that_meets_rope():
    c = hv.config_from_diffusers(hv.PRESETS["tiny"])
    abstract = nnx.eval_shape(lambda: hv.build(c, rngs=nnx.Rngs(0)))
    keys = hv.key_map(c, abstract)
    permuted = {p for p, k in keys.items() if k.perm is not None}
    expect = {f"transformer_blocks.attn.{n}.{leaf}" for n in ("to_q", "to_k", "add_q_proj", "add_k_proj")
              for leaf in ("kernel", "bias")}
    expect |= {f"transformer_blocks.attn.{n}.scale" for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")}
    expect |= {f"single_transformer_blocks.attn.{n}.{leaf}" for n in ("to_q", "to_k") for leaf in ("kernel", "bias")}
    expect |= {f"single_transformer_blocks.attn.{n}.scale" for n in ("norm_q", "norm_k")}
    assert permuted == expect
    plain = hv.key_map(hv.config_from_diffusers(hv.PRESETS["tiny"], split_rope=False), abstract)
    assert all(k.perm is None for k in plain.values())


def test_proj_out_key_map_slices_the_packed_weight():
    """proj_out.attn / proj_out.mlp are input features [0, D) / [D, D+F) of the one
    diffusers weight, the bias with the MLP part; both row-parallel in PLAN."""
    c = hv.config_from_diffusers(hv.PRESETS["tiny"])
    abstract = nnx.eval_shape(lambda: hv.build(c, rngs=nnx.Rngs(0)))
    km = hv.key_map(c, abstract)
    attn = km["single_transformer_blocks.proj_out.attn.kernel"]
    mlp = km["single_transformer_blocks.proj_out.mlp.kernel"]
    assert attn.template == mlp.template == "single_transformer_blocks.{i}.proj_out.weight"
    D, F = c.inner_dim, c.mlp_dim
    assert (attn.in_range, mlp.in_range) == ((0, D), (D, D + F))
    assert km["single_transformer_blocks.proj_out.mlp.bias"].template == "single_transformer_blocks.{i}.proj_out.bias"
    assert "single_transformer_blocks.proj_out.attn.bias" not in km
    assert hv.PLAN["single_transformer_blocks.proj_out.attn"] == hv.PLAN["single_transformer_blocks.proj_out.mlp"] \
        == "row"


def test_packed_proj_out_float64(f64_masks):
    """TP (P=2): each rank's proj_out.attn / proj_out.mlp rows are the inputs it holds
    (its heads, its MLP columns), summed in one all-reduce: matches the plain model.
    With contiguous 1/P row shards of the packed weight (mechanism removed) it differs."""
    _, kwargs, plain = f64_masks
    with jax.enable_x64(True):
        model = load("hunyuan_video_masks", 2, dtype=jnp.float64)
        assert rel(run(model, kwargs, 2, "tp"), plain) <= 1e-12
        testing.contiguous_proj_out_rows(model, 2)
        out = run(model, kwargs, 2, "tp")
    assert rel(out, plain) > 1e-3


def test_runner_leaves_the_model_alone(f64_masks):
    """The Runner places its own copy of the parameters and never changes the model:
    after SP and TP Runners on 2 devices ran it (float64, equal to the plain model),
    the loaded model's parameters keep their paths, values and shardings."""
    _, kwargs, plain = f64_masks
    with jax.enable_x64(True):
        model = load("hunyuan_video_masks", 2, dtype=jnp.float64)
        before = {p: v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        values = {p: np.asarray(v.get_value()) for p, v in before.items()}
        for mode in ("sp", "tp"):
            assert rel(run(model, kwargs, 2, mode), plain) <= 1e-12, mode
        after = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert sorted(after) == sorted(before)
    for p, v in after.items():
        np.testing.assert_array_equal(np.asarray(v.get_value()), values[p], err_msg=str(p))
        assert v.get_value().sharding == before[p].get_value().sharding, p


def refiner_reference(mask, x, q_w, k_w, v_w, heads):
    """diffusers' refiner attention mask, literally: `[B, S, S]` = m[i] & m[j], column 0 True."""
    m = mask.astype(bool)
    full = m[:, None, :] & m[:, :, None]
    full[:, :, 0] = True
    B, S, _ = x.shape
    q, k, v = ((x @ w).reshape(B, S, heads, -1) for w in (q_w, k_w, v_w))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = np.where(full[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, S, -1)


def test_refiner_positional_mask_float64(monkeypatch):
    """The token refiner's attention against diffusers' explicit `[B, S, S]` mask
    (float64), with a mask whose first token is padding and one with a hole; without
    column 0 forced valid, or with padded query rows attending like valid ones
    (mechanism removed), it differs."""
    from difflet_tpu.parallel.modes import Parallel

    c = hv.config_from_diffusers(hv.PRESETS["tiny"])
    mask = np.array([[0, 1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0]], np.float32)
    with jax.enable_x64(True):
        attn = hv_model.RefinerAttention(c, dtype=jnp.float64, rngs=nnx.Rngs(3))
        x = np.random.default_rng(0).standard_normal((2, 7, c.inner_dim))
        ws = [np.asarray(l.kernel[...]) for l in (attn.to_q, attn.to_k, attn.to_v)]
        bs = [np.asarray(l.bias[...]) for l in (attn.to_q, attn.to_k, attn.to_v)]
        assert not any(b.any() for b in bs)  # zero-initialised biases: x @ w is the projection
        ref = refiner_reference(mask, x, *ws, c.num_attention_heads)
        ref = ref @ np.asarray(attn.to_out["0"].kernel[...])
        m = jnp.asarray(mask != 0)

        def call(row_valid, key_valid):
            return np.asarray(attn(Parallel(), jnp.asarray(x), row_valid, key_valid))

        assert rel(call(m, m.at[:, 0].set(True)), ref) <= 1e-12
        assert rel(call(m, m), ref) > 1e-3                                   # column 0 not forced
        assert rel(call(jnp.ones_like(m), m.at[:, 0].set(True)), ref) > 1e-3  # padded rows as valid


def test_token_replace_modulates_first_frame_rows():
    """Without the t=0 modulation of the first-frame tokens the token_replace
    fixture is not reproduced (the mechanism matters at these sizes)."""
    case = "hunyuan_video_i2v_token_replace"
    kwargs, ref = fixture(case)
    plain = loading.load_transformer(FIXTURES / case / "transformer", dtype=jnp.float32,
                                     image_condition_type=None)
    assert not plain.config.token_replace
    assert rel(run(plain, kwargs), ref) > 1e-3


# --------------------------------------------------------------------------
# Errors before compilation, config, presets, FLOPs
# --------------------------------------------------------------------------

def test_input_errors_before_compilation():
    case = "hunyuan_video"
    kwargs, _ = fixture(case)
    runner = hv.Runner(_model32(case, None))
    bad = [
        (dict(hidden_states=kwargs["hidden_states"][:, :3]), "in_channels=4"),
        (dict(hidden_states=kwargs["hidden_states"][..., :11]), "multiples of the patch"),
        (dict(encoder_hidden_states=kwargs["encoder_hidden_states"][..., :20]), "encoder_hidden_states"),
        (dict(encoder_attention_mask=kwargs["encoder_attention_mask"][:, :9]), "encoder_attention_mask"),
        (dict(pooled_projections=kwargs["pooled_projections"][:, :5]), "pooled_projections"),
        (dict(guidance=None), "guidance is required"),
        (dict(timestep=np.zeros((3,), np.float32)), "timestep"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            runner(**{**kwargs, **change}).sample
    assert not runner._steps  # nothing was compiled


def test_sp_errors_before_compilation():
    case = "hunyuan_video_masks"
    kwargs, _ = fixture(case)
    runner = hv.Runner(_model32(case, 4), make_mesh(4), Config(), mode="sp", pad=False)
    with pytest.raises(ValueError, match=r"SP cannot split 45 image tokens.*multiple of 2\*P = 8"):
        runner(**kwargs).sample
    c = hv.config_from_diffusers(dict(hv.PRESETS["tiny"], num_attention_heads=3, attention_head_dim=16))
    abstract = nnx.eval_shape(lambda: hv.build(c, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="3 heads do not divide over tp=2"):
        hv.Runner(abstract, make_mesh(2), Config(), mode="sp")


def test_config_presets_and_errors():
    for name, cfg in hv.PRESETS.items():
        c = hv.config_from_diffusers(cfg)
        assert sum(c.rope_axes_dim) == c.attention_head_dim, name
    c = hv.config_from_diffusers(hv.PRESETS["hunyuan-video"])
    assert (c.inner_dim, c.mlp_dim, c.num_layers, c.num_single_layers) == (3072, 12288, 20, 40)
    assert hv.config_from_diffusers(hv.PRESETS["hunyuan-video-i2v-latent-concat"]).in_channels == 33
    assert hv.config_from_diffusers(hv.PRESETS["hunyuan-video-i2v-token-replace"]).token_replace
    tiny = json.loads((FIXTURES / "hunyuan_video" / "transformer" / "config.json").read_text())
    assert hv.config_from_diffusers(tiny) == hv.config_from_diffusers(hv.PRESETS["tiny"])
    with pytest.raises(ValueError, match="'qk_norm'|qk_norm"):
        hv.config_from_diffusers({**tiny, "qk_norm": "layer_norm"})
    with pytest.raises(ValueError, match="'frobnicate'"):
        hv.config_from_diffusers({**tiny, "frobnicate": 1})
    with pytest.raises(ValueError, match="image_condition_type"):
        hv.config_from_diffusers({**tiny, "image_condition_type": "other"})


def test_released_parameter_count():
    c = hv.config_from_diffusers(hv.PRESETS["hunyuan-video"])
    abstract = nnx.eval_shape(lambda: hv.build(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(abstract, nnx.Param)))
    assert n == 12_821_012_544  # diffusers HunyuanVideoTransformer3DModel(**config) on the meta device


def test_flops_match_the_brief():
    c = hv.config_from_diffusers(hv.PRESETS["hunyuan-video"])
    small = hv.example_inputs(c, height=320, width=512, frames=61)
    assert small["hidden_states"].shape == (1, 16, 16, 40, 64)
    assert abs(hv.flops(c, small) / 223.99e12 - 1) < 1e-3
    assert hv.latent_shape(c, 720, 1280, 129) == (1, 16, 33, 90, 160)
    big = dict(hidden_states=jax.ShapeDtypeStruct((1, 16, 33, 90, 160), jnp.bfloat16),
               encoder_hidden_states=jax.ShapeDtypeStruct((1, 256, 4096), jnp.bfloat16))
    assert abs(hv.flops(c, big) / 12068.6e12 - 1) < 1e-3
