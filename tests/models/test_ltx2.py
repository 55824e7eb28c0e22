"""LTX-2 port: its mechanisms against the plain model (float64), the Pallas kernels'
fallback and interpret-mode runs, input errors, config, presets and plan.

Fixture parity (one device, TP and SP on 2 and 4 devices, sp-xla, SP == TP at
padded counts) and the deviceless v5e:2x2 compile of the released config are in
the conformance suite (tests/test_conformance.py), as for every port."""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from difflet_tpu.testing import read_fixture_io, rel_l2
from difflet_tpu import loading
from difflet_tpu.config import Config
from difflet_tpu.layers import rms_norm
from difflet_tpu.parallel.mesh import TP, make_mesh
from difflet_tpu.models import ltx2
from difflet_tpu.models.ltx2 import model as ltx2_model
from difflet_tpu.layers.rope import fractional as ltx2_rope

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

rel = rel_l2


def fixture(case):
    kw, out = read_fixture_io(FIXTURES / case)
    return kw, out["sample"], out["audio_sample"]


def load(case, tp=None, dtype=jnp.float32, split_rope=True):
    mesh = None if tp is None else make_mesh(tp)
    model = loading.load_transformer(FIXTURES / case / "transformer", dtype=dtype, mesh=mesh,
                                     config=Config(split_rope=split_rope))
    return model, mesh


@functools.lru_cache(maxsize=None)
def runner(case, tp=None, mode=None, **config):
    """float32 runners, shared by the tests (compiled steps are cached on them)."""
    model, mesh = load(case, tp)
    return ltx2.Runner(model, mesh, Config(**config), mode=mode)


_F64 = {}


def f64(kw):
    return {k: (np.asarray(v, np.float64) if isinstance(v, np.ndarray) and v.dtype == np.float32 else v)
            for k, v in kw.items()}


def runner_f64(case, tp=None, mode=None, split_rope=True, cache=True):
    """A float64 runner (call inside `jax.enable_x64(True)`); cached unless `cache=False`."""
    key = (case, tp, mode, split_rope)
    if not cache or key not in _F64:
        model, mesh = load(case, tp, jnp.float64, split_rope)
        r = ltx2.Runner(model, mesh, Config(), mode=mode)
        if not cache:
            return r
        _F64[key] = r
    return _F64[key]


def run_f64(case, tp=None, mode=None, kwargs=None, **runner_kw):
    r = runner_kw.pop("runner", None) or runner_f64(case, tp, mode, **runner_kw)
    s, a = r(**f64(fixture(case)[0] if kwargs is None else kwargs)).to_tuple()
    return np.asarray(s), np.asarray(a)


def check_fixture(case, run):
    kw, ref_s, ref_a = fixture(case)
    s, a = run(**kw).to_tuple()
    assert s.shape == ref_s.shape and a.shape == ref_a.shape
    assert s.dtype == jnp.float32
    assert rel(s, ref_s) <= 1e-5, rel(s, ref_s)
    assert rel(a, ref_a) <= 1e-5, rel(a, ref_a)


# --------------------------------------------------------------------------
# the Pallas kernels under SP
# --------------------------------------------------------------------------

@pytest.mark.slow
def test_fixture_sp_pallas_kernels_interpreted(caplog):
    """SP with the Pallas AG/RS kernels selected (interpret mode on CPU). The
    tiny fixture widths (64) are not multiples of 128, so the kernels'
    unsupported_reason rejects them and the JAX rings run (one notice each)."""
    r = runner("ltx2_pad", 2, "sp", sp_kernel="pallas", sp_rs_kernel="pallas")
    assert (r.par.ag_impl, r.par.rs_impl, r.par.interpret) == ("pallas", "pallas", True)
    assert r.row_multiple() == 2 * 2 * 8  # whole f32 sublane tiles per half, so a kernel could run
    assert r.prepare(fixture("ltx2_pad")[0]).inputs["hidden_states"].shape[1] == 32
    with caplog.at_level("WARNING", logger="difflet_tpu.parallel.collective_matmul"):
        check_fixture("ltx2_pad", r)
    assert any("not a multiple of 128" in rec.getMessage() for rec in caplog.records)


