"""Block-sparse video self-attention in joint attention (HunyuanVideo's `[video | text]`): the
joint mask (`sparse_masks.with_dense_tail`) against its definition token by token, the splash
kernel with it against masked softmax, and the port's sparse step (one device, TP, SP) against
the plain frame-major model whose attention gets the same mask token by token as -inf (video x
video the STA / radial definition of tests/test_sparse_attention.py, every text row and column
dense)."""

import dataclasses
import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.layers import sparse_masks as M
from difflet_tpu.layers.sdpa import attention, reference_attention

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
# the STA definition and the radial reference's transliteration, written once there
_spec = importlib.util.spec_from_file_location("_sparse_definitions", pathlib.Path(__file__).parent
                                               / "test_sparse_attention.py")
_defs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_defs)
_reference_radial, _sta_token_mask = _defs._reference_radial, _defs._sta_token_mask


def _joint_tokens(video, n_video_rows, n_text_rows):
    """The definition: video rows x video rows as `video` (frame-major tokens, then pad rows that
    attend no video key), every text row and column dense."""
    n = n_video_rows + n_text_rows
    m = np.ones((n, n), bool)
    m[:n_video_rows, :n_video_rows] = False
    m[:len(video), :len(video)] = video
    return m


# ---- the joint mask ---------------------------------------------------------------

@pytest.mark.parametrize("option, grid", [("sta:tile=2,4,16,window=1,2,1", (4, 8, 16)),
                                          ("radial:sink=0", (8, 8, 16))])
