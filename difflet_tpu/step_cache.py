"""Step caching: fewer transformer passes in the denoise loop (first-block residual caching).

The method is cache-dit's DBCache (github.com/vipshop/cache-dit, `cache_dit/cache_factory/
cache_blocks`; ParaAttention's First-Block Cache is its `last=0` case): every transformer call
runs its first `first` blocks; the relative L1 change of their output residual (first leaf of
the carry minus the chain's input: the image / video stream) against the residual of the last
*full* call, `sum|r - r_prev| / sum|r_prev|`, decides: below `threshold` the middle blocks are
not run and the residual they added at that full call is added instead; the last `last` blocks
always run. Options: `difflet_tpu.config.StepCacheOptions` (parsed and checked there only).

How it is built (the choices, and why):

- **Generic, in the block scan.** A model marks its main block stacks `nn.scan_blocks(...,
  chain=True)` (FLUX's double then single stacks, Wan's blocks, ...) and, where its carry holds
  values derived from the stream (Wan's row moments, LTX-2's sum of squares), a `derive` that
  recomputes them: that is the whole per-port hook. While a cached step is traced, `BlockChain`
  is the active chain (`nn.BLOCK_CHAIN`) and splits the stacks into first / middle / last
  blocks. The middle residual is kept per stack segment (`out - in` of each stack's middle
  part); between two stacks the models only concatenate or slice rows (FLUX's
  `single_stream_rows`), linear maps of the carry, so reusing each segment's residual is
  exactly DBCache's reuse of the whole middle's residual.
- **One program with `lax.cond`.** The decision is taken on the devices, from `psum`s over
  every mesh axis (tp and the batch axes cfg / data) of the two L1 sums, so it is one value on
  every rank and every process: under TP, SP, CFG-parallel or multi-host no rank can take the
  other branch (the collectives in the skipped blocks cannot hang). The step is one compiled
  program per geometry (the same count as without the cache); the host reads the decision after
  the step (it already waits for each step), for the counts and the warmup / max_skips rules,
  which it applies by the `mode` control (decide / full / cached). The alternative, two
  programs (the first blocks returning the change to the host, then the rest or the cached
  apply), costs a host round trip inside every step and a second dispatch, and its two
  programs hold the same weights' parameters twice in the compile cache; a cached step of the
  single program runs the first and last blocks plus one add per carry leaf, so the two
  programs could not be faster. docs/caching.md has the estimate.
- **The cache arrays stay on the devices**, as each rank's own values: a leaf is stored with a
  leading axis over the mesh axes it varies over (`jax.typeof(x).manual_axis_type.varying` when
  `Config.check_vma` is on, every axis otherwise), so nothing is gathered or moved between
  steps. Their shapes come from one abstract trace (`jax.eval_shape`) of the step before the
  first compile.
- **CFG.** A pipeline that runs its conditional and unconditional rows in one batch (Wan,
  HunyuanVideo, LTX-2) gets one decision for the batch from the sums over all its rows, as
  ParaAttention's First-Block Cache does for a batched CFG call; a pipeline that runs them as
  two calls (FLUX's and Qwen-Image's true CFG) gives each call its own cache `slot`, as
  cache-dit's separate-CFG contexts do. A slot starts over (warmup again) when its runner
  changes: Wan 2.2 A14B's expert switch.

The cache arrays are the carry of the chain (each segment's middle residual) plus the first
blocks' residual, per slot: FLUX.1-dev at 1024x1024 with `first=1` under TP (4608 + 4096) x 3072
bf16 values per device, 53 MB; under SP on 4 chips each rank's rows, 20.4 MB (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from difflet_tpu import checks
from difflet_tpu.config import ConfigError, StepCacheOptions, parse_step_cache
from difflet_tpu.layers import nn

logger = logging.getLogger(__name__)

__all__ = ["StepCacheOptions", "parse_step_cache", "StepCache", "BlockChain", "cached_call", "StepCacheError",
           "ConfigError"]

DECIDE, FULL, CACHED = 0, 1, 2  # the `mode` control of a cached step


class StepCacheError(ValueError):
    """The cache options do not fit the model (its block chain), or a forced pattern cannot run."""


# --------------------------------------------------------------------------
# Trace time: the chain of block stacks, split into first / middle / last blocks
# --------------------------------------------------------------------------

class BlockChain:
    """What `nn.scan_blocks(..., chain=True)` runs while a cached step is traced.

    `layout`: the chain's stack sizes (None in the shape pass, which records them);
    `state`: the slot's cache arrays on this rank (None in the shape pass: zeros);
    `controls`: {"mode": DECIDE / FULL / CACHED, "threshold": float32}; `axes`: the mesh
    axes the L1 sums are reduced over (every axis, so the decision is one value)."""

    def __init__(self, options: StepCacheOptions, layout, state, controls, axes):
        self.first, self.last = options.first, options.last
        self.layout, self.state, self.controls, self.axes = layout, state, controls, axes
        self.sizes = []      # the stacks as traced
        self.new_state = {}  # what the next call reads
        self.skip = None     # the decision (a traced bool, one value on every rank)
        self.diag = {}

    def scan(self, blocks, carry, fn, xs, derive):
        k, offset, n = len(self.sizes), sum(self.sizes), nn.num_blocks(blocks)
        self.sizes.append(n)
        total = None if self.layout is None else sum(self.layout)
        a = min(n, max(0, self.first - offset))  # this stack's first blocks: [0, a)
        b = n if total is None else min(n, max(a, total - self.last - offset))  # its last blocks: [b, n)
        # each segment between barriers, as the whole stack's scan is a loop of its own in the plain
        # step: XLA inlines a one-block scan, and its ops fused with the split's would round
        # differently (threshold 0 would then not be the plain step bit for bit)
        barrier = jax.lax.optimization_barrier
        run = lambda c, start, stop: barrier(nn.scan_range(blocks, barrier(c), fn, xs, start, stop)) if stop > start else c
        entry = carry
        carry = run(carry, 0, a)
        if k == 0:
            self.decide(entry, carry)
        if b > a:
            carry = self.middle(f"stack{k}", carry, lambda c: run(c, a, b), derive)
        return run(carry, b, n)

    def decide(self, entry, out):
        """The first blocks' residual against the last full call's: the skip decision."""
        r = jax.tree_util.tree_leaves(out)[0] - jax.tree_util.tree_leaves(entry)[0]
        prev = jnp.zeros_like(r) if self.state is None else self.state["first"]
        f32 = jnp.promote_types(r.dtype, jnp.float32)
        num = jnp.sum(jnp.abs(r.astype(f32) - prev.astype(f32)))
        den = jnp.sum(jnp.abs(prev.astype(f32)))
        if self.axes:
            num, den = jax.lax.psum((num, den), self.axes)
        mode = self.controls["mode"]
        self.skip = (mode == CACHED) | ((mode == DECIDE) & (num < self.controls["threshold"].astype(f32) * den))
        self.new_state["first"] = jnp.where(self.skip, prev, r)  # the last full call's, as DBCache keeps it
        self.diag = {"change": jnp.where(den > 0, num / jnp.where(den > 0, den, 1), jnp.inf).astype(jnp.float32),
                     "skipped": self.skip}

    def middle(self, name, carry, run, derive):
        """The middle blocks of one stack, or their residual from the last full call."""
        def full(c):
            out = run(c)
            return out, jax.tree.map(lambda o, i: o - i, out, c)

        if self.state is None:  # the shape pass
            carry, residual = full(carry)
        else:
            cached = self.state[name]

            def reuse(c):
                out = jax.tree.map(lambda i, r: i + r, c, cached)
                return (out if derive is None else derive(out)), cached

            carry, residual = jax.lax.cond(self.skip, reuse, full, carry)
        self.new_state[name] = residual
        return carry

    def check(self) -> list:
        """The traced layout, checked against the options (before anything compiles)."""
        sizes, first, last = self.sizes, self.first, self.last
        if not sizes:
            raise StepCacheError("this model marks no block chain (nn.scan_blocks(..., chain=True)): it cannot "
                                 "be step-cached")
        if first > sizes[0]:
            raise StepCacheError(f"cache first={first}: the model's first block stack has {sizes[0]} blocks "
                                 f"(the first blocks must lie in it; its stacks: {sizes})")
        if last > sizes[-1] or first + last >= sum(sizes):
            raise StepCacheError(f"cache first={first}, last={last}: the model's block chain {sizes} "
                                 f"({sum(sizes)} blocks) leaves no middle block to cache (first + last < "
                                 f"{sum(sizes)}, last <= {sizes[-1]})")
        return list(sizes)


# --------------------------------------------------------------------------
# The compiled cached step (one per Runner, geometry and options)
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One cache array on one rank: its shape, dtype and the mesh axes it varies over."""

    shape: tuple
    dtype: object
    axes: tuple


