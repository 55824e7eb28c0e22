"""Collective matmuls for Megatron-style TP+SP, as bidirectional rings.

Called inside `jax.shard_map` over the `tp` axis of size P:

* `all_gather_matmul(x, weights)`: x is this rank's sequence shard
  `[..., S/P, K]`, each weight a column shard `[K, N_i/P]`; returns, per
  weight, `[..., S, N_i/P]`: every row of the sequence, this rank's columns.
* `matmul_reduce_scatter(pairs)`: pairs `(x_i [..., S, K_i/P], w_i [K_i/P, N])`
  whose products are partial sums over the `tp` axis; returns this rank's rows
  of `sum_i x_i @ w_i`, `[..., S/P, N]`.

Ring layout (bidirectional, Wang et al., ASPLOS 2023). Each rank's shard of
S/P rows splits into two halves of S/(2P) rows. The first half travels forward
(rank r -> r+1), the second backward (r -> r-1), so both directions of every
ICI link carry data and each hop moves half the bytes. After j hops rank r
holds the forward half of rank r-j and the backward half of rank r+j, and
multiplies them while the next hop is in flight: the compiled schedule puts
one matmul between each `collective-permute-start` and its `-done`
(tests/test_collective_matmul_compile.py asserts it). The reduce-scatter runs
the same ring backwards: the accumulator for destination rank d starts at
d+1 (forward) or d-1 (backward), gains that rank's partial product at every
hop, and arrives at d after P-1 hops.

Rules:

* S must be a multiple of 2P (each shard splits into two equal halves).
  Padding is the caller's job and happens eagerly, before the compiled step
  (`difflet_tpu.parallel.padding.pad_tokens`).
* Every rank-dependent value (ring position, which rows an arrived chunk
  owns) comes from `lax.axis_index` at run time, never from a Python constant
  that differs by rank: every rank runs one identical program. (Programs that
  differ by rank assign different receive offsets to their collective
  permutes, and a peer then writes into the wrong buffer: wrong values, inf or
  a hang. See the reference PR's root-cause analysis.)
* Each call executes the plan of its site (`difflet_tpu.parallel.site_plan`,
  where the implementation is decided; `Parallel.column` / `row` pass it, a
  direct call plans from `impl=`): "pallas" runs the Pallas kernels of
  `difflet_tpu.kernels` (kernels/all_gather_matmul_stream/,
  kernels/matmul_reduce_scatter_stream.py: one call each, its ring steps a
  runtime loop, the halves streamed in row chunks through a window of VMEM
  slots, one chunk a half where they fit) with the plan's blocks; "jax" the
  rings below (the planner takes them, with one notice per shape, where the
  kernel was asked for and cannot take the site); "xla" the plain collective +
  dot (the `sp-xla` baseline, which XLA may decompose itself).

Weights are arrays, or `LayerWeight`s: one layer of a stacked `[L, K, N]`
array, as `difflet_tpu.layers.nn.scan_blocks` hands a scanned block its linears.
The Pallas kernels take the stack and the layer index and DMA that layer's
tiles straight out of it, so no per-layer copy of the weight is made; every
other path slices the layer out (`as_array`), as `lax.scan` would have.

Epilogues (per weight, applied to its product rows) are callables, or
`Epilogue`s: a bias and/or an activation the all-gather kernel can apply
itself, on the float32 tile before the cast, so no pass over its output
follows. Every other path (the JAX ring, `sp-xla`, TP) calls the
`Epilogue` like any other function, and the kernel path applies callables
that are not `Epilogue`s after the kernel, as before.

An `Epilogue` with `sum_squares=True` makes that weight's output a pair
`(y, ssq)`: ssq `[..., S, 1]` is each row's sum of squares of y (as rounded
to y's dtype) over this rank's columns, in float32 (float64 for float64),
which the kernel accumulates from its tiles (no pass over y) and every other
path computes from y (the ring per chunk, assembled like y); an across-heads
RMSNorm then needs one psum of it
(`layers.normalization.rms_norm_across_heads(..., sum_sq=)`).

An `Epilogue` with `heads` (a `layers.attention.HeadsOut`) makes that weight's
output head-major `[..., H, S, D]` for attention, per-head RMSNorm, RoPE and
q's scaling done on the way: the kernel does it on its tile and writes each
head to its rows (`kernels.all_gather_matmul_stream.Heads`) where it can
(`heads_reason`; else it runs without it, and `heads` follows the kernel);
every other path calls `heads` on the assembled product (the JAX ring applies
the rest of the epilogue per chunk, `heads` after assembling the rows).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from difflet_tpu.kernels import tiles as kernel_tiles
from difflet_tpu.parallel import site_plan
from difflet_tpu.parallel.mesh import TP
from difflet_tpu.parallel.site_plan import IMPLS, split_rule

ASSEMBLE = ("concat", "dus")


# --------------------------------------------------------------------------
# A weight still inside its stack
# --------------------------------------------------------------------------

class LayerWeight:
    """Layer `layer` (a traced int32 scalar) of stacked weights `stack [L, K, N]`.

    Behaves as the `[K, N]` weight for `shape`, `dtype` and indexing (`w[...]`
    slices the layer out); the kernels read `stack` at `layer` instead.
    """

    def __init__(self, stack: jax.Array, layer: jax.Array):
        self.stack, self.layer = stack, layer

    shape = property(lambda self: self.stack.shape[1:])
    dtype = property(lambda self: self.stack.dtype)
    ndim = property(lambda self: self.stack.ndim - 1)

    def __getitem__(self, key):
        return lax.dynamic_index_in_dim(self.stack, self.layer, axis=0, keepdims=False)[key]


# Activations the Pallas all-gather kernel applies in its epilogue, by name.
def gelu_tanh(y):
    """GELU with the tanh approximation (diffusers' "gelu-approximate")."""
    return jax.nn.gelu(y, approximate=True)


KERNEL_ACTIVATIONS = {"gelu_tanh": gelu_tanh}


@dataclasses.dataclass(frozen=True, eq=False)
class Epilogue:
    """A column-parallel product's epilogue: `activation(y + bias)`.

    bias: None, this rank's `[n]` columns, or a `LayerWeight` of a stacked
      `[L, n]` bias (the all-gather kernel DMAs that layer's row).
    activation: None or a name in `KERNEL_ACTIVATIONS` ("gelu_tanh").
    sum_squares: also return each row's sum of squares of the result, over
      its (this rank's) columns: the epilogue returns `(y, ssq)`, ssq
      `[..., rows, 1]` in `promote_types(y.dtype, float32)`.

    Called on a product (`epilogue(y)`), it adds the bias and applies the
    activation in `y`'s dtype, exactly as the unfused code did (and sums the
    squares of that result); the Pallas all-gather kernel applies it on its
    float32 tile instead (and sums the squares of the tile as rounded to the
    output dtype, i.e. of the same values).
    """

    bias: object = None
    activation: str | None = None
    sum_squares: bool = False
    heads: object = None

    def __post_init__(self):
        if self.activation is not None and self.activation not in KERNEL_ACTIVATIONS:
            raise ValueError(f"Epilogue activation must be None or one of {sorted(KERNEL_ACTIVATIONS)}, "
                             f"got {self.activation!r}")
        if self.bias is not None and getattr(self.bias, "ndim", None) != 1:
            raise ValueError(f"Epilogue bias must be [n] (or a LayerWeight of [L, n]), got shape "
                             f"{getattr(self.bias, 'shape', None)}")
        if self.heads is not None and self.sum_squares:
            raise ValueError("an Epilogue writes heads or sums squares, not both")

    def rowwise(self) -> "Epilogue":
        """This epilogue without `heads`: what applies to rows one chunk at a time."""
        return dataclasses.replace(self, heads=None) if self.heads is not None else self

    def __call__(self, y):
        if self.bias is not None:
            y = y + as_array(self.bias)
        if self.activation is not None:
            y = KERNEL_ACTIVATIONS[self.activation](y)
        if self.heads is not None:
            return self.heads(y)
        return (y, row_sum_squares(y)) if self.sum_squares else y


def row_sum_squares(y):
    """Each row's sum of squares over the last axis, `[..., rows, 1]`, in float32
    (float64 for float64 `y`)."""
    yf = y.astype(jnp.promote_types(y.dtype, jnp.float32))
    return jnp.sum(yf * yf, axis=-1, keepdims=True)


def as_array(w):
    """The weight as an array: a `LayerWeight`'s layer sliced out, an array as is."""
    return w[...] if isinstance(w, LayerWeight) else w


def _layer(weights):
    """The layer of weights that are all `LayerWeight`s of one layer (the kernels then
    read their stacks), else None."""
    if weights and all(isinstance(w, LayerWeight) and w.layer is weights[0].layer for w in weights):
        return weights[0].layer
    return None


def _stacked(weights):
    """(stacks, layer) for the kernels: the stacks of `LayerWeight`s of one
    layer, else the arrays themselves and layer None."""
    layer = _layer(weights)
    if layer is not None:
        return [w.stack for w in weights], layer
    return [as_array(w) for w in weights], None


# --------------------------------------------------------------------------
# Plain references: one collective plus one dot. TP uses matmul_all_reduce.
# --------------------------------------------------------------------------

def all_gather_matmul_reference(x, weights, *, axis_name=TP):
    """`lax.all_gather` on the row axis, then one dot per weight."""
    xg = lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
    return [xg @ as_array(w) for w in weights]


def matmul_reduce_scatter_reference(pairs, *, axis_name=TP):
    """Sum of the dots, then `lax.psum_scatter` on the row axis."""
    y = _sum_dots(pairs)
    return lax.psum_scatter(y, axis_name, scatter_dimension=y.ndim - 2, tiled=True)


def matmul_all_reduce(pairs, *, axis_name=TP):
    """Sum of the dots, then `lax.psum`: the row-parallel output under TP."""
    return lax.psum(_sum_dots(pairs), axis_name)


def _sum_dots(pairs):
    out = None
    for x, w in pairs:
        y = x @ as_array(w)
        out = y if out is None else out + y
    return out


# --------------------------------------------------------------------------
# Checks (trace time, before anything is compiled)
# --------------------------------------------------------------------------

def _check_impl(impl, plan, tiles):
    if plan is not None and (impl is not None or tiles is not None):
        raise ValueError("give a plan (Parallel.column_plan / row_plan) or impl= and tiles=, not both")
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _check_plan(plan, site):
    if plan.site != site:
        raise ValueError(f"the plan is for another site: {plan.site} (this call: {site})")


def column_site(x, weights, epilogues, P) -> kernel_tiles.Site:
    """The column site of `all_gather_matmul(x, weights, epilogues=...)` on a ring of P,
    as the all-gather kernel would take it (what `site_plan.plan` plans); the call's
    shape errors first, before anything is planned or traced."""
    weights = list(weights)
    epilogues = list(epilogues) if epilogues is not None else [None] * len(weights)
    if len(epilogues) != len(weights):
        raise ValueError("all_gather_matmul: one epilogue (or None) per weight")
    for w, e in zip(weights, epilogues):
        if w.ndim != 2 or w.shape[0] != x.shape[-1]:
            raise ValueError(f"all_gather_matmul: weight {w.shape} does not take x {x.shape}")
        if isinstance(e, Epilogue) and e.bias is not None and tuple(e.bias.shape) != (w.shape[1],):
            raise ValueError(f"all_gather_matmul: bias {tuple(e.bias.shape)} does not match weight {w.shape}")
    rows = x.shape[-2]
    if rows % 2:
        raise ValueError(f"all_gather_matmul: this rank's shard has {rows} rows (sequence {rows * P}); "
                         f"{split_rule(P)}")
    from difflet_tpu.kernels import all_gather_matmul_stream as kernel

    layer = _layer(weights)
    fused = [e if isinstance(e, Epilogue) else None for e in epilogues]
    biases = [None if e is None or e.bias is None else (_kernel_bias_rows(e.bias, layer), e.bias.dtype)
              for e in fused]
    heads, _, _ = _kernel_heads(kernel, x, epilogues)
    return kernel_tiles.Site("ag", [x.shape], [w.shape for w in weights], str(x.dtype), P, biases,
                             [None if e is None else e.activation for e in fused],
                             [False if e is None else e.sum_squares for e in fused], heads)


def row_site(pairs, P) -> kernel_tiles.Site:
    """The row site of `matmul_reduce_scatter(pairs)` on a ring of P (as `column_site`)."""
    pairs = list(pairs)
    if not pairs:
        raise ValueError("matmul_reduce_scatter: at least one (x, w) pair")
    rows, width = pairs[0][0].shape[-2], pairs[0][1].shape[-1]
    for x, w in pairs:
        if x.shape[-2] != rows or w.ndim != 2 or w.shape != (x.shape[-1], width):
            raise ValueError(f"matmul_reduce_scatter: pair x {x.shape}, w {w.shape} does not match "
                             f"rows {rows} and width {width}")
    if rows % (2 * P):
        raise ValueError(f"matmul_reduce_scatter: {rows} rows; {split_rule(P)}")
    return kernel_tiles.Site("rs", [x.shape for x, _ in pairs], [w.shape for _, w in pairs],
                             str(pairs[0][0].dtype), P)


# --------------------------------------------------------------------------
# All-gather + matmul
# --------------------------------------------------------------------------

def all_gather_matmul(x, weights, *, axis_name=TP, impl=None, plan=None, assemble="concat",
                      epilogues=None, interpret=False, tiles=None):
    """Gathers the sequence shards of `x` while multiplying them by `weights`.

    Args:
      x: this rank's rows, `[..., S/P, K]`; S a multiple of 2P.
      weights: column shards `[K, N_i/P]` (arrays or `LayerWeight`s), any
        number, widths may differ.
      plan: the site's `site_plan.SitePlan` (`Parallel.column_plan`), executed as is.
      impl, tiles: without a plan, what the site is planned from
        (`site_plan.plan`, no chip constants): impl "jax" (this ring; the
        default), "pallas" (the kernel where it takes the site, else the ring
        with one notice) or "xla"; tiles a `kernel_tiles.KernelTiles` table:
        the kernel's column tile at this site, where the table has one (a tile
        sweep measured it).
      assemble: "concat" (one gather over the arrived chunks, in global row
        order) or "dus" (dynamic_update_slice into a buffer).
      epilogues: optional per-weight row-wise functions (bias, activation)
        applied to each product chunk, so they fuse into the ring's matmuls;
        the Pallas kernel applies `Epilogue`s itself (on its float32 tile)
        and any other function after the kernel.
      interpret: run a Pallas kernel in TPU interpret mode (off TPU).

    Returns:
      A list with one `[..., S, N_i/P]` array per weight, rows in global order;
      for an `Epilogue(sum_squares=True)` the pair `(y, ssq)`, ssq `[..., S, 1]`
      (this rank's columns; not summed over ranks).
    """
    _check_impl(impl, plan, tiles)
    if assemble not in ASSEMBLE:
        raise ValueError(f"assemble must be one of {ASSEMBLE}, got {assemble!r}")
    weights = list(weights)
    epilogues = list(epilogues) if epilogues is not None else [None] * len(weights)
    P = lax.axis_size(axis_name)
    site = column_site(x, weights, epilogues, P)
    finish = lambda ys: [y if e is None else e(y) for y, e in zip(ys, epilogues)]
    if P == 1:
        return finish([x @ as_array(w) for w in weights])
    if plan is None:
        plan = site_plan.plan(site, impl or "jax", tiles=tiles)
    _check_plan(plan, site)
    if plan.impl == "xla":
        return finish(all_gather_matmul_reference(x, weights, axis_name=axis_name))
    if plan.impl == "pallas":
        from difflet_tpu.kernels import all_gather_matmul_stream as kernel

        stacks, layer = _stacked(weights)
        fused = [isinstance(e, Epilogue) for e in epilogues]
        biases = [_kernel_bias(e.bias, layer) if f else None for e, f in zip(epilogues, fused)]
        heads, norms, tables = _kernel_heads(kernel, x, epilogues)
        rope = None if tables is None else tuple(t.astype(jnp.float32) for t in tables)
        kernel_tiles.record(site, plan.blocks)
        ys = kernel.all_gather_matmul_stream(x, stacks, layer=layer, biases=biases, activations=list(site.activations),
                                             sum_squares=list(site.sum_squares), heads=heads, norms=norms, rope=rope,
                                             axis_name=axis_name, blocks=plan.blocks, interpret=interpret)
        # what the kernel did not do follows it: callables that are not `Epilogue`s, and heads
        # it could not write
        out = []
        for y, e, f, hd in zip(ys, epilogues, fused, heads):
            if e is not None and not f:
                y = e(y)
            elif f and e.heads is not None and hd is None:
                y = e.heads(y)
            out.append(y)
        return out
    rowwise = [e.rowwise() if isinstance(e, Epilogue) else e for e in epilogues]
    ys = _ag_ring(x, [as_array(w) for w in weights], rowwise, axis_name, P, assemble)
    return [e.heads(y) if isinstance(e, Epilogue) and e.heads is not None else y for y, e in zip(ys, epilogues)]


def _kernel_heads(kernel, x, epilogues):
    """Per weight the kernel's `Heads` (None where the epilogue has no `heads` or the kernel
    cannot write them: `kernel.heads_reason`, half-width tables, or RoPE tables other
    than the call's first),
    the norm weights, and the call's RoPE tables `(cos, sin)` `[S, D]` (or None)."""
    heads, norms, tables = [], [], None
    for e in epilogues:
        h = e.heads if isinstance(e, Epilogue) else None
        ok = h is not None and kernel.heads_reason(h.head_dim, h.rope is None or bool(h.rope[2])) is None
        if ok and h.rope is not None:
            cos, sin = h.rope[0], h.rope[1]
            ok = cos.ndim == 2 and cos.shape[-1] == h.head_dim and sin.shape == cos.shape
            ok = ok and (tables is None or (tables[0] is cos and tables[1] is sin))
            if ok and tables is None:
                tables = (cos, sin)
        if ok and h.norm is not None and (h.norm.shape != (h.head_dim,) or h.norm.dtype != x.dtype):
            ok = False
        heads.append(kernel.Heads(h.head_dim, h.norm is not None, float(h.eps), h.rope is not None, h.scale)
                     if ok else None)
        norms.append(h.norm if ok and h.norm is not None else None)
    return heads, norms, tables


def _kernel_bias_rows(bias, layer) -> int:
    """Rows of a bias as the kernel takes it (`_kernel_bias`): L for a stack read at the
    weights' layer, else 1."""
    return bias.stack.shape[0] if isinstance(bias, LayerWeight) and layer is not None and bias.layer is layer else 1


def _kernel_bias(bias, layer):
    """A bias as the kernel takes it: `[n]`, or `[L, n]` read at the weights'
    layer (a `LayerWeight` of the same layer); any other stack is sliced here."""
    if bias is None:
        return None
    if isinstance(bias, LayerWeight):
        if layer is not None and bias.layer is layer:
            return bias.stack
        return as_array(bias)
    return bias


def _ag_ring(x, weights, epilogues, axis_name, P, assemble):
    s = x.shape[-2]
    h = s // 2
    idx = lax.axis_index(axis_name)
    fwd = [(i, (i + 1) % P) for i in range(P)]
    bwd = [(i, (i - 1) % P) for i in range(P)]

    def products(chunk):
        out = []
        for w, e in zip(weights, epilogues):
            y = chunk @ w
            out.append(y if e is None else e(y))
        return out

    f, b = x[..., :h, :], x[..., h:, :]
    arrived_f, arrived_b = [], []  # hop j: forward half of rank idx-j, backward half of rank idx+j
    for j in range(P):
        if j < P - 1:  # start the next hop before this hop's matmuls
            f_next = lax.ppermute(f, axis_name, fwd)
            b_next = lax.ppermute(b, axis_name, bwd)
        arrived_f.append(products(f))
        arrived_b.append(products(b))
        if j < P - 1:
            f, b = f_next, b_next

    def assembled(yf, yb):
        if isinstance(yf[0], tuple):  # (y, ssq) chunks of an Epilogue(sum_squares=True)
            return tuple(assembled([a[k] for a in yf], [a[k] for a in yb]) for k in range(len(yf[0])))
        if assemble == "concat":
            return _assemble_concat(yf, yb, idx, P)
        return _assemble_dus(yf, yb, idx, P, s)

    return [assembled([a[i] for a in arrived_f], [a[i] for a in arrived_b]) for i in range(len(weights))]


def _assemble_concat(yf, yb, idx, P):
    """Global rows: rank r's shard is [forward half | backward half] of rank r."""
    r = jnp.arange(P)
    hf = jnp.take(jnp.stack(yf, axis=-3), (idx - r) % P, axis=-3)  # [..., P, h, N]
    hb = jnp.take(jnp.stack(yb, axis=-3), (r - idx) % P, axis=-3)
    both = jnp.concatenate([hf, hb], axis=-2)  # [..., P, 2h, N]
    return both.reshape(*both.shape[:-3], -1, both.shape[-1])


def _assemble_dus(yf, yb, idx, P, s):
    h = s // 2
    shape = (*yf[0].shape[:-2], P * s, yf[0].shape[-1])
    out = jnp.zeros(shape, yf[0].dtype)
    for j in range(P):
        out = lax.dynamic_update_slice_in_dim(out, yf[j], ((idx - j) % P) * s, axis=out.ndim - 2)
        out = lax.dynamic_update_slice_in_dim(out, yb[j], ((idx + j) % P) * s + h, axis=out.ndim - 2)
    return out


# --------------------------------------------------------------------------
# Matmul + reduce-scatter
# --------------------------------------------------------------------------

def matmul_reduce_scatter(pairs, *, axis_name=TP, impl=None, plan=None, interpret=False, tiles=None):
    """This rank's rows of `sum_i x_i @ w_i`, reduced over the `tp` axis.

    Args:
      pairs: one or two `(x_i [..., S, K_i/P], w_i [K_i/P, N])` (w_i an array
        or a `LayerWeight`); all x_i have the same rows, all w_i the same
        width. Two pairs serve FLUX's and HunyuanVideo's single-block
        `proj_out` (attention and MLP halves), summed without concatenating
        their inputs.
      plan: the site's `site_plan.SitePlan` (`Parallel.row_plan`), executed as is.
      impl, tiles: without a plan, what the site is planned from, as
        `all_gather_matmul`'s.

    Returns:
      `[..., S/P, N]`: rows `[r*S/P, (r+1)*S/P)` of the sum for rank r.
    """
    _check_impl(impl, plan, tiles)
    pairs = [(x, w) for x, w in pairs]
    P = lax.axis_size(axis_name)
    site = row_site(pairs, P)
    if P == 1:
        return _sum_dots(pairs)
    if plan is None:
        plan = site_plan.plan(site, impl or "jax", tiles=tiles)
    _check_plan(plan, site)
    if plan.impl == "xla":
        return matmul_reduce_scatter_reference(pairs, axis_name=axis_name)
    if plan.impl == "pallas":
        from difflet_tpu.kernels import matmul_reduce_scatter_stream as kernel

        stacks, layer = _stacked([w for _, w in pairs])
        kernel_tiles.record(site, plan.blocks)
        return kernel.matmul_reduce_scatter_stream([(x, w) for (x, _), w in zip(pairs, stacks)], layer=layer,
                                                   axis_name=axis_name, blocks=plan.blocks, interpret=interpret)
    return _rs_ring([(x, as_array(w)) for x, w in pairs], axis_name, P)


def _rs_ring(pairs, axis_name, P):
    rows = pairs[0][0].shape[-2]
    s = rows // P
    h = s // 2
    dtype = jnp.result_type(*[x.dtype for x, _ in pairs], *[w.dtype for _, w in pairs])
    acc_dtype = jnp.promote_types(dtype, jnp.float32)  # float32 partial sums; float64 stays float64
    idx = lax.axis_index(axis_name)
    fwd = [(i, (i + 1) % P) for i in range(P)]
    bwd = [(i, (i - 1) % P) for i in range(P)]

    def partial(dest, offset, recv=None, after=None):
        xs = [x for x, _ in pairs]
        if recv is not None:
            # This hop's inputs pass one optimization barrier with the received sum
            # (and `after`), so the matmul cannot start before the sum arrives and XLA
            # fuses the add and the cast for the next send into it. Without it XLA
            # hoists the matmuls of the later hops ahead of their transfers and adds
            # each sum in a float32 pass of its own (docs/ablations.md, row 2j).
            xs, recv, _ = lax.optimization_barrier((xs, recv, after))
        acc = None
        for x, (_, w) in zip(xs, pairs):
            xr = lax.dynamic_slice_in_dim(x, dest * s + offset, h, axis=x.ndim - 2)
            y = jnp.matmul(xr, w, preferred_element_type=acc_dtype)
            acc = y if acc is None else acc + y
        return acc if recv is None else acc + recv.astype(acc_dtype)

    recv_f = recv_b = None
    for j in range(P):
        # Hop j: the forward accumulator held here is for rank idx-1-j, the
        # backward one for idx+1+j; at j = P-1 both are for this rank. The backward
        # half also waits for the forward half's sum: the forward sum travels while
        # the backward half is multiplied (otherwise XLA may wait for both
        # transfers first).
        pf = partial((idx - 1 - j) % P, 0, recv_f)
        pb = partial((idx + 1 + j) % P, h, recv_b, None if recv_b is None else pf)
        if j < P - 1:
            recv_f = lax.ppermute(pf.astype(dtype), axis_name, fwd)
            recv_b = lax.ppermute(pb.astype(dtype), axis_name, bwd)
    return jnp.concatenate([pf, pb], axis=-2).astype(dtype)