def test_with_dense_tail_is_the_joint_token_mask(option, grid):
    video = M.plan(M.parse(option), grid, sink=False)
    kb = video.kernel_block
    joint, rows = M.with_dense_tail(video, 21, multiple=3 * kb)  # text not a whole block
    assert joint.kernel_block == kb and rows % (3 * kb) == 0 and rows >= video.tokens + kb  # pad blocks too
    length = rows + 21
    # what the kernel computes (its kernel blocks at token resolution), in the plan's order
    got = np.repeat(np.repeat(joint.kernel_mask(-(-length // kb) * kb), kb, 0), kb, 1)[:length, :length]
    video_tokens = M.expand(video.kernel_mask(-(-video.tokens // kb) * kb), kb)[:video.tokens, :video.tokens]
    np.testing.assert_array_equal(got, _joint_tokens(video_tokens, rows, 21))


def test_with_dense_tail_grows_the_kernel_block_to_fit_smem():
    """The dense text rows make every kernel row as wide as the sequence: at HunyuanVideo
    640x1024x121 (31 x 40 x 64 latent tokens after the patch) radial's own 256-token kernel blocks
    would need more block metadata than splash's SMEM budget with them; the joint takes larger ones."""
    video = M.plan(M.parse("radial"), (31, 40, 64), sink=False)
    assert video.kernel_block == 256
    joint, rows = M.with_dense_tail(video, 256)
    length = -(-(rows + 256) // joint.kernel_block) * joint.kernel_block
    assert joint.kernel_block > 256 and rows % joint.kernel_block == 0
    assert joint.smem_bytes(length) <= M.SMEM_METADATA_BUDGET < M.dataclasses.replace(
        joint, kernel_block=256).smem_bytes(-(-(rows + 256) // 256) * 256)
    assert 0 < joint.density(length) < 1
    small = M.plan(M.parse("sta:tile=1,2,64"), (31, 40, 64))  # 128-token tiles: grouped in kernel blocks
    grouped, rows = M.with_dense_tail(small, 256)
    assert grouped.kernel_block % 128 == 0 and grouped.kernel_block > 128
    assert grouped.smem_bytes(-(-(rows + 256) // grouped.kernel_block) * grouped.kernel_block) <= \
        M.SMEM_METADATA_BUDGET
    huge = M.plan(M.parse("sta:tile=8,8,16"), (64, 64, 80))  # 320 tiles of 1024 tokens: no larger block
    with pytest.raises(M.SparsityError, match="use larger tiles"):
        M.with_dense_tail(huge, 256)


def test_splash_with_the_joint_mask_is_masked_softmax_attention():
    """Splash (interpret mode) with the joint mask: the video blocks skipped as planned, the text
    rows (not a whole kernel block) dense both ways, pad keys dropped."""
    video = M.plan(M.parse("sta:tile=2,4,16,window=1,2,1"), (4, 8, 16))
    joint, rows = M.with_dense_tail(video, 24)
    assert rows == video.tokens
    S, H, D = video.tokens + 24, 2, 64
    q, k, v = (jax.random.normal(key, (1, S, H, D), jnp.float32) for key in jax.random.split(jax.random.key(1), 3))
    kv_mask = np.ones(S, bool)
    kv_mask[-5:] = False  # text padding
    out = attention(q, k, v, kv_mask, impl="splash", interpret=True, sparse=joint)
    ref = reference_attention(q, k, v, kv_mask, sparse=joint)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    dense = reference_attention(q, k, v, kv_mask)
    assert np.abs(np.asarray(ref) - np.asarray(dense))[:, :video.tokens].max() > 1e-2  # video rows sparse
    np.testing.assert_allclose(np.asarray(out)[:, video.tokens:], np.asarray(dense)[:, video.tokens:],
                               atol=2e-5, rtol=2e-5)  # text rows: every key


# ---- HunyuanVideo -------------------------------------------------------------------

STA = "sta:tile=2,4,16,window=1,2,1"
HV_GRID = {"sta": (4, 8, 16), "radial": (8, 8, 16)}  # radial: sparse at 256-token kernel blocks


def _hv_inputs(case, grid, seed=0):
    from difflet_tpu.testing import fixture_sample

    kw, _ = fixture_sample(FIXTURES / case)
    t, h, w = grid
    c = kw["hidden_states"].shape[1]
    rng = np.random.default_rng(seed)
    return dict(kw, hidden_states=rng.standard_normal((1, c, t, 2 * h, 2 * w)).astype(np.float32))


@functools.lru_cache(maxsize=None)
def _hv_runner(case="hunyuan_video", tp=None, mode=None, sp_single=True):
    from difflet_tpu.config import Config
    from difflet_tpu.models import hunyuan_video as hv
    from difflet_tpu.parallel.mesh import make_mesh
    from difflet_tpu.testing import load_fixture_transformer

    mesh = make_mesh(tp) if tp else None
    model = load_fixture_transformer(FIXTURES / case, tp, split_rope=True, dtype=jnp.float32)[0]
    return hv.Runner(model, mesh, Config(sp_single=sp_single), mode=mode)


def _hv_video_tokens(option, grid):
    """The video x video token mask (frame-major) the sparse step must apply."""
    if option.startswith("sta"):
        opt = M.parse(option)
        return _sta_token_mask(grid, opt.tile, opt.window)
    t, h, w = grid
    fine = _reference_radial(t, h * w, 128, 0.5, False)  # no sink for HunyuanVideo
    n = fine.shape[0] // 2
    coarse = fine[:2 * n, :2 * n].reshape(n, 2, n, 2).any(axis=(1, 3))  # kernel blocks of 256
    return M.expand(coarse, 256)[:t * h * w, :t * h * w]


@functools.lru_cache(maxsize=None)
def _hv_masked_reference(option, case="hunyuan_video"):
    """The plain model (frame-major rows, one device, float32) whose joint attention gets the
    token mask as -inf (a mask of one-token blocks)."""
    grid = HV_GRID[option.split(":")[0]]
    kw = _hv_inputs(case, grid)
    run = _hv_runner(case)
    prep = run.prepare(dict(kw))
    geom = prep.key
    video = _hv_video_tokens(option, grid)
    assert 0.2 < video.mean() < 0.97  # some blocks masked
    tokens = _joint_tokens(video, geom.n_img_pad, geom.n_txt_pad)
    ref = run.run_prepared(dataclasses.replace(prep, key=(geom, M.BlockSparsity("reference", tokens, 1, 1))))
    return kw, np.asarray(ref.sample), np.asarray(run(**kw).sample)


@pytest.mark.parametrize("option, tp, mode, sp_single", [
    (o, tp, mode, True) for o in (STA, "radial:decay=0.5") for tp, mode in ((None, None), (4, "tp"), (4, "sp"))
] + [(STA, 4, "sp", False)])
def test_hunyuan_sparse_equals_the_masked_plain_model(option, tp, mode, sp_single):
    """The sparse step (image rows in the plan's order, RoPE rows with them, the joint mask;
    under SP the single blocks' interleaved rows put in joint order around the kernel, or with
    `sp_single` off gathered in it) equals the masked plain model within float32 rounding (the
    rows are summed in another order, and sharded)."""
    from difflet_tpu.testing import rel_l2

    kw, ref, dense = _hv_masked_reference(option)
    out = np.asarray(_hv_runner("hunyuan_video", tp, mode, sp_single)(**kw, attention=option).sample)
    assert rel_l2(ref, dense) > 1e-3  # the mask matters here
    assert rel_l2(out, ref) <= 1e-5


def test_hunyuan_token_replace_sparse_equals_the_masked_plain_model():
    """I2V token_replace: the first-frame rows (found by their tokens in tile order) keep their
    t=0 modulation."""
    from difflet_tpu.testing import rel_l2

    kw, ref, dense = _hv_masked_reference(STA, "hunyuan_video_i2v_token_replace")
    out = np.asarray(_hv_runner("hunyuan_video_i2v_token_replace")(**kw, attention=STA).sample)
    assert rel_l2(ref, dense) > 1e-3
    assert rel_l2(out, ref) <= 1e-5


def test_hunyuan_window_over_everything_is_the_dense_step():
    """A window over every tile plans no sparsity: the dense step itself, bit for bit."""
    from difflet_tpu.models.hunyuan_video import port

    grid = HV_GRID["sta"]
    assert port.sparse_plan("sta:tile=2,4,16,window=2,2,1", grid) is None
    kw = _hv_inputs("hunyuan_video", grid)
    run = _hv_runner()
    np.testing.assert_array_equal(np.asarray(run(**kw, attention="sta:tile=2,4,16,window=2,2,1").sample),
                                  np.asarray(run(**kw).sample))


def test_hunyuan_bad_window_is_refused_before_the_step():
    run = _hv_runner()
    with pytest.raises(M.SparsityError, match=r"wider than the \(2, 2, 1\) tiles"):
        run.prepare(dict(_hv_inputs("hunyuan_video", HV_GRID["sta"]), attention="sta:tile=2,4,16,window=3,1,1"))