def _vma(x, mesh, check_vma: bool) -> tuple:
    if mesh is None:
        return ()
    if not check_vma:  # no types to read: every rank keeps its own copy
        return tuple(mesh.axis_names)
    vma = jax.typeof(x).manual_axis_type.varying
    return tuple(a for a in mesh.axis_names if a in vma)


def _inner(runner, key, options, layout, record=None):
    spec, par, graphdef = runner.spec, runner.par, runner._graphdef
    axes = () if runner.mesh is None else tuple(runner.mesh.axis_names)
    mesh, check_vma = runner.mesh, runner.config.check_vma

    def inner(params, inputs, state, controls):
        local = None if state is None else jax.tree.map(lambda x: x[0], state)
        chain = BlockChain(options, layout, local, controls, axes)
        token = nn.BLOCK_CHAIN.set(chain)
        try:
            out = spec.forward(nnx.merge(graphdef, params), par, inputs, key)
        finally:
            nn.BLOCK_CHAIN.reset(token)
        if record is not None:  # the shape pass: what the state will be, read at trace time
            leaves, treedef = jax.tree.flatten(chain.new_state)
            record.update(layout=chain.check(), treedef=treedef,
                          leaves=[_Leaf(tuple(x.shape), x.dtype, _vma(x, mesh, check_vma)) for x in leaves])
            return out, chain.diag
        return out, jax.tree.map(lambda x: x[None], chain.new_state), chain.diag

    return inner


