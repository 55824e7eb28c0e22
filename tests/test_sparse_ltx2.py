"""Block-sparse video self-attention on LTX-2 (the video stream's attn1; the audio stream, the
text cross-attentions and a2v / v2a stay dense): the port's sparse step (one device, TP, SP)
against the plain frame-major model whose attn1 gets the same mask token by token as -inf (the
STA / radial definitions of tests/test_sparse_attention.py)."""

import dataclasses
import functools
import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.layers import sparse_masks as M

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
_spec = importlib.util.spec_from_file_location("_sparse_definitions", pathlib.Path(__file__).parent
                                               / "test_sparse_attention.py")
_defs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_defs)

STA = "sta:tile=2,4,16,window=1,2,1"
GRID = {"sta": (4, 8, 16), "radial": (8, 8, 16)}  # radial: sparse at 256-token kernel blocks


def _inputs(grid, seed=0):
    """The tiny LTX-2.0 fixture's text and audio, a video of `grid` latent tokens, per-token video
    timesteps (reordered with the rows under STA)."""
    from difflet_tpu.testing import read_fixture_io

    kw, _ = read_fixture_io(FIXTURES / "ltx2")
    rng = np.random.default_rng(seed)
    n = int(np.prod(grid))
    return dict(kw, hidden_states=rng.standard_normal((1, n, kw["hidden_states"].shape[2])).astype(np.float32),
                timestep=rng.uniform(0, 1000, (1, n)).astype(np.float32), audio_timestep=kw["timestep"],
                num_frames=grid[0], height=grid[1], width=grid[2])


@functools.lru_cache(maxsize=None)
def _runner(tp=None, mode=None):
    from difflet_tpu import loading
    from difflet_tpu.config import Config
    from difflet_tpu.models import ltx2
    from difflet_tpu.parallel.mesh import make_mesh

    mesh = make_mesh(tp) if tp else None
    model = loading.load_transformer(FIXTURES / "ltx2" / "transformer", dtype=jnp.float32, mesh=mesh,
                                     config=Config())
    return ltx2.Runner(model, mesh, Config(), mode=mode, compiler_options={"xla_backend_optimization_level": 0})


def _video_tokens(option, grid):
    if option.startswith("sta"):
        opt = M.parse(option)
        return _defs._sta_token_mask(grid, opt.tile, opt.window)
    t, h, w = grid
    fine = _defs._reference_radial(t, h * w, 128, 0.5, False)  # no first-frame sink off Wan
    n = fine.shape[0] // 2
    coarse = fine[:2 * n, :2 * n].reshape(n, 2, n, 2).any(axis=(1, 3))  # kernel blocks of 256
    return M.expand(coarse, 256)[:t * h * w, :t * h * w]


@functools.lru_cache(maxsize=None)
def _masked_reference(option):
    """The plain model (frame-major rows, one device, float32), attn1 with the token mask as -inf."""
    grid = GRID[option.split(":")[0]]
    kw = _inputs(grid)
    run = _runner()
    tokens = _video_tokens(option, grid)
    assert 0.2 < tokens.mean() < 0.97
    prep = run.prepare(dict(kw))
    ref = run.run_prepared(dataclasses.replace(prep, key=(prep.key, M.BlockSparsity("reference", tokens, 1, 1))))
    return kw, ref.to_tuple(), run(**kw).to_tuple()


@pytest.mark.parametrize("option", [STA, "radial:decay=0.5"])
@pytest.mark.parametrize("tp, mode", [(None, None), (4, "tp"), (4, "sp")])
def test_ltx2_sparse_equals_the_masked_plain_model(option, tp, mode):
    """Video and audio outputs within float32 rounding of the masked plain model (rows in another
    order, and sharded): the audio sees the sparse video through v2a, not a mask of its own."""
    from difflet_tpu.testing import rel_l2

    kw, (ref, ref_audio), (dense, _) = _masked_reference(option)
    out, audio = _runner(tp, mode)(**kw, attention=option).to_tuple()
    assert rel_l2(ref, dense) > 1e-3  # the mask matters here
    assert rel_l2(out, ref) <= 1e-5 and rel_l2(audio, ref_audio) <= 1e-5


def test_ltx2_window_over_everything_is_the_dense_step():
    from difflet_tpu.models.ltx2 import port

    assert port.sparse_plan("sta:tile=2,4,16,window=2,2,1", GRID["sta"]) is None
    kw = _inputs(GRID["sta"])
    run = _runner()
    for a, b in zip(run(**kw, attention="sta:tile=2,4,16,window=2,2,1").to_tuple(), run(**kw).to_tuple()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ltx2_bad_window_or_no_grid_is_refused_before_the_step():
    run = _runner()
    kw = _inputs(GRID["sta"])
    with pytest.raises(M.SparsityError, match=r"wider than the \(2, 2, 1\) tiles"):
        run.prepare(dict(kw, attention="sta:tile=2,4,16,window=3,1,1"))
    from difflet_tpu.layers.rope import fractional

    c = run.cfg
    coords = fractional.video_coords(1, *GRID["sta"], 24.0, patch_size=1, patch_size_t=1,
                                     scale_factors=c.vae_scale_factors, causal_offset=c.causal_offset)
    with pytest.raises(M.SparsityError, match="give num_frames, height and width"):
        run.prepare(dict(kw, attention=STA, video_coords=coords))