@pytest.mark.slow
def test_sp_pallas_kernels_run_in_the_model(caplog):
    """The Pallas AG and RS kernels themselves (interpret mode), inside the
    model: a random 1-layer config whose widths are multiples of 128 (D = 256,
    heads 4 x 64, FFN 1024), 48 video rows padded to 64 on 2 devices; SP equals
    one device and no collective matmul falls back to the ring."""
    cfg = ltx2.config_from_diffusers(dict(
        ltx2.PRESETS["tiny"], num_attention_heads=4, attention_head_dim=64, cross_attention_dim=256,
        audio_num_attention_heads=4, audio_attention_head_dim=64, audio_cross_attention_dim=256, num_layers=1))
    kw = ltx2.example_inputs(cfg, height=128, width=128, frames=17, text_tokens=8)
    ref_s, ref_a = ltx2.Runner(ltx2.build(cfg, rngs=nnx.Rngs(0)), None, Config())(**kw).to_tuple()
    r = ltx2.Runner(ltx2.build(cfg, rngs=nnx.Rngs(0)), make_mesh(2), Config(sp_kernel="pallas", sp_rs_kernel="pallas"),
                    mode="sp")
    assert kw["hidden_states"].shape[1] == 48 and r.prepare(kw).inputs["hidden_states"].shape[1] == 64
    with caplog.at_level("WARNING", logger="difflet_tpu.parallel.collective_matmul"):
        s, a = r(**kw).to_tuple()
    assert not [rec for rec in caplog.records if "unsupported" in rec.getMessage()]
    assert rel(s, ref_s) <= 1e-5 and rel(a, ref_a) <= 1e-5


# --------------------------------------------------------------------------
# mechanisms against the plain model, float64
# --------------------------------------------------------------------------

@pytest.mark.slow
def test_sp_pad_keys_never_change_the_output():
    """ltx2_pad under SP on 4 devices (27 -> 32 rows) equals one device in
    float64; garbage in the pad rows changes nothing; without the pad-key mask
    the result differs (the mechanism matters)."""
    with jax.enable_x64(True):
        ref_s, ref_a = run_f64("ltx2_pad")
        r = runner_f64("ltx2_pad", 4, "sp")
        prep = r.prepare(f64(fixture("ltx2_pad")[0]))
        inputs, nv = prep.inputs, ref_s.shape[1]
        assert "video_kv_mask" in inputs and inputs["hidden_states"].shape[1] == 32 and nv == 27

        def run(inp):  # the prepared (padded) inputs through the compiled step; finish cuts to nv rows
            s, a = r.run_prepared(dataclasses.replace(prep, inputs=inp, specs={k: prep.specs[k] for k in inp}))
            return np.asarray(s), np.asarray(a)

        s, a = run(inputs)
        assert rel(s, ref_s) < 1e-12 and rel(a, ref_a) < 1e-12
        garbage = dict(inputs, hidden_states=np.array(inputs["hidden_states"]))
        garbage["hidden_states"][:, nv:] = 1e3 * np.random.default_rng(0).standard_normal(
            garbage["hidden_states"][:, nv:].shape)
        s2, a2 = run(garbage)
        assert np.array_equal(s2, s) and np.array_equal(a2, a)
        # the mechanism removed: pad keys attended to
        s3, a3 = run({k: v for k, v in garbage.items() if k != "video_kv_mask"})
        assert rel(s3, ref_s) > 1e-3 and rel(a3, ref_a) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ltx2_pad", "ltx2_batch2"])