def _leaf_spec(leaf: _Leaf) -> P:
    return P(leaf.axes if leaf.axes else None, *([None] * len(leaf.shape)))


def _global_shape(leaf: _Leaf, mesh) -> tuple:
    ways = 1 if mesh is None else math.prod(mesh.shape[a] for a in leaf.axes)
    return (ways, *leaf.shape)


def _compiled(runner, prep, options, fixed_mode: int | None = None):
    """(step, meta): the cached step for `prep`'s geometry, and its cache arrays' layout.
    `fixed_mode` (estimates only): the mode compiled in as a constant, so XLA keeps one branch."""
    steps = runner.__dict__.setdefault("_cached_steps", {})
    shapes = tuple(sorted((k, np.shape(v), str(jnp.result_type(v))) for k, v in prep.inputs.items()))
    sig = (prep.key, tuple(sorted(prep.specs.items())), shapes, options.first, options.last, fixed_mode)
    if sig in steps:
        return steps[sig]
    mesh = runner.mesh
    controls = {"mode": jax.ShapeDtypeStruct((), jnp.int32), "threshold": jax.ShapeDtypeStruct((), jnp.float32)}
    control_specs = {"mode": P(), "threshold": P()}
    diag_specs = {"change": P(), "skipped": P()}
    in_specs = {k: runner.resolve_spec(v) for k, v in prep.specs.items()}
    out_specs = runner.resolve_spec(prep.out_specs)
    record = {}
    shape_fn = _inner(runner, prep.key, options, None, record)
    shape_step = lambda params, inputs, controls: shape_fn(params, inputs, None, controls)
    if mesh is not None:
        shape_step = jax.shard_map(shape_step, mesh=mesh, in_specs=(runner._param_specs, in_specs, control_specs),
                                   out_specs=(out_specs, diag_specs), check_vma=runner.config.check_vma)
    try:
        jax.eval_shape(shape_step, runner._state, runner._abstract_inputs(prep.inputs, prep.specs), controls)
    except StepCacheError as e:
        raise StepCacheError(f"{runner.spec.name}: {e}") from None
    leaves = record["leaves"]
    state_specs = jax.tree.unflatten(record["treedef"], [_leaf_spec(x) for x in leaves])
    fn = _inner(runner, prep.key, options, record["layout"])
    if fixed_mode is not None:
        inner_fn = fn
        fn = lambda params, inputs, state, controls: inner_fn(
            params, inputs, state, {"mode": jnp.int32(fixed_mode), "threshold": controls["threshold"]})
    if mesh is not None:
        fn = jax.shard_map(fn, mesh=mesh, in_specs=(runner._param_specs, in_specs, state_specs, control_specs),
                           out_specs=(out_specs, state_specs, diag_specs), check_vma=runner.config.check_vma)
    steps[sig] = (jax.jit(fn, compiler_options=runner.compiler_options), record)
    return steps[sig]


