"""Block-sparse video attention masks (difflet_tpu/layers/sparse_masks.py) against their
definitions written out token by token, the radial mask against a plain transliteration
of the reference's `gen_log_mask_shrinked` (github.com/mit-han-lab/radial-attention,
radial_attn/attn_mask.py), and splash attention with a block mask against softmax
attention with the same mask as -inf."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.layers import sparse_masks as M


# ---- the option ---------------------------------------------------------------

def test_parse_reads_each_kind():
    assert M.parse(None).dense and M.parse("dense").dense
    sta = M.parse("sta:window=3,2,5,tile=2,8,8,full_steps=7")
    assert (sta.kind, sta.window, sta.tile, sta.full_steps) == ("sta", (3, 2, 5), (2, 8, 8), 7)
    assert sta.dense_at(6) and not sta.dense_at(7)
    rad = M.parse("radial:decay=0.25,sink=0")
    assert (rad.kind, rad.decay, rad.sink, rad.full_steps) == ("radial", 0.25, False, 0)
    assert M.parse("sta") == M.SparseAttention(kind="sta")


@pytest.mark.parametrize("text, words", [
    ("sparse", "kind must be one of"),
    ("sta:window=3,3", "3 positive integers"),
    ("sta:window=0,3,3", "3 positive integers"),
    ("sta:decay=0.5", "unknown option 'decay'"),
    ("radial:window=1,1,1", "unknown option 'window'"),
    ("sta:full_steps=-1", "full_steps must be >= 0"),
    ("sta:full_steps=1,full_steps=2", "given twice"),
    ("radial:decay=2", "decay must be in (0, 1]"),
    ("radial:sink=yes", "sink must be 0 or 1"),
    ("sta:3,3,3", "name=value"),
    (3, "must be a string"),
])
def test_parse_refuses_with_the_reason(text, words):
    with pytest.raises(M.SparsityError) as e:
        M.parse(text)
    assert words in str(e.value)


# ---- sliding tile attention ---------------------------------------------------

@pytest.mark.parametrize("grid, tile", [((3, 5, 7), (2, 2, 4)), ((4, 4, 8), (2, 4, 4)), ((1, 6, 6), (1, 3, 2))])
def test_tile_order_is_a_permutation_that_keeps_each_tile_a_box(grid, tile):
    lay = M.TileLayout(grid, tile)
    order = lay.order()
    real = order[order >= 0]
    assert len(order) == lay.padded_tokens and sorted(real) == list(range(lay.tokens))
    assert np.array_equal(order[lay.inverse()], np.arange(lay.tokens))
    coords = np.stack(np.unravel_index(real, grid), -1)
    tile_of = np.repeat(np.arange(np.prod(lay.tiles)), lay.block)[order >= 0]
    for n in range(np.prod(lay.tiles)):
        c = coords[tile_of == n]
        origin = np.array(np.unravel_index(n, lay.tiles)) * np.array(tile)
        assert len(c) and (c >= origin).all() and (c < origin + np.array(tile)).all()


def _sta_token_mask(grid, tile, window):
    """The definition: query token q attends key token k when, along each axis, k's tile lies
    in the window of w tiles centred on q's tile and shifted inside the grid of tiles."""
    tiles = [-(-g // t) for g, t in zip(grid, tile)]
    coords = np.stack(np.unravel_index(np.arange(int(np.prod(grid))), grid), -1) // np.array(tile)
    ok = np.ones((len(coords), len(coords)), bool)
    for a in range(3):
        n, w = tiles[a], window[a]
        start = np.array([min(max(i - (w - 1) // 2, 0), max(n - w, 0)) for i in range(n)])
        s = start[coords[:, a]][:, None]
        ok &= (coords[None, :, a] >= s) & (coords[None, :, a] < s + w)
    return ok


@pytest.mark.parametrize("grid, tile, window", [
    ((3, 5, 7), (2, 2, 4), (1, 2, 1)), ((4, 4, 8), (2, 4, 4), (2, 1, 1)), ((5, 6, 6), (1, 2, 2), (3, 1, 3)),
    ((5, 6, 6), (1, 2, 2), (2, 2, 2))])
def test_sta_block_mask_is_the_windowed_token_mask(grid, tile, window):
    lay = M.TileLayout(grid, tile)
    bm = M.sta_block_mask(lay.tiles, window)
    order = lay.order()
    tokens = M.expand(bm, lay.block)
    real = order >= 0
    mine = np.zeros((lay.tokens, lay.tokens), bool)
    mine[np.ix_(order[real], order[real])] = tokens[np.ix_(real, real)]
    assert np.array_equal(mine, _sta_token_mask(grid, tile, window))
    # every query tile sees the same number of key tiles (the window shifts inside the grid)
    assert len(set(bm.sum(1))) == 1


def test_a_window_over_every_tile_is_dense():
    assert M.sta_block_mask((3, 4, 5), (3, 4, 5)).all()


def test_plan_sta_default_window_and_errors():
    lay, window = M.plan_sta((21, 45, 80), M.parse("sta"))
    assert lay.block % M.LANE == 0 and lay.block <= M.MAX_TILE
    assert M.density(M.sta_block_mask(lay.tiles, window)) <= M.STA_DEFAULT_DENSITY
    with pytest.raises(M.SparsityError, match="wider than"):
        M.plan_sta((21, 45, 80), M.parse("sta:window=9,9,9"))
    with pytest.raises(M.SparsityError, match="multiple of 128"):
        M.plan_sta((21, 45, 80), M.parse("sta:tile=3,3,3"))
    with pytest.raises(M.SparsityError, match="no STA tile fits"):
        M.plan_sta((1, 3, 5), M.parse("sta"))


# ---- radial attention ----------------------------------------------------------

def _reference_radial(frames, per_frame, block, decay, wan):
    """radial_attn/attn_mask.py's gen_log_mask_shrinked (block size = its threshold),
    transliterated to numpy loop for loop, for a video-only sequence."""
    def window_width(i, j):
        dist = abs(i - j)
        if dist <= 1:
            return per_frame
        group = dist.bit_length()
        length = 2 ** per_frame.bit_length() / 2 ** group * decay
        return length if length >= block else block

    def split(i, j):
        dist = abs(i - j)
        group = dist.bit_length()
        length = 2 ** per_frame.bit_length() / 2 ** group
        if length >= block:
            return True
        return dist % int(block / length) == 0

    def shrink(mask):
        n = mask.shape[0] // block
        m = mask[:n * block, :n * block].reshape(n, block, n, block)
        col = m.sum(1) / block
        nonzero = col > 0
        high = col > 1 / 3
        return high.sum(-1) / (nonzero.sum(-1) + 1e-9) > 0.6

    s = -(-frames * per_frame // block) * block
    out = np.zeros((s // block, s // block), bool)
    border = frames * per_frame // block
    out[border:] = True
    out[:, border:] = True
    idx = np.arange(per_frame)
    for i in range(frames):
        for j in range(frames):
            if j == 0 and wan:
                local = np.ones((per_frame, per_frame), bool)
            else:
                local = (np.abs(idx[None, :] - idx[:, None]) <= window_width(i, j)) & split(i, j)
            rr, rc = (i * per_frame) % block, (j * per_frame) % block
            nr = rr + ((per_frame - 1) // block + 1) * block
            nc = rc + ((per_frame - 1) // block + 1) * block
            padded = np.zeros((nr, nc), bool)
            padded[rr:rr + per_frame, rc:rc + per_frame] = local
            bm = shrink(padded)
            r0, c0 = i * per_frame // block, j * per_frame // block
            h, w = min(bm.shape[0], out.shape[0] - r0), min(bm.shape[1], out.shape[1] - c0)
            out[r0:r0 + h, c0:c0 + w] |= bm[:h, :w]
    return out


@pytest.mark.parametrize("frames, per_frame, block, decay, wan", [
    (9, 64, 16, 0.5, True), (9, 64, 16, 0.5, False), (12, 40, 16, 0.5, True), (17, 24, 8, 1.0, False),
    (6, 100, 32, 0.5, True)])
def test_radial_block_mask_is_the_references(frames, per_frame, block, decay, wan):
    mine = M.radial_block_mask(frames, per_frame, block=block, decay=decay, sink=wan)
    ref = _reference_radial(frames, per_frame, block, decay, wan)
    assert np.array_equal(mine, ref)
    assert 0 < M.density(mine) < 1  # these shapes are sparse


def test_radial_token_mask_bands_shrink_with_distance():
    m = M.radial_token_mask(9, 64, block=8, sink=False)
    widths = [m[0:64, j * 64:(j + 1) * 64][32].sum() for j in range(9)]  # middle query row of frame 0
    assert widths[0] == widths[1] == 64 and widths[2] >= widths[4] >= widths[8] and widths[8] < 64


# ---- the splash mask -------------------------------------------------------------

def test_splash_mask_slices_are_the_expanded_block_mask():
    rng = np.random.default_rng(0)
    bm = rng.random((5, 7)) < 0.4
    mask = M.splash_mask(bm, 16)
    dense = M.expand(bm, 16)
    assert mask.shape == dense.shape
    for qs, ks in [(slice(0, 16), slice(32, 48)), (slice(5, 40), slice(0, 112)), (slice(64, 80), slice(96, 112))]:
        assert np.array_equal(mask[qs, ks], dense[qs, ks])
    assert hash(mask) == hash(M.splash_mask(bm.copy(), 16)) and mask == M.splash_mask(bm.copy(), 16)
    assert mask != M.splash_mask(~bm, 16)


def test_splash_with_an_sta_block_mask_is_masked_softmax_attention():
    """The kernel (interpret mode) skips the empty blocks and equals float32 softmax attention
    with the block mask's zeros as -inf, on tokens reordered tile by tile."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    lay = M.TileLayout((4, 8, 16), (2, 4, 16))  # 2 x 2 x 1 tiles of 128 tokens
    bm = M.sta_block_mask(lay.tiles, (1, 2, 1))
    assert 0 < M.density(bm) < 1
    H, D, S = 2, 128, lay.padded_tokens
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (H, S, D), jnp.float32) for key in (k0, k1, k2))
    blocks = sk.BlockSizes(block_q=lay.block, block_kv=lay.block, block_kv_compute=lay.block)
    kernel = sk.make_splash_mha(sm.MultiHeadMask([M.splash_mask(bm, lay.block)] * H), block_sizes=blocks,
                                head_shards=1, q_seq_shards=1, interpret=True)
    out = kernel(q * (1 / np.sqrt(D)), k, v)
    token_mask = M.expand(bm, lay.block)
    # the reference with the mask as -inf
    s = jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(D)
    s = jnp.where(token_mask[None], s, -jnp.inf)
    ref = jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, -1), v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    dense = jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(D), -1), v)
    assert np.abs(np.asarray(out) - np.asarray(dense)).max() > 1e-2  # the mask did something


# ---- Wan with block-sparse self-attention -------------------------------------------

WAN_GRID = (4, 8, 16)  # latent frames x (height, width) / patch (1, 2, 2): 512 tokens


def _wan_inputs(dtype, grid=WAN_GRID, seed=0):
    import pathlib

    from difflet_tpu.testing import read_fixture_io

    kw, _ = read_fixture_io(pathlib.Path(__file__).parent / "fixtures" / "wan_ti2v")
    rng = np.random.default_rng(seed)
    t, h, w = grid
    n = t * h * w
    return dict(hidden_states=rng.standard_normal((1, 4, t, 2 * h, 2 * w)).astype(dtype),
                timestep=rng.uniform(0, 1000, (1, n)).astype(dtype),  # per token (TI2V): reordered too
                encoder_hidden_states=kw["encoder_hidden_states"].astype(dtype))


def _wan(dtype, mesh=None):
    import pathlib

    from difflet_tpu import loading
    from difflet_tpu.config import Config

    return loading.load_transformer(pathlib.Path(__file__).parent / "fixtures" / "wan_ti2v" / "transformer",
                                    dtype=dtype, mesh=mesh, config=Config())


def _frame_major(token_mask):
    """A BlockSparsity of one-token blocks in frame-major order: the reference runs the plain
    (dense-order) model with exactly this token mask as -inf."""
    return M.BlockSparsity("reference", np.asarray(token_mask, bool), 1, 1)


def _radial_tokens(grid, decay=0.5, sink=True):
    """The reference's 128-token block mask, computed by kernel blocks of 256 tokens (a kernel
    block runs when any of its four mask blocks is active), at token resolution."""
    t, h, w = grid
    fine = _reference_radial(t, h * w, 128, decay, sink)
    n = fine.shape[0] // 2
    coarse = fine[:2 * n, :2 * n].reshape(n, 2, n, 2).any(axis=(1, 3))
    return M.expand(coarse, 256)[:t * h * w, :t * h * w]


@pytest.mark.parametrize("option", ["sta:tile=2,4,16,window=1,2,1", "radial:decay=0.5,sink=1"])
def test_wan_sparse_equals_the_masked_plain_model_float64(option):
    """The port's block-sparse step (tokens reordered tile by tile, RoPE rows and per-token
    timesteps with them, the output put back) equals the frame-major model whose
    self-attention gets the same mask token by token as -inf, in float64."""
    from difflet_tpu.models import wan

    with jax.enable_x64(True):
        grid = WAN_GRID if option.startswith("sta") else (8, 8, 16)  # radial: sparse at 256-token blocks
        kw = _wan_inputs(np.float64, grid)
        run = wan.Runner(_wan(jnp.float64))
        out = run(**kw, attention=option).sample
        if option.startswith("sta"):
            opt = M.parse(option)
            tokens = _sta_token_mask(grid, opt.tile, opt.window)
        else:
            tokens = _radial_tokens(grid)
        assert 0.2 < tokens.mean() < 0.97  # some blocks masked
        ref = run(**kw, attention=None).sample
        assert np.abs(np.asarray(out) - np.asarray(ref)).max() > 1e-3  # sparse is not dense here
        # the reference: dense order, the token mask
        prep = run.prepare(dict(kw))
        masked = run.run_prepared(dataclasses.replace(prep, key=(prep.key, _frame_major(tokens)))).sample
        np.testing.assert_allclose(np.asarray(out), np.asarray(masked), rtol=0, atol=1e-10)


@pytest.mark.parametrize("mode", ["sp"])  # TP runs the same attention on whole sequences; SP also splits the rows
def test_wan_sparse_sharded_equals_one_device(mode):
    """SP over 4 CPU devices: the same sparse step as one device (float32)."""
    from difflet_tpu.config import Config
    from difflet_tpu.models import wan
    from difflet_tpu.parallel.mesh import make_mesh
    from difflet_tpu.testing import rel_l2

    kw = _wan_inputs(np.float32)
    option = "sta:tile=2,4,16,window=1,2,1"
    ref = wan.Runner(_wan(jnp.float32))(**kw, attention=option).sample
    mesh = make_mesh(4)
    out = wan.Runner(_wan(jnp.float32, mesh), mesh, Config(), mode)(**kw, attention=option).sample
    assert rel_l2(out, ref) <= 1e-5


def test_wan_window_over_everything_is_the_dense_step():
    from difflet_tpu.models import wan

    kw = _wan_inputs(np.float32)
    run = wan.Runner(_wan(jnp.float32))
    assert wan.port.sparse_plan("sta:tile=2,4,16,window=2,2,1", WAN_GRID) is None
    dense = run(**kw).sample
    np.testing.assert_array_equal(np.asarray(run(**kw, attention="sta:tile=2,4,16,window=2,2,1").sample),
                                  np.asarray(dense))


def test_wan_sparse_bad_window_is_refused_before_the_step():
    from difflet_tpu.models import wan

    run = wan.Runner(_wan(jnp.float32))
    with pytest.raises(M.SparsityError, match="wider than"):
        run.prepare(dict(_wan_inputs(np.float32), attention="sta:tile=2,4,16,window=3,1,1"))


# ---- the instrument ----------------------------------------------------------------

def test_compile_only_prices_splash_by_its_active_blocks():
    """A deviceless v5e compile of splash with an STA block mask: the kernel is there, the
    estimator reads the density from its scope and prices its FLOPs at that share of the
    dense call's (compiled the same way), within the bytes-bound floor."""
    from difflet_tpu.tools import deviceless

    out = deviceless.run_python("""
import json, jax, jax.numpy as jnp
from difflet_tpu.tools import deviceless, estimate as E
from difflet_tpu.layers import sparse_masks as M
from difflet_tpu.layers.sdpa import attention
dev = deviceless.topology_devices('v5e:2x2')[0]
_, chip, _ = deviceless.compile_target('v5e:2x2')
s = jax.sharding.SingleDeviceSharding(dev)
plan = M.plan(M.parse('sta:tile=4,8,32,window=2,2,1'), (16, 32, 32))  # 16384 tokens, 16 tiles of 1024
a = jax.ShapeDtypeStruct((1, plan.tokens, 8, 128), jnp.bfloat16, sharding=s)
res = {}
for name, sp in (('dense', None), ('sparse', plan)):
    c = jax.jit(lambda q, k, v: attention(q, k, v, impl='splash', sparse=sp)).trace(a, a, a).lower().compile()
    b = E.summarize(E.estimate(c.as_text(), chip))
    res[name] = dict(ms=sum(v for k, v in b['pallas_kernels_ms'].items() if 'splash' in k),
                     density=b.get('attention_density'))
res['plan_density'] = plan.density()
print(json.dumps(res))
""")
    d = out["plan_density"]
    assert d == 0.25  # (2/4)^2 of the tile pairs: 4 x 4 x 1 tiles, a 2 x 2 x 1 window
    assert out["sparse"]["density"] == {str(d): 1} and out["dense"]["density"] is None
    np.testing.assert_allclose(out["sparse"]["ms"], d * out["dense"]["ms"], rtol=0.02)


def test_the_bench_loop_runs_sparse_steps(tmp_path):
    """`python -m difflet_tpu.bench --attention`: the timed loop runs every step sparse (another
    result than the dense loop's) under TP and SP and says so in its JSON; a model without
    block-sparse attention is refused before any work."""
    import json

    from difflet_tpu.bench import cli

    results = {}
    for name, extra in (("dense", []), ("sparse", ["--attention", "sta:window=1,2,1,tile=2,4,16"])):
        out = tmp_path / f"{name}.json"
        argv = ["--model", "wan:tiny", "--height", "128", "--width", "256", "--frames", "9", "--steps", "2", *extra]
        assert cli.main([*argv, "--json", str(out)]) == 0
        results[name] = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert {r["attention"] for r in results["sparse"].values()} == {"sta:window=1,2,1,tile=2,4,16"}
    assert results["sparse"]["tp"]["sha256"] != results["dense"]["tp"]["sha256"]
    assert all("error" not in r for r in results["sparse"].values())
    assert cli.main(["--model", "flux:tiny", "--steps", "1", "--attention", "sta"]) == 2
