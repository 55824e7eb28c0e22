"""Qwen-Image port (difflet_tpu.models.qwen_image), beyond the conformance suite's parity
(tests/test_conformance.py): split RoPE off, SP == TP with padding; the text mask (masked text keys
bit-irrelevant, a masked tail equal to a shorter prompt: true CFG as one batch-2 call),
the SP pad-key mask, zero_cond_t and the RoPE positions each shown to matter; config
refusals and input errors before compilation; the QwenImagePipeline schedule against
diffusers' arrays.

Compiles use XLA's CPU optimisation level 0 (Runner(compiler_options=...)) to keep the
file fast; the numbers do not depend on it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from difflet_tpu.parallel import collective_matmul as cm
from difflet_tpu.layers import rope as shared_rope
from difflet_tpu import loading
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.parallel.modes import Parallel
from difflet_tpu.models import qwen_image as qi
from difflet_tpu.models.qwen_image import rope
from difflet_tpu.pipeline.denoise import CompileCounter
from difflet_tpu.testing import fixture_sample, load_fixture_transformer, rel_l2

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
FAST = {"xla_backend_optimization_level": 0}
TOL = 1e-5

rel = rel_l2


def fixture(case):
    return fixture_sample(FIXTURES / case)


@functools.lru_cache(maxsize=None)
def load(case, tp=None, split_rope=True):
    return load_fixture_transformer(FIXTURES / case, tp, split_rope=split_rope)


def runner(model, mesh, mode=None, **kw):
    return qi.Runner(model, mesh, Config(), mode=mode, compiler_options=FAST, **kw)


@functools.lru_cache(maxsize=None)
def _runner(case, tp, mode, split_rope=True):
    return runner(*load(case, tp, split_rope), mode)


@functools.lru_cache(maxsize=None)
def run(case, tp=None, mode=None, split_rope=True):
    return np.asarray(_runner(case, tp, mode, split_rope)(**fixture(case)[0]).sample)


# --------------------------------------------------------------------------
# Parity with diffusers (float32)
# --------------------------------------------------------------------------

# Parity on one device, TP and SP on 2 and 4 devices and sp-xla: tests/test_conformance.py,
# as for every port.

def test_parity_split_rope_off():
    """Interleaved RoPE (DIFFLET_TPU_SPLIT_ROPE=0): checkpoint order, pairwise rotation."""
    _, ref = fixture("qwen_image_edit")
    assert rel(run("qwen_image_edit", split_rope=False), ref) <= TOL
    assert rel(run("qwen_image_edit", 2, "sp", split_rope=False), ref) <= TOL


def test_sp_matches_tp_with_padding():
    """On 4 devices SP pads 15 image + 7 text tokens to 16 + 8 (and 30 edit tokens to 32);
    it equals TP, and the pad rows are cut off again."""
    for case, rows in (("qwen_image_pad", (16, 8)), ("qwen_image_edit", (32, 8))):
        prep = _runner(case, 4, "sp").prepare(fixture(case)[0])
        assert (prep.inputs["hidden_states"].shape[1], prep.inputs["encoder_hidden_states"].shape[1]) == rows
        assert prep.inputs["kv_mask"].shape[-1] == sum(rows)
        sp = run(case, 4, "sp")
        assert sp.shape == fixture(case)[1].shape
        assert rel(sp, run(case, 4, "tp")) <= TOL


@pytest.mark.parametrize("site,rows,k,n,heads,expect", [
    ("ag", 32, 3072, 3 * 768, True, "pallas"),   # text add_q/k/v_proj: the kernel reads the layer in place
    ("ag", 32, 3072, 3072, False, "xla"),        # text txt_mlp.net.0.proj
    ("rs", 32, 3072, 3072, False, "xla"),        # text txt_mlp.net.2 (the JAX ring would run)
    ("ag", 1024, 3072, 3 * 768, True, "pallas"),  # image to_q/k/v
    ("rs", 1024, 3072, 3072, False, "jax"),      # image img_mlp.net.2: compute-bound hops
])
def test_sites_at_1024px_on_v5e(site, rows, k, n, heads, expect):
    """The shared per-site rule (`parallel.site_plan.plain_collective_pays`) at the released config,
    1024x1024 with 128 prompt tokens on v5e:2x2: the text stream's MLP (32 rows a rank)
    runs on plain collectives, its attention linears and the image stream on the rings."""
    x = jax.ShapeDtypeStruct((1, rows if site == "ag" else 4 * rows, k), jnp.bfloat16)
    w = cm.LayerWeight(jax.ShapeDtypeStruct((60, k, n), jnp.bfloat16), jnp.int32(0))
    par = Parallel(mode="sp", size=4, ag_impl="pallas", rs_impl="auto", chip="v5e")
    assert (par.column_plan(x, [w], heads=heads) if site == "ag" else par.row_plan([(x, w)])).impl == expect


# --------------------------------------------------------------------------
# The text mask
# --------------------------------------------------------------------------

def _with_masked_text_replaced(kwargs, scale=100.0, seed=7):
    ehs = np.array(kwargs["encoder_hidden_states"])
    masked = np.asarray(kwargs["encoder_hidden_states_mask"]) == 0
    ehs[masked] = scale * np.random.default_rng(seed).standard_normal((int(masked.sum()), ehs.shape[-1]))
    return {**kwargs, "encoder_hidden_states": ehs.astype(np.float32)}


@pytest.mark.parametrize("tp, mode", [(None, None), (4, "tp"), (4, "sp")])
def test_masked_text_keys_are_bit_irrelevant(tp, mode):
    """qwen_image's second item has text mask [1, 1, 1, 0, 1, 1, 0, 0] (a hole and a tail):
    replacing its masked tokens by 100-scale noise leaves every output bit unchanged, as in
    diffusers (meta.json sanity: max abs diff 0); dropping the mask changes the output."""
    kwargs, ref = fixture("qwen_image")
    assert np.asarray(kwargs["encoder_hidden_states_mask"])[1].tolist() == [1, 1, 1, 0, 1, 1, 0, 0]
    r = _runner("qwen_image", tp, mode)
    base = np.asarray(r(**kwargs).sample)
    changed = np.asarray(r(**_with_masked_text_replaced(kwargs)).sample)
    assert np.array_equal(base, changed)
    unmasked = np.asarray(r(**{**kwargs, "encoder_hidden_states_mask": None}).sample)
    assert rel(unmasked[0], base[0]) <= 1e-6  # item 0: every token valid either way (another program)
    assert rel(unmasked[1], ref[1]) > 1e-3


def test_masked_tail_equals_the_shorter_prompt():
    """True CFG runs the negative and positive prompts as one batch-2 call, the shorter one
    padded and masked: a masked tail gives the output of the unpadded prompt (the text RoPE
    positions of the valid tokens do not move), to float32 rounding."""
    kwargs, _ = fixture("qwen_image_edit")
    mask = np.asarray(kwargs["encoder_hidden_states_mask"])
    assert mask[1].tolist() == [1] * 6 + [0] * 2
    r = _runner("qwen_image_edit", None, None)
    full = np.asarray(r(**kwargs).sample)
    one = {k: (v[1:] if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    short = {**one, "encoder_hidden_states": one["encoder_hidden_states"][:, :6], "encoder_hidden_states_mask": None}
    assert rel(np.asarray(r(**short).sample), full[1:]) <= 1e-6


def test_sp_pad_keys_are_masked():
    """SP on 4 devices pads qwen_image_pad's streams (15 -> 16 image, 7 -> 8 text rows, no
    text mask): the pad keys are masked; attended to, the result differs."""
    _, ref = fixture("qwen_image_pad")
    model, mesh = load("qwen_image_pad", 4)
    r = runner(model, mesh, "sp")
    r.mask_pad_keys = False
    bad = np.asarray(r(**fixture("qwen_image_pad")[0]).sample)
    assert rel(run("qwen_image_pad", 4, "sp"), ref) <= TOL
    assert rel(bad, ref) > 1e-4


# --------------------------------------------------------------------------
# zero_cond_t, additional_t_cond, RoPE positions
# --------------------------------------------------------------------------

def test_zero_cond_t_modulates_the_condition_image_with_t0():
    """qwen_image_edit and its zero_cond_t twin share weights and inputs; run without the
    flag, the twin's model reproduces qwen_image_edit, not its own fixture: the flag (t = 0
    modulation of the 6 condition-image tokens, which reaches every row through the joint
    attention) is the whole difference."""
    kw_edit, ref_edit = fixture("qwen_image_edit")
    kw_zero, ref_zero = fixture("qwen_image_edit_zero_cond_t")
    for k in kw_edit:
        assert np.array_equal(np.asarray(kw_edit[k]), np.asarray(kw_zero[k])), k
    model, _ = load("qwen_image_edit_zero_cond_t")
    assert model.config.zero_cond_t
    prep = runner(model, None).prepare(kw_zero)
    assert prep.inputs["cond_rows"].tolist() == [False] * 24 + [True] * 6
    off = nnx.merge(*nnx.split(model))
    off.config = dataclasses.replace(model.config, zero_cond_t=False)
    out = np.asarray(runner(off, None)(**kw_zero).sample)
    assert rel(out, ref_edit) <= TOL
    assert rel(out, ref_zero) > 1e-3
    assert rel(ref_edit, ref_zero) > 1e-3


def test_additional_t_cond_picks_an_embedding_row():
    kwargs, ref = fixture("qwen_image_layered")
    assert np.asarray(kwargs["additional_t_cond"]).tolist() == [0, 1]
    r = _runner("qwen_image_layered", None, None)
    swapped = np.asarray(r(**{**kwargs, "additional_t_cond": np.array([1, 0])}).sample)
    assert rel(swapped, ref) > 1e-3


def test_rope_positions():
    """Centred height/width per shape, frame = shape index, text after the largest half
    extent (Layer3D: the condition image at frame -1, text after the layer count too)."""
    pos, max_vid = rope.image_positions([(1, 3, 4)])
    assert max_vid == 2
    assert pos[:, 0].tolist() == [0] * 12
    assert pos[:, 1].tolist() == [-2] * 4 + [-1] * 4 + [0] * 4
    assert pos[:, 2].tolist() == [-2, -1, 0, 1] * 3
    pos, max_vid = rope.image_positions([(1, 4, 6), (1, 2, 3)])
    assert max_vid == 3 and pos[24:, 0].tolist() == [1] * 6 and pos[24:, 1].tolist() == [-1] * 3 + [0] * 3
    pos, max_vid = rope.image_positions([(1, 2, 2), (1, 2, 2), (1, 2, 2), (1, 2, 2)], layer3d=True)
    assert max_vid == 3 and pos[:, 0].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [-1] * 4
    # the tables: text row j rotates by max_vid + j on every axis, pad rows are identity
    c = qi.config_from_diffusers(qi.PRESETS["tiny"], split_rope=False)
    cos, sin = qi.joint_tables(c, ((1, 3, 4),), 5, 8, 16)
    inv = np.concatenate([shared_rope.rope_inv_freqs(d, 10000) for d in c.axes_dims_rope])
    np.testing.assert_allclose(cos[3, ::2], np.cos(np.float32(2 + 3) * inv), atol=1e-7)
    assert np.all(cos[5:8] == 1) and np.all(sin[5:8] == 0) and np.all(cos[8 + 12:] == 1)


def test_rope_inverse_frequencies_are_torch_float32():
    """1 / pow(10000, arange(0, d, 2) / d) in float32, as torch computes QwenEmbedRope's tables:
    torch 2.13's bits for d = 16 (bit-equal for d in 2..128 when the fixtures were made, and so
    are the float32 angles position * inv)."""
    torch_bits = [0x3f800000, 0x3ea1e89b, 0x3dcccccd, 0x3d0186e3, 0x3c23d70a, 0x3b4f3e38, 0x3a83126f, 0x39a5cb60]
    assert shared_rope.rope_inv_freqs(16, 10000).view(np.uint32).tolist() == torch_bits
    assert shared_rope.rope_inv_freqs(4, 10000).view(np.uint32).tolist() == [0x3f800000, 0x3c23d70a]
    a = rope.angles(np.array([[-4096, 7, 4095]]), (2, 4, 16))
    assert a.dtype == np.float32 and a[0, 0] == -4096.0 and a[0, 2] == np.float32(7) * np.float32(0.01)


def test_layered_refuses_a_multi_frame_condition_image():
    kwargs, _ = fixture("qwen_image_layered")
    r = _runner("qwen_image_layered", None, None)
    hs = np.concatenate([kwargs["hidden_states"], kwargs["hidden_states"][:, -6:]], axis=1)
    with pytest.raises(ValueError, match="condition image .* must have 1 frame"):
        r(**{**kwargs, "hidden_states": hs, "img_shapes": [[(1, 3, 4), (1, 3, 4), (2, 2, 3)]] * 2}).sample


# --------------------------------------------------------------------------
# Config refusals, key map, input errors before compilation
# --------------------------------------------------------------------------

def test_config_flags():
    tiny = qi.PRESETS["tiny"]
    for flag in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
        assert getattr(qi.config_from_diffusers({**tiny, flag: True}), flag)
    c = qi.config_from_diffusers({**tiny, "use_additional_t_cond": True, "use_layer3d_rope": True})
    assert c.use_additional_t_cond and c.use_layer3d_rope
    assert qi.config_from_diffusers({**tiny, "pooled_projection_dim": 768}) == qi.config_from_diffusers(tiny)
    released = qi.config_from_diffusers(qi.PRESETS["qwen-image"])
    assert (released.inner_dim, released.mlp_dim, released.out_features) == (3072, 12288, 64)


@pytest.mark.parametrize("change, message", [
    (dict(guidance_embeds=True), "guidance_embeds: true is not supported: diffusers 0.42.1 builds no guidance"),
    (dict(zero_cond_t=True, use_additional_t_cond=True), "zero_cond_t with use_additional_t_cond is not supported"),
    (dict(zero_cond_t=1), "zero_cond_t: 1 is not a bool"),
    (dict(use_layer3d_rope="yes"), "use_layer3d_rope: 'yes' is not a bool"),
    (dict(pooled_projections_dim=768), "'pooled_projections_dim': not a QwenImageTransformer2DModel config key"),
    (dict(axes_dims_rope=[2, 2, 2]), "sums to 6, not attention_head_dim = 8"),
    (dict(axes_dims_rope=[2, 3, 3]), "positive even numbers"),
    (dict(_class_name="FluxTransformer2DModel"), "is not QwenImageTransformer2DModel"),
    (dict(num_layers=0), "num_layers: 0 is not a positive integer"),
])
def test_config_refusals(change, message):
    with pytest.raises(ValueError, match=message):
        qi.config_from_diffusers({**qi.PRESETS["tiny"], **change})


def test_loader_refuses_guidance_embeds(tmp_path):
    src = FIXTURES / "qwen_image" / "transformer"
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "guidance_embeds": True}))
    (tmp_path / "diffusion_pytorch_model.safetensors").symlink_to(src / "diffusion_pytorch_model.safetensors")
    with pytest.raises(loading.WeightsError, match="guidance_embeds"):
        loading.load_transformer(tmp_path, dtype=jnp.float32)


def test_key_map_renames_the_modulation_and_permutes_q_k():
    c = qi.config_from_diffusers(qi.PRESETS["tiny"])
    abstract = nnx.eval_shape(lambda: qi.build(c, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    km = qi.key_map(c, abstract)
    assert km["transformer_blocks.img_mod.linear.kernel"].template == "transformer_blocks.{i}.img_mod.1.weight"
    assert km["transformer_blocks.txt_mod.linear.bias"].template == "transformer_blocks.{i}.txt_mod.1.bias"
    assert km["txt_norm.scale"].template == "txt_norm.weight"
    permuted = {p for p, k in km.items() if k.perm is not None}
    expect = {f"transformer_blocks.attn.{m}.{leaf}" for m in ("to_q", "to_k", "add_q_proj", "add_k_proj")
              for leaf in ("kernel", "bias")}
    expect |= {f"transformer_blocks.attn.{n}.scale" for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")}
    assert permuted == expect
    plain = qi.key_map(dataclasses.replace(c, split_rope=False), abstract)
    assert all(k.perm is None for k in plain.values())


def _bad_inputs(kwargs):
    hs = kwargs["hidden_states"]
    yield "hidden_states", {**kwargs, "hidden_states": hs[None]}
    yield "hidden_states", {**kwargs, "hidden_states": hs[..., :-1]}
    yield "img_shapes is required", {k: v for k, v in kwargs.items() if k != "img_shapes"}
    yield r"cover 36 image tokens, hidden_states has 30", {**kwargs, "img_shapes": [[(1, 4, 6), (1, 3, 4)]] * 2}
    yield "the items differ", {**kwargs, "img_shapes": [[(1, 4, 6), (1, 2, 3)], [(1, 2, 3), (1, 4, 6)]]}
    yield "img_shapes: .* is not one list", {**kwargs, "img_shapes": [[(1, 4)]] * 2}
    yield "guidance must be None", {**kwargs, "guidance": np.array([3.5, 3.5], np.float32)}
    yield "encoder_hidden_states_mask: shape", {**kwargs, "encoder_hidden_states_mask": np.ones((2, 7))}
    yield "timestep: shape", {**kwargs, "timestep": np.ones((3,), np.float32)}
    yield "additional_t_cond must be None", {**kwargs, "additional_t_cond": np.array([0, 0])}
    yield "controlnet_block_samples", {**kwargs, "controlnet_block_samples": [hs]}
    yield "RoPE table", {**kwargs, "encoder_hidden_states": np.zeros((2, 4094, 24), np.float32),
                         "encoder_hidden_states_mask": None}


def test_input_errors_before_compilation():
    kwargs, _ = fixture("qwen_image_edit")
    before = CompileCounter.count()
    for tp, mode in ((None, None), (4, "sp")):
        model, mesh = load("qwen_image_edit", tp)
        r = runner(model, mesh, mode)
        for message, bad in _bad_inputs(kwargs):
            with pytest.raises(ValueError, match=message):
                r(**bad).sample
        with pytest.raises(TypeError, match="unexpected QwenImageTransformer2DModel forward kwargs"):
            r(**kwargs, txt_seq_lens=[8, 8]).sample
        assert not r._steps
    model, _ = load("qwen_image_layered")
    r = runner(model, None)
    kw, _ = fixture("qwen_image_layered")
    for bad, message in ((None, "additional_t_cond is required"), (np.array([0, 2]), r"integers in \{0, 1\}")):
        with pytest.raises(ValueError, match=message):
            r(**{**kw, "additional_t_cond": bad}).sample
    model, mesh = load("qwen_image_pad", 4)
    with pytest.raises(ValueError, match=r"cannot split 15 image tokens over tp=4.*multiple of 2\*P = 8"):
        runner(model, mesh, "sp", pad=False)(**fixture("qwen_image_pad")[0]).sample
    with pytest.raises(ValueError, match="heads do not divide over tp=3"):
        runner(load("qwen_image_pad")[0], make_mesh(3), "tp")
    assert CompileCounter.count() == before, "an XLA compile ran before the error"


# --------------------------------------------------------------------------
# Pipeline schedule and bench inputs
# --------------------------------------------------------------------------

def test_schedule_matches_diffusers():
    """QwenImagePipeline: sigmas linspace(1, 1/N, N), mu from the image token count over
    [256, 8192] -> [0.5, 0.9], exponential shift, terminal stretch to 0.02 (diffusers 0.42.1's
    FlowMatchEulerDiscreteScheduler arrays, tests/fixtures/qwen_image/schedule.json)."""
    ref = json.loads((FIXTURES / "qwen_image" / "schedule.json").read_text())
    assert ref["diffusers"] == "0.42.1" and ref["scheduler_config"]["shift_terminal"] == 0.02
    for case in ref["cases"]:
        s = qi.schedule(case["steps"], case["image_seq_len"])
        np.testing.assert_allclose(s.timesteps, case["timesteps"], rtol=1e-6, atol=1e-4)
        np.testing.assert_allclose(s.sigmas, case["sigmas"], rtol=1e-6, atol=1e-7)
    assert abs(float(qi.schedule(50, 4096).sigmas[-2]) - 0.02) < 1e-6
    p = qi.SPEC.pipeline
    assert (p.steps, p.guidance, p.guidance_mode, p.timestep_scale) == (50, 4.0, "cfg", 1e-3)


@pytest.mark.parametrize("size, tokens", [(1024, 4096), (1328, 6889)])
def test_example_inputs_at_the_benchmark_sizes(size, tokens):
    c = qi.config_from_diffusers(qi.PRESETS["qwen-image"])
    kw = qi.example_inputs(c, height=size, width=size, batch=2, dtype=np.float32, text_len=16)
    side = size // 16
    assert kw["hidden_states"].shape == (2, tokens, 64) and kw["img_shapes"] == [[(1, side, side)]] * 2
    assert kw["encoder_hidden_states_mask"][0].sum() == 8 and kw["encoder_hidden_states_mask"][1].all()
    assert qi.image_shapes(kw["img_shapes"], 2) == ((1, side, side),)
    # 60 blocks: 2 * 12 D^2 per token (linears) + 4 S^2 D (attention) dominate
    D, S = 3072, tokens + 16
    approx = 2 * 60 * (2 * S * 12 * D * D + 4 * S * S * D)
    assert abs(qi.flops(c, kw) / approx - 1) < 0.02