def _zeros(runner, record):
    """The empty cache of a slot (its first call is a full pass, so the values are never read):
    made by one program per geometry, compiled once (`record["zeros"]`)."""
    if "zeros" not in record:
        mesh = runner.mesh
        shapes = [(_global_shape(x, mesh), x.dtype) for x in record["leaves"]]
        one = runner._input_sharding() if mesh is None else None
        one = one if one is None or isinstance(one, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(one)
        shardings = ([one] * len(shapes) if mesh is None else
                     [NamedSharding(mesh, _leaf_spec(x)) for x in record["leaves"]])
        record["zeros"] = jax.jit(lambda: [jnp.zeros(s, d) for s, d in shapes], out_shardings=shardings)
    return jax.tree.unflatten(record["treedef"], record["zeros"]())


def trace_cached(runner, options: StepCacheOptions, fixed_mode: int | None = None, **kwargs):
    """`jax.stages.Traced` of the cached step for these kwargs (ShapeDtypeStructs stand for
    arrays, as `Runner.trace` takes them): for deviceless compiles. `fixed_mode`: FULL or CACHED
    compiled in (one branch's cost), None: the decision at run time (the program `cached_call` runs)."""
    concrete = {k: (np.ones(v.shape, v.dtype) if isinstance(v, jax.ShapeDtypeStruct) else v) for k, v in kwargs.items()}
    prep = runner.prepare(concrete)
    step, record = _compiled(runner, prep, options, fixed_mode)
    mesh = runner.mesh
    state = jax.tree.unflatten(record["treedef"], [
        jax.ShapeDtypeStruct(_global_shape(x, mesh), x.dtype,
                             sharding=None if mesh is None else NamedSharding(mesh, _leaf_spec(x)))
        for x in record["leaves"]])
    replicated = None if mesh is None else NamedSharding(mesh, P())
    controls = {"mode": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
                "threshold": jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)}
    return step.trace(runner._state, runner._abstract_inputs(prep.inputs, prep.specs), state, controls)


def cache_bytes(runner, options: StepCacheOptions, **kwargs) -> int:
    """Bytes per device of one cache slot's arrays for these kwargs (after `trace_cached`)."""
    trace_cached(runner, options, **kwargs)
    record = next(r for (_, r) in runner._cached_steps.values())
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in record["leaves"])