def test_sp_cross_local_float64(case):
    """Config.sp_cross_local: audio-to-video attention's queries and output on each
    rank's video rows with every head (to_q / norm_q / to_out replicated, the audio
    K/V gathered by heads, the q table by rows) equals the one-device model in
    float64: 27 video rows padded to 32 on 4 ranks; batch 2 with per-sample video
    coordinates (per-sample tables, the second sample's shifted in time). Off,
    those weights keep the column / row plan and the rings run. A wrong table
    row, head or gather would not match to 1e-12."""
    with jax.enable_x64(True):
        kw = f64(fixture(case)[0])
        model, mesh = load(case, 4, jnp.float64)
        if case == "ltx2_batch2":
            c = model.config
            coords = ltx2_rope.video_coords(
                2, int(kw["num_frames"]), int(kw["height"]), int(kw["width"]), float(kw["fps"]),
                patch_size=c.patch_size, patch_size_t=c.patch_size_t, scale_factors=c.vae_scale_factors,
                causal_offset=c.causal_offset)
            coords[1, 0] += 0.5
            kw["video_coords"] = coords
        ref_s, ref_a = run_f64(case, kwargs=kw)
        for local in (True, False):
            r = ltx2.Runner(model, mesh, Config(sp_cross_local=local), mode="sp")
            assert r.par.cross_local is local
            attn = r.model.transformer_blocks.audio_to_video_attn
            assert attn.to_q.kernel[...].sharding.spec == (P() if local else P(None, None, TP))
            assert attn.to_out["0"].kernel[...].sharding.spec == (P() if local else P(None, TP, None))
            assert ("rope_ca_video_local_cos" in r.prepare(kw).inputs) is local
            s, a = run_f64(case, kwargs=kw, runner=r)
            assert rel(s, ref_s) <= 1e-12 and rel(a, ref_a) <= 1e-12


def test_sp_refuses_input_it_cannot_split():
    model, mesh = load("ltx2_pad", 4)
    r = ltx2.Runner(model, mesh, Config(), mode="sp", pad=False)
    with pytest.raises(ValueError, match=r"cannot split 27 video tokens over tp=4.*multiple of 2\*P = 8"):
        r(**fixture("ltx2_pad")[0]).sample


@pytest.mark.slow
def test_across_heads_qk_norm_reduced_over_ranks(monkeypatch):
    """TP on 4 devices equals one device (float64); with the per-token sum of
    squares left local (no reduction over `tp`) it does not."""
    with jax.enable_x64(True):
        ref_s, ref_a = run_f64("ltx2_pad")
        s, a = run_f64("ltx2_pad", 4, "tp")
        assert rel(s, ref_s) < 1e-12 and rel(a, ref_a) < 1e-12

        def local_only(par, x, weight, eps, dim, sum_sq=None):  # sum_sq: this rank's, also local
            xf = x.astype(jnp.float64)
            return rms_norm(x, weight, eps, sum_sq=jnp.sum(xf * xf, -1, keepdims=True), dim=dim)

        from difflet_tpu.layers import across_heads

        monkeypatch.setattr(across_heads, "rms_norm_across_heads", local_only)
        s, a = run_f64("ltx2_pad", runner=runner_f64("ltx2_pad", 4, "tp", cache=False))
        assert rel(s, ref_s) > 1e-3


@pytest.mark.slow
def test_split_rope_permutation_of_interleaved_checkpoint():
    """The interleaved checkpoint with q/k permuted to split halves at load
    equals the plain interleaved model (float64); running the permuted weights
    with interleaved tables (the layout record lost) does not."""
    with jax.enable_x64(True):
        plain_s, plain_a = run_f64("ltx2_interleaved_rope", split_rope=False)
        s, a = run_f64("ltx2_interleaved_rope", split_rope=True)
        assert rel(s, plain_s) < 1e-12 and rel(a, plain_a) < 1e-12
        model = runner_f64("ltx2_interleaved_rope", split_rope=True, cache=False).model
        assert model.config.split_rope
        model.config = dataclasses.replace(model.config, split_rope=False)
        r = ltx2.Runner(model, None, Config())  # a Runner reads the model as it is when built
        s, a = run_f64("ltx2_interleaved_rope", runner=r)
        assert rel(s, plain_s) > 1e-3


def test_bf16_split_rope_flat_rotation():
    """bf16 q/k rotate with one block-diagonal matmul over the flat channels
    (`layers.rope.GroupedRope`): per group of c/g channels, split halves
    `[x1 cos - x2 sin, x2 cos + x1 sin]` against float64 numpy to bf16 rounding,
    full- and half-width tables, and bit-identical to the shared per-group
    rotation; a wrong rotation sign is caught."""
    from difflet_tpu.layers.rope import GroupedRope
    from difflet_tpu.layers.rope import apply_rotary_emb as rotate
    from difflet_tpu.parallel.modes import Parallel

    rng = np.random.default_rng(3)
    n, c, g = 19, 512, 8
    x = jnp.asarray(rng.standard_normal((1, n, c)), jnp.bfloat16)
    xs = np.asarray(x.astype(jnp.float32), np.float64).reshape(1, n, g, 2, c // g // 2)
    for width in (c, c // 2):
        cos, sin = (rng.standard_normal((1, n, width)).astype(np.float32) for _ in range(2))
        # per group: full tables hold an angle per channel, half-width ones one per pair
        cs = [np.broadcast_to(np.asarray(t, np.float64).reshape(1, n, g, -1, c // g // 2), (1, n, g, 2, c // g // 2))
              for t in (cos, sin)]
        x1, x2 = xs[..., 0, :], xs[..., 1, :]
        (c1, c2), (s1, s2) = ((t[..., 0, :], t[..., 1, :]) for t in cs)
        want = np.stack([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], axis=-2).reshape(1, n, c)
        got = GroupedRope(jnp.asarray(cos), jnp.asarray(sin), g).apply(Parallel(), x)
        assert got.dtype == jnp.bfloat16
        got = np.asarray(got.astype(jnp.float32), np.float64)
        assert np.max(np.abs(got - want) / (np.abs(want) + 1e-3)) < 2 ** -7
        shared = rotate(x.reshape(1, n, g, c // g), jnp.asarray(cos).reshape(1, n, g, -1),
                        jnp.asarray(sin).reshape(1, n, g, -1), split=True).reshape(1, n, c)
        assert np.array_equal(got, np.asarray(shared.astype(jnp.float32), np.float64))
        wrong = np.stack([x1 * c1 + x2 * s1, x2 * c2 - x1 * s2], axis=-2).reshape(1, n, c)
        assert np.max(np.abs(got - wrong) / (np.abs(wrong) + 1e-3)) > 0.1


def test_split_rope_config_and_key_map():
    cfg = json.loads((FIXTURES / "ltx2_interleaved_rope" / "transformer" / "config.json").read_text())
    assert ltx2.config_from_diffusers(cfg, split_rope=True).split_rope
    assert not ltx2.config_from_diffusers(cfg, split_rope=False).split_rope
    released = ltx2.config_from_diffusers(ltx2.PRESETS["ltx-2.0"], split_rope=True)
    assert released.rope_type == "split" and not released.split_rope  # natively split: never permuted
    c = ltx2.config_from_diffusers(cfg, split_rope=True)
    model = nnx.eval_shape(lambda: ltx2.build(c, rngs=nnx.Rngs(0)))
    km = ltx2.key_map(c, model)
    assert km["transformer_blocks.attn1.to_q.kernel"].perm[:4] == (0, 2, 4, 6)
    assert km["transformer_blocks.video_to_audio_attn.norm_k.scale"].perm is not None
    assert km["transformer_blocks.attn2.to_q.kernel"].perm is None  # no RoPE in text cross-attention
    assert km["transformer_blocks.attn1.to_v.kernel"].perm is None


def test_orbax_cache_keeps_the_split_rope_layout(tmp_path):
    """A cached (converted) copy is restored as converted and never permuted twice:
    the cache key carries config.split_rope."""
    src = FIXTURES / "ltx2_interleaved_rope" / "transformer"
    load_ = lambda split: loading.load_transformer(src, dtype=jnp.float32, cache_dir=tmp_path,
                                                   config=Config(split_rope=split))
    first, again, plain = load_(True), load_(True), load_(False)
    assert again.config.split_rope and not plain.config.split_rope
    q = lambda m: np.asarray(m.transformer_blocks.attn1.to_q.kernel[...])
    np.testing.assert_array_equal(q(again), q(first))
    h = ltx2.PRESETS["tiny"]["attention_head_dim"]
    np.testing.assert_array_equal(q(first)[..., :h // 2], q(plain)[..., 0:h:2])  # head 0, split order


def test_rope_angles_formed_in_float32_as_diffusers():
    """Angles reach ~1.6e4 rad: float64 pow -> float32 cast -> float32 multiply,
    as diffusers. Forming them in float64 moves cos/sin by ~1e-3."""
    c = ltx2.config_from_diffusers(ltx2.PRESETS["ltx-2.0"])
    coords = ltx2_rope.video_coords(1, 7, 15, 22, 24.0, patch_size=1, patch_size_t=1,
                                    scale_factors=c.vae_scale_factors, causal_offset=1)
    assert coords.shape == (1, 3, 2310, 2)
    np.testing.assert_allclose(coords[0, 0, [0, 330], :], [[0, 1 / 24], [1 / 24, 0.375]], rtol=1e-6)
    a = ltx2_rope.angles(coords, dim=4096, max_positions=(20, 2048, 2048), theta=1e4, double_precision=True)
    assert a.dtype == np.float32 and a.shape == (1, 2310, 682 * 3) and np.abs(a).max() > 1.5e4
    # the float64-angle variant
    mid = (coords[..., 0].astype(np.float64) + coords[..., 1]) / 2
    grid = np.stack([mid[:, i] / m for i, m in enumerate((20, 2048, 2048))], -1)
    freqs = np.power(1e4, ltx2_rope.torch_linspace(0, 1, 682)) * np.pi / 2
    a64 = np.swapaxes((grid[..., None] * 2 - 1) * freqs, -1, -2).reshape(1, 2310, -1)
    assert np.abs(np.cos(a) - np.cos(a64)).max() > 1e-4
    audio = ltx2_rope.audio_coords(1, 3, patch_size_t=1, scale_factor=4, causal_offset=1, hop_length=160,
                                   sampling_rate=16000)
    np.testing.assert_allclose(audio[0, 0], [[0, .01], [.01, .05], [.05, .09]], atol=1e-7)


def test_rope_in_float64_breaks_parity(monkeypatch):
    """The float32 angle order is what the fixture needs: float64 angles fail it."""
    def angles64(coords, *, dim, max_positions, theta, double_precision):
        coords = np.asarray(coords, np.float64)
        mid = (coords[..., 0] + coords[..., 1]) / 2
        grid = np.stack([mid[:, i] / max_positions[i] for i in range(coords.shape[1])], -1)
        freqs = np.power(theta, ltx2_rope.torch_linspace(0, 1, dim // (2 * coords.shape[1]))) * np.pi / 2
        a = (grid[..., None] * 2 - 1) * freqs
        return np.swapaxes(a, -1, -2).reshape(a.shape[0], a.shape[1], -1)

    kw, ref_s, _ = fixture("ltx2")
    monkeypatch.setattr(ltx2_rope, "angles", angles64)
    model, _ = load("ltx2")
    s, _ = ltx2.Runner(model, None, Config())(**kw).to_tuple()
    assert rel(s, ref_s) > 1e-5


@pytest.mark.slow
def test_text_mask_is_additive():
    """diffusers' mask is a -10000 bias: masked text never matters (float64),
    and an all-zero mask row equals no mask (a boolean mask would not)."""
    with jax.enable_x64(True):
        kw = fixture("ltx2_batch2")[0]
        s, a = run_f64("ltx2_batch2", kwargs=kw)
        noisy = dict(kw)
        for name, mask_name in (("encoder_hidden_states", "encoder_attention_mask"),
                                ("audio_encoder_hidden_states", "audio_encoder_attention_mask")):
            x = np.array(kw[name])
            m = kw[mask_name] == 0
            x[m] = 100 * np.random.default_rng(1).standard_normal(x[m].shape)
            noisy[name] = x
        s2, a2 = run_f64("ltx2_batch2", kwargs=noisy)
        assert rel(s2, s) < 1e-13 and rel(a2, a) < 1e-13
        s3, _ = run_f64("ltx2_batch2", kwargs={k: v for k, v in noisy.items() if "mask" not in k})
        assert rel(s3, s) > 1e-3  # the mask matters
        zero = dict(kw, encoder_attention_mask=np.zeros_like(kw["encoder_attention_mask"]),
                    audio_encoder_attention_mask=np.zeros_like(kw["audio_encoder_attention_mask"]))
        s4, a4 = run_f64("ltx2_batch2", kwargs=zero)
        s5, a5 = run_f64("ltx2_batch2", kwargs={k: v for k, v in kw.items() if "mask" not in k})
        assert np.isfinite(s4).all() and rel(s4, s5) < 1e-9 and rel(a4, a5) < 1e-9


@pytest.mark.slow
def test_per_token_timestep_sharded_like_the_rows():
    """A (B, N) video timestep (LTX-2 I2V) under SP (4 devices, padded) equals
    one device (float64), and a constant one equals the (B,) timestep."""
    with jax.enable_x64(True):
        kw = dict(fixture("ltx2_pad")[0])
        n = kw["hidden_states"].shape[1]
        kw["audio_timestep"] = kw["timestep"]
        const = dict(kw, timestep=np.full((1, n), kw["timestep"][0], np.float64))
        s0, a0 = run_f64("ltx2_pad", kwargs=kw)
        s1, a1 = run_f64("ltx2_pad", kwargs=const)
        assert rel(s1, s0) < 1e-12 and rel(a1, a0) < 1e-12
        per = dict(kw, timestep=np.linspace(0, 1000, n)[None])
        s2, a2 = run_f64("ltx2_pad", kwargs=per)
        assert rel(s2, s0) > 1e-3
        s3, a3 = run_f64("ltx2_pad", 4, "sp", kwargs=per)  # (1, 27) -> (1, 32), 8 rows per rank
        assert rel(s3, s2) < 1e-12 and rel(a3, a2) < 1e-12


@pytest.mark.slow
def test_stg_perturbed_attention():
    """LTX-2.3 STG (LTX2PerturbedAttnProcessor): weight 1 = plain attention
    exactly; weight 0 = values only, in the listed blocks; SP equals one device."""
    with jax.enable_x64(True):
        kw = fixture("ltx2_3")[0]
        plain_s, plain_a = run_f64("ltx2_3", kwargs=kw)
        ones = dict(kw, spatio_temporal_guidance_blocks=[0, 1], perturbation_mask=np.ones(1))
        s, a = run_f64("ltx2_3", kwargs=ones)
        assert np.array_equal(s, plain_s) and np.array_equal(a, plain_a)
        stg = dict(kw, spatio_temporal_guidance_blocks=[1])
        s, a = run_f64("ltx2_3", kwargs=stg)
        assert rel(s, plain_s) > 1e-3
        s2, a2 = run_f64("ltx2_3", 4, "sp", kwargs=stg)
        assert rel(s2, s) < 1e-12 and rel(a2, a) < 1e-12


# --------------------------------------------------------------------------
# errors before compilation, config, plan, presets
# --------------------------------------------------------------------------

def test_bad_inputs_are_refused():
    r = runner("ltx2")
    kw = fixture("ltx2")[0]
    bad = [
        (dict(hidden_states=kw["hidden_states"][..., :8]), r"hidden_states: shape \(1, 24, 8\) does not match"),
        (dict(audio_hidden_states=kw["audio_hidden_states"][:, :4]), r"audio_num_frames=5 gives 5 audio tokens"),
        (dict(encoder_hidden_states=kw["encoder_hidden_states"][..., :5]), "encoder_hidden_states"),
        (dict(num_frames=3), r"3x3x4 gives 36 video tokens, hidden_states has 24"),
        (dict(timestep=np.ones(3, np.float32)), r"timestep: shape \(3,\) is not \(B,\)"),
        (dict(encoder_attention_mask=np.ones((1, 7))), "encoder_attention_mask"),
        (dict(video_self_attention_mask=np.ones((1, 24, 24))), "not supported"),
    ]
    for change, match in bad:
        with pytest.raises((ValueError, NotImplementedError), match=match):
            r(**dict(kw, **change)).sample
    with pytest.raises(TypeError, match="unexpected"):
        r(**dict(kw, bogus=1)).sample
    with pytest.raises(ValueError, match="sigma is required"):
        runner("ltx2_3")(**{k: v for k, v in fixture("ltx2_3")[0].items() if k != "sigma"}).sample


def test_heads_must_divide_over_tp():
    model, _ = load("ltx2")
    with pytest.raises(ValueError, match="num_attention_heads=4: 4 heads do not divide over tp=3"):
        ltx2.Runner(model, make_mesh(3), Config(), mode="tp")


def test_config_from_diffusers_errors():
    base = ltx2.PRESETS["tiny"]
    for key, value, match in (("qk_norm", "rms_norm", "qk_norm"), ("rope_type", "xyz", "rope_type"),
                              ("activation_fn", "swiglu", "activation_fn"), ("bogus", 1, "bogus"),
                              ("audio_cross_attention_dim", 64, "audio_cross_attention_dim")):
        with pytest.raises(ValueError, match=match):
            ltx2.config_from_diffusers(dict(base, **{key: value}))


def test_presets_and_param_counts():
    """Released configs build (abstractly) with diffusers' parameter counts (LTX2VideoTransformer3DModel
    built from each config on the meta device)."""
    counts = {"ltx-2.0": 18_876_174_592, "ltx-2.3": 18_988_838_144, "tiny": 352_672}
    for name, want in counts.items():
        c = ltx2.config_from_diffusers(ltx2.PRESETS[name])
        model = nnx.eval_shape(lambda: ltx2.build(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        got = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert got == want, (name, got)
    tiny = json.loads((FIXTURES / "ltx2" / "transformer" / "config.json").read_text())
    assert ltx2.config_from_diffusers(tiny) == ltx2.config_from_diffusers(ltx2.PRESETS["tiny"])


def test_plan_shards_the_big_linears():
    c = ltx2.config_from_diffusers(ltx2.PRESETS["tiny"])
    from difflet_tpu.parallel.modes import param_specs
    from jax.sharding import PartitionSpec as P

    specs = param_specs(nnx.state(nnx.eval_shape(lambda: ltx2.build(c, rngs=nnx.Rngs(0)))), ltx2.PLAN)
    blocks = specs["transformer_blocks"]
    get = lambda s: s.get_value()
    assert get(blocks["attn1"]["to_q"]["kernel"]) == P(None, None, "tp")
    assert get(blocks["video_to_audio_attn"]["to_out"]["0"]["kernel"]) == P(None, "tp", None)
    assert get(blocks["audio_ff"]["net"]["2"]["kernel"]) == P(None, "tp", None)
    assert get(blocks["attn1"]["norm_q"]["scale"]) == P(None, "tp")
    assert get(specs["time_embed"]["linear"]["kernel"]) == P(None, "tp")
    assert get(specs["av_cross_attn_audio_v2a_gate"]["linear"]["bias"]) == P("tp")
    assert get(specs["time_embed"]["emb"]["timestep_embedder"]["linear_2"]["kernel"]) == P()
    assert get(blocks["scale_shift_table"]) == P()
    assert get(specs["proj_out"]["kernel"]) == P()


def test_example_inputs_and_flops_at_the_benchmark_shape():
    c = ltx2.config_from_diffusers(ltx2.PRESETS["ltx-2.0"])
    ex = ltx2.example_inputs(c, height=480, width=704, frames=49)
    assert ex["hidden_states"].shape == (1, 2310, 128)
    assert ex["audio_hidden_states"].shape == (1, 51, 128)
    assert ex["encoder_hidden_states"].shape == (1, 1024, 3840)
    assert (ex["num_frames"], ex["height"], ex["width"], ex["audio_num_frames"]) == (7, 15, 22, 51)
    assert abs(ltx2.flops(c, ex) / 1e12 - 70.29) < 0.05  # 2*m*k*n per linear + 4*S^2*D attention, by hand