def cached_call(runner, kwargs: dict, options: StepCacheOptions, state, mode: int):
    """One transformer call with the step cache: `(output as runner(**kwargs) returns it, the new
    cache arrays, {"change": float, "skipped": bool})`. `state`: the slot's arrays from the
    previous call, or None (then `mode` must be FULL)."""
    if runner.abstract:
        raise ValueError("this Runner holds an abstract model (ShapeDtypeStructs): use trace(), not a call")
    runner._check_resident()
    prep = runner.prepare(runner.spec_kwargs((), kwargs))
    runner.check_batch(prep)
    step, record = _compiled(runner, prep, options)
    if state is None:
        if mode != FULL:
            raise StepCacheError("the first call of a cache slot must be a full pass (nothing is cached yet)")
        state = _zeros(runner, record)
    controls = {"mode": np.int32(mode), "threshold": np.float32(options.threshold)}
    control_specs = {"mode": P(), "threshold": P()}
    out, state, diag = step(runner._state, runner._place(prep.inputs, prep.specs),
                            state, runner._place(controls, control_specs))
    if runner.check_finite:
        checks.check_finite(out, f"{runner.spec.name} step output")
    diag = jax.device_get(diag)
    return prep.finish(out), state, {"change": float(diag["change"]), "skipped": bool(diag["skipped"])}


# --------------------------------------------------------------------------
# The host side: one pipeline call's cache (slots, rules, counts, the record)
# --------------------------------------------------------------------------

class StepCache:
    """One denoise loop's step cache: `cache(runner, step, slot, kwargs)` replaces
    `runner(**kwargs)`. A slot is one call per step with its own cache (a CFG branch run as its
    own call); it starts over when its runner changes (an expert switch). The rules the host
    applies: a slot's first `warmup` calls and any call after `max_skips` cached ones in a row
    are full passes; `force` fixes the pattern per step."""

    def __init__(self, options: StepCacheOptions):
        self.options = options
        self.slots = {}
        self.records = []  # per call: step, slot, mode, change, skipped (the JSON's "decisions")
        self.full_calls = 0
        self.cached_calls = 0

    def mode(self, step: int, slot: dict) -> tuple[int, str]:
        o = self.options
        if o.force is not None and step < len(o.force) and o.force[step] != "A":
            return (FULL, "forced") if o.force[step] == "F" else (CACHED, "forced")
        if slot["calls"] < o.warmup:
            return FULL, "warmup"
        if slot["skips"] >= o.max_skips:
            return FULL, "max_skips"
        return DECIDE, "threshold"

    def __call__(self, runner, step: int, slot_name: str, kwargs: dict):
        slot = self.slots.get(slot_name)
        reset = slot is not None and slot["runner"] is not runner
        if slot is None or reset:  # a new branch, or the expert switched (Wan 2.2): start over
            slot = self.slots[slot_name] = {"runner": runner, "state": None, "calls": 0, "skips": 0}
        mode, why = self.mode(step, slot)
        if mode == CACHED and slot["state"] is None:
            raise StepCacheError(f"cache force={self.options.force!r}: step {step} ({slot_name}) is forced cached "
                                 f"but nothing is cached yet (the first call, or the first after an expert switch)")
        out, slot["state"], diag = cached_call(runner, kwargs, self.options, slot["state"], mode)
        slot["calls"] += 1
        slot["skips"] = slot["skips"] + 1 if diag["skipped"] else 0
        if diag["skipped"]:
            self.cached_calls += 1
        else:
            self.full_calls += 1
        change = diag["change"] if math.isfinite(diag["change"]) else None
        self.records.append({"step": step, "slot": slot_name, "mode": why, "change": change,
                             "skipped": diag["skipped"], **({"reset": True} if reset else {})})
        return out

    def stats(self) -> dict:
        return {"cache": self.options.spec(), "transformer_calls": self.full_calls,
                "cached_calls": self.cached_calls, "threshold": self.options.threshold, "decisions": list(self.records)}
