"""One Runner for every port: diffusers' forward kwargs in, diffusers' sample out.

`Runner(model, mesh=None, config=None, mode=None)(**kwargs)`:

1. validates (the port's `prepare`, before anything compiles);
2. pads eagerly by one rule (`row_multiple`), so every rank runs one program;
3. builds the step inputs on the host (patches, RoPE tables: `constant`
   caches those per geometry) and places them with their PartitionSpecs;
4. calls the compiled step: one `jax.jit` of one `jax.shard_map` over the
   mesh (plain `jax.jit` on one device), compiled once per static geometry,
   with the Runner's `compiler_options`;
5. finishes eagerly (cut the pad off, unpatchify).

`Runner.trace(**abstract_kwargs)` runs the same path with ShapeDtypeStructs,
for deviceless compiles: `runner.trace(**kw).lower().compile()`.

The Runner never changes the model it is given: parameters are placed on the
mesh as a new state (a no-op for a model loaded onto this mesh), so one model
serves Runners of any mode and can be saved at any time.

Batch axes (`cfg`, `data`; difflet_tpu.parallel.mesh): parameters are sharded over
`tp` only, so they are replicated over the batch axes; a port marks the batch
axis of each step input and output with `BATCH` in its PartitionSpecs
(`run.batch_spec()`, `run.row_spec()` includes it), and the Runner replaces
it by the mesh's batch axes. Each `cfg` x `data` group then runs the TP/SP
step on its own rows; `Parallel`'s collectives name only `tp`. A batch that
does not split over cfg x data is refused before anything compiles.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from difflet_tpu import checks, runtime
from difflet_tpu.parallel import padding, site_plan
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import BATCH, TP, batch_axes, batch_ways, mesh_shape
from difflet_tpu.parallel.modes import Parallel, check_divisible, param_specs


def _is_abstract(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def model_dtype(model):
    """The compute dtype of a model: the dtype of its largest parameter."""
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    if not leaves:
        raise ValueError("the model has no parameters")
    return jnp.dtype(max(leaves, key=lambda x: int(np.prod(x.shape))).dtype)


def check_runner_args(mesh, config, mode) -> None:
    """The Runner's mesh, config and mode, each refused with what is expected."""
    if mesh is not None and (not isinstance(mesh, jax.sharding.Mesh) or TP not in mesh.axis_names):
        what = (f"a mesh with axes {tuple(mesh.axis_names)}, no 'tp'" if isinstance(mesh, jax.sharding.Mesh)
                else f"{mesh!r} is not a jax.sharding.Mesh")
        raise ValueError(f"mesh: {what}; a Runner needs a mesh with a 'tp' axis (difflet_tpu.make_mesh(), "
                         f"optionally with cfg / data axes), or None for one device")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config: {config!r} is not a difflet_tpu.Config (a mode goes in mode=, e.g. "
                        f"Runner(model, mesh, mode='sp'))")
    if mode is not None and mode not in ("tp", "sp", "sp-xla"):
        raise ValueError(f"mode {mode!r}: use 'tp', 'sp' or 'sp-xla' (or None: the config's choice)")
    if mode is not None and mesh is None:
        raise ValueError(f"mode {mode!r} needs a mesh (difflet_tpu.make_mesh(n)); with mesh=None the model runs "
                         f"on one device, so leave mode=None")


class Runner:
    """Runs a port's model on one device (`mesh=None`), under TP or under SP.

    Args:
      model: a port model (built, loaded, or `runtime.abstract_model(...)` for
        `trace` only). Its port is found from its class.
      mesh: a mesh from `difflet_tpu.make_mesh` (`tp`, optionally `cfg` / `data`
        batch axes), or None for one device.
      config: `difflet_tpu.Config` (default: the environment): `sp` picks SP over
        TP; the ring kernels; `compile_cache`.
      mode: overrides the config's choice: "tp", "sp" or "sp-xla".
      pad: under SP, pad token streams to `row_multiple()` (pad keys masked;
        default `Config.sp_pad`, on);
        False refuses inputs SP cannot split, with the rule in the error.
      compiler_options: XLA options for every compile of the step (e.g. TPU
        collective-matmul flags for sp-xla).
      check_finite: after each call, raise `checks.NonFiniteError` if the
        output has a NaN or inf (one device-side reduction; for serving loops).
      **options: the port's own options (its `PortSpec.options`, e.g. Wan's
        `cache_text`).

    The Runner never changes the model it is given and keeps no reference to it:
    it holds the parameter arrays (placed on the mesh; the same arrays when they
    already were). `offload()` / `load()` move its own copy between host and
    device memory (a two-expert pipeline's idle expert, `Config.expert_offload`).
    """

    def __init__(self, model, mesh=None, config: Config | None = None, mode: str | None = None, *,
                 pad: bool | None = None, compiler_options: dict | None = None, check_finite: bool = False,
                 **options):
        from difflet_tpu import models

        check_runner_args(mesh, config, mode)
        self.spec = models.spec_for_model(model)
        unknown = set(options) - set(self.spec.options)
        if unknown:
            known = ", ".join(sorted(self.spec.options)) or "none"
            raise TypeError(f"unknown {self.spec.name} Runner options {sorted(unknown)} (port options: {known})")
        self.options = {**self.spec.options, **options}
        self.cfg = model.config
        self.mesh = mesh
        self.config = Config.from_env() if config is None else config
        if self.config.compile_cache:  # before the first compile
            runtime.enable_compile_cache(self.config.compile_cache)
        self.par = Parallel.for_mesh(mesh, self.config, mode=mode, ag_default=self.spec.ag_default)
        self.pad = self.config.sp_pad if pad is None else bool(pad)
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self.check_finite = bool(check_finite)
        self.dtype = model_dtype(model)
        for name, heads in self.spec.heads(self.cfg).items():
            if heads % self.par.size:
                raise ValueError(f"{self.spec.name}: {name}={heads}: {heads} heads do not divide over "
                                 f"tp={self.par.size} ranks (TP and SP split attention heads)")
        self._graphdef, state = nnx.split(model)
        self.abstract = any(_is_abstract(x) for x in jax.tree_util.tree_leaves(state))
        self.batch_axes = batch_axes(mesh)
        self.batch_ways = batch_ways(mesh)
        self._param_specs = None
        self.plan = self.spec.plan_for(self.par)
        if mesh is not None:
            check_divisible(self.plan, state, self.par.size)
            self._param_specs = param_specs(state, self.plan)
            if not self.abstract:  # a new state; a no-op for arrays already placed this way
                state = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state,
                                     self._param_specs)
            else:  # ShapeDtypeStructs (deviceless compiles): this Runner's shardings, which the
                # step's shard_map expects (an abstract model built with `spec.plan` differs
                # where `plan_for` replicates a weight, and would be resharded in the step)
                sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
                state = jax.tree.map(lambda x, s: sds(x, s) if _is_abstract(x) else x, state, self._param_specs)
        elif not self.abstract:  # committed to its device (the same buffers), as `load()` brings them back
            state = jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, state)
        self._state = state
        self._host = None           # the parameters in host memory once offload() ran
        self._device_shardings = None
        self._steps = {}
        self._constants = {}      # key -> host value (RoPE tables, masks)
        self._constant_ids = set()  # ids of those host arrays
        self._placed = {}         # (id, spec) -> placed array
        self.state = {}  # port-owned per-Runner state (e.g. Wan's text K/V cache)
        self.mask_pad_keys = True  # tests turn this off to show the pad-key mask matters
        for name, method in self.spec.methods.items():
            setattr(self, name, method.__get__(self))

    @property
    def model(self):
        """The model as this Runner holds it: its graph over its current parameters (on
        the mesh, or in host memory after `offload()`); a new object per access. The
        Runner keeps no reference to the model object it was given, only the arrays."""
        return nnx.merge(self._graphdef, self._state)

    # ---- host offload (Config.expert_offload, pipeline.Denoiser) --------------

    @property
    def resident(self) -> str:
        """Where the parameters the step reads are: "device", or "host" after `offload()`."""
        return "host" if self._host is not None and self._state is self._host else "device"

    def offload(self) -> None:
        """Moves the parameters to host memory (`runtime.HOST_MEMORY_KIND`, same mesh and
        PartitionSpecs); the step refuses to run until `load()`. The first call copies
        them (waited on); the host copy is kept, so a later offload only drops the
        device arrays. The Runner drops its references to its device arrays and to
        its port state (caches derived from them, e.g. Wan's text K/V): the device
        memory is freed when nothing else holds them (after one `gc.collect()` when
        needed: nnx module graphs are reference cycles), so the caller must not keep
        the model it built (or `runner.model`) alive; a warning says when it did."""
        if self.abstract:
            raise ValueError("this Runner holds an abstract model (ShapeDtypeStructs): nothing to offload")
        if self.resident == "host":
            return
        if self._host is None:
            devices = {d for x in jax.tree_util.tree_leaves(self._state) for d in x.sharding.device_set}
            kind = runtime.host_memory_kind(sorted(devices, key=lambda d: d.id))
            if kind is None:
                platform = next(iter(devices)).platform
                raise ValueError(f"{self.spec.name}: the {platform} devices have no {runtime.HOST_MEMORY_KIND} "
                                 f"memory to offload parameters to (set DIFFLET_TPU_EXPERT_OFFLOAD=off)")
            self._device_shardings = jax.tree.map(lambda x: x.sharding, self._state)
            self._host = jax.block_until_ready(
                jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), self._state))
        device = [weakref.ref(x) for x in jax.tree_util.tree_leaves(self._state)]
        if getattr(self, "_lora", None) is not None:  # a LoRA's base copies go too (loading/lora.py)
            from difflet_tpu.loading import lora

            device += [weakref.ref(x) for x in self._lora.base.values()]
            lora.offload_base(self, runtime.HOST_MEMORY_KIND)
        self._state = self._host
        self.state.clear()
        if any(r() is not None for r in device):
            gc.collect()  # nnx module graphs hold reference cycles: a dropped model keeps its arrays until then
            alive = sum(r() is not None for r in device)
            if alive:
                warnings.warn(f"{self.spec.name}: offload(): {alive} of {len(device)} device arrays are still "
                              f"referenced elsewhere (the model given to the Runner?), so their device memory "
                              f"is not freed", stacklevel=2)

    def load(self) -> None:
        """Moves offloaded parameters back to the devices, with the shardings the compiled
        steps were built for (no recompilation); waits for the copy. A no-op when resident."""
        if self.resident == "device":
            return
        self._state = jax.block_until_ready(jax.tree.map(jax.device_put, self._host, self._device_shardings))

    def block_until_ready(self) -> None:
        """Waits until the parameters the step reads are placed (load timings)."""
        jax.block_until_ready(self._state)

    def host_bytes(self) -> int:
        """Bytes per device of the host copy `offload()` made (0 before): it is kept
        after `load()`, so a pipeline's host memory holds every expert once."""
        return 0 if self._host is None else runtime.tree_bytes_per_device(self._host)

    def param_bytes(self) -> int:
        """Bytes per device of the parameters the step reads (`runtime.bytes_per_device`)."""
        return runtime.tree_bytes_per_device(self._state)

    def _check_resident(self):
        if self.resident == "host":
            raise ValueError(f"{self.spec.name}: this Runner's parameters are in host memory (offload()): "
                             f"call load() before running or tracing its step")

    # ---- LoRA adapters (difflet_tpu/loading/lora.py) ----------------------------

    def load_lora_weights(self, pretrained_model_name_or_path_or_dict, adapter_name=None, weight_name=None) -> str:
        """diffusers' `load_lora_weights`: a LoRA safetensors file (a folder with `weight_name`, or a state dict)
        checked against the model, fused into the parameters on the chips as the only active
        adapter (weight 1.0); returns its name. The compiled step is reused."""
        from difflet_tpu.loading import lora

        return lora.load_lora_weights(self, pretrained_model_name_or_path_or_dict, adapter_name, weight_name)

    def set_adapters(self, adapter_names, adapter_weights=None) -> None:
        """diffusers' `set_adapters`: the active adapters and their weights, fused from the base
        parameters (no recompilation)."""
        from difflet_tpu.loading import lora

        lora.set_adapters(self, adapter_names, adapter_weights)

    def unload_lora_weights(self) -> None:
        """diffusers' `unload_lora_weights`: the base parameters back, bit-exact; adapters dropped."""
        from difflet_tpu.loading import lora

        lora.unload_lora_weights(self)

    def get_active_adapters(self) -> list[str]:
        from difflet_tpu.loading import lora

        return lora.active_adapters(self)

    # ---- what ports use in `prepare` ----------------------------------------

    def row_multiple(self) -> int:
        """Token streams are padded to a multiple of this: the site planner's pad rule
        (`site_plan.pad_multiple`: 1 unless SP; under SP 2P, each rank's rows two ring
        halves, and whole sublane tiles per half where a Pallas kernel may be planned)."""
        return site_plan.pad_multiple(self.par, self.dtype)

    def rows(self, n: int, what: str = "tokens") -> int:
        """`n` rows of a stream as compiled: padded by `row_multiple`, or `n` when it
        already splits. With `pad=False` a stream that does not split is refused."""
        mult = self.row_multiple()
        if n % mult == 0:
            return n
        if not self.pad:
            raise ValueError(f"SP cannot split {n} {what} over tp={self.par.size} (a multiple of {mult} is "
                             f"needed): {site_plan.split_rule(self.par.size)}; or let the Runner pad (pad=True)")
        return padding.padded_length(n, mult)

    def pad_stream(self, x, what: str = "tokens", axis: int = 1):
        """`(padded, rows)`: one token stream `x` (its tokens on `axis`; numpy or jax)
        zero-padded eagerly to `rows(n, what)` rows, and that length. Another input of
        the same stream (per-token timesteps, a text mask) takes `padding.pad_to(y, rows)`."""
        rows = self.rows(x.shape[axis], what)
        return padding.pad_to(x, rows, axis), rows

    def row_spec(self, ndim: int = 3, axis: int = 1, batch: int | None = 0) -> P:
        """PartitionSpec of an activation whose `axis` is the token axis (sharded
        over `tp` under SP) and whose `batch` axis is the batch (`BATCH`; None: no
        batch axis)."""
        spec = [None] * ndim
        if batch is not None:
            spec[batch] = BATCH
        if self.par.seq_sharded:
            spec[axis] = TP
        return P(*spec)

    def batch_spec(self, ndim: int = 1, axis: int = 0) -> P:
        """PartitionSpec of an input or output whose `axis` is the batch and whose
        other axes are whole on every rank (timesteps, pooled text, text tokens)."""
        spec = [None] * ndim
        spec[axis] = BATCH
        return P(*spec)

    def resolve_spec(self, spec):
        """A port's PartitionSpec (pytree) with `BATCH` replaced by the mesh's batch
        axes (`cfg`, `data`), or by None when the mesh has none."""
        b = self.batch_axes
        rep = None if not b else (b[0] if len(b) == 1 else b)

        def one(s):
            return P(*(rep if e == BATCH else e for e in s)) if isinstance(s, P) else s

        return jax.tree.map(one, spec, is_leaf=lambda x: isinstance(x, P))

    def constant(self, key, make):
        """`make()` (host arrays, e.g. RoPE tables) computed once per hashable `key`;
        its arrays are placed on the mesh once too (see `_place`)."""
        if key not in self._constants:
            value = make()
            self._constants[key] = value
            self._constant_ids.update(id(a) for a in jax.tree_util.tree_leaves(value))
        return self._constants[key]

    def pad_key_mask(self, *streams):
        """The key mask (False for pad keys) of token streams `(valid, padded)` concatenated
        in that order, `[sum of padded]`, made and placed once per geometry (`constant`);
        None where no stream is padded or pad keys stay unmasked (`mask_pad_keys` off)."""
        if not self.mask_pad_keys or all(n == padded for n, padded in streams):
            return None
        return self.constant(("pad_key_mask", *streams),
                             lambda: np.concatenate([padding.key_mask(n, padded) for n, padded in streams]))

    # ---- steps -------------------------------------------------------------

    def check_batch(self, prep):
        """Every input whose spec marks a batch axis splits over cfg x data; with batch
        axes in the mesh, at least one input and every output carry one. A ValueError
        before anything compiles."""
        if self.batch_ways == 1:
            return
        shape = mesh_shape(self.mesh)
        over = " x ".join(f"{a}={shape[a]}" for a in self.batch_axes)
        marked = 0
        for name, spec in prep.specs.items():
            for axis, e in enumerate(spec):
                if e != BATCH:
                    continue
                marked += 1
                n = np.shape(prep.inputs[name])[axis]
                if n % self.batch_ways:
                    raise ValueError(
                        f"{self.spec.name}: {name} has a batch of {n} rows (axis {axis}), which does not split "
                        f"over the mesh's batch axes {over} = {self.batch_ways} groups: give a batch that is a "
                        f"multiple of {self.batch_ways} (under CFG the batch is [unconditional | conditional], "
                        f"2 rows per prompt), or a mesh without cfg/data axes")
        if not marked:
            raise ValueError(f"{self.spec.name}: the mesh splits the batch over {over}, but no step input of "
                             f"this port marks a batch axis (BATCH in its PartitionSpecs)")
        outs = jax.tree_util.tree_leaves(prep.out_specs, is_leaf=lambda x: isinstance(x, P))
        if any(BATCH not in tuple(o) for o in outs):
            raise ValueError(f"{self.spec.name}: the mesh splits the batch over {over}, but a step output's "
                             f"PartitionSpec has no batch axis: {prep.out_specs}")

    def _step(self, key, specs: dict, out_specs):
        sig = (key, tuple(sorted(specs.items())))
        if sig not in self._steps:
            spec, par, graphdef = self.spec, self.par, self._graphdef

            def inner(state, inputs):
                return spec.forward(nnx.merge(graphdef, state), par, inputs, key)

            if self.mesh is not None:
                inner = jax.shard_map(inner, mesh=self.mesh,
                                      in_specs=(self._param_specs, {k: self.resolve_spec(v) for k, v in specs.items()}),
                                      out_specs=self.resolve_spec(out_specs), check_vma=self.config.check_vma)
            self._steps[sig] = jax.jit(inner, compiler_options=self.compiler_options)
        return self._steps[sig]

    def _input_sharding(self):
        """One device: the sharding of the parameters (the device they live on)."""
        leaf = next(iter(jax.tree_util.tree_leaves(self._state)), None)
        sharding = getattr(leaf, "sharding", None)
        return sharding if isinstance(sharding, jax.sharding.SingleDeviceSharding) else jax.devices()[0]

    def _place(self, inputs: dict, specs: dict) -> dict:
        out = {}
        specs = {k: self.resolve_spec(v) for k, v in specs.items()}
        for name, v in inputs.items():
            cached = id(v) in self._constant_ids
            if cached and (id(v), specs[name]) in self._placed:
                out[name] = self._placed[id(v), specs[name]]
                continue
            if self.mesh is None:
                # committed to the parameters' device: an uncommitted first input (fresh noise) and
                # a committed later one (an update's output) would otherwise trace the step twice
                placed = jax.device_put(v, self._input_sharding())
            else:
                placed = jax.device_put(v, NamedSharding(self.mesh, specs[name]))
            if cached:  # the host array stays alive in _constants, so its id stays unique
                self._placed[id(v), specs[name]] = placed
            out[name] = placed
        return out

    def _abstract_inputs(self, inputs: dict, specs: dict) -> dict:
        def sds(name, v):
            sharding = None if self.mesh is None else NamedSharding(self.mesh, self.resolve_spec(specs[name]))
            return jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v), sharding=sharding)

        return {k: sds(k, v) for k, v in inputs.items()}

    # ---- calls ---------------------------------------------------------------

    def prepare(self, kwargs: dict):
        """The port's `Prepared` for diffusers kwargs (validation and eager inputs); a
        keyword diffusers' forward does not take is a TypeError before that."""
        unknown = set(kwargs) - set(self.spec.forward_args) - set(self.spec.extra_kwargs)
        if unknown:
            raise TypeError(f"unexpected {self.spec.class_names[0]} forward kwargs {sorted(unknown)}")
        checks.check_inputs(kwargs, f"{self.spec.name}: ")  # kinds and empty inputs, one rule for every port
        return self.spec.prepare(self, kwargs)

    def __call__(self, *args, **kwargs):
        """diffusers' forward arguments -> what diffusers returns as the sample."""
        if self.abstract:
            raise ValueError("this Runner holds an abstract model (ShapeDtypeStructs): use trace(), not a call")
        return self.run_prepared(self.prepare(self.spec_kwargs(args, kwargs)))

    def run_prepared(self, prep):
        """Places `prep.inputs`, runs the compiled step for `prep.key` (compiling it
        once) and finishes: what `__call__` does after `prepare`. Ports use it for
        extra steps (Wan's `encode_text`)."""
        self._check_resident()
        self.check_batch(prep)
        step = self._step(prep.key, prep.specs, prep.out_specs)
        out = step(self._state, self._place(prep.inputs, prep.specs))
        if self.check_finite:
            checks.check_finite(out, f"{self.spec.name} step output")
        return prep.finish(out)

    def trace(self, *args, **kwargs):
        """`jax.stages.Traced` of the step for these kwargs; ShapeDtypeStructs stand
        for arrays (their values are never compiled in): for deviceless compiles,
        `runner.trace(**inputs).lower().compile()`. `prepare` still validates them,
        so each stands in as ones, a valid value of every input (an all-ones mask
        keeps every text token; an all-zero one is refused)."""
        self._check_resident()
        kwargs = self.spec_kwargs(args, kwargs)
        concrete = {k: (np.ones(v.shape, v.dtype) if _is_abstract(v) else v) for k, v in kwargs.items()}
        prep = self.prepare(concrete)
        self.check_batch(prep)
        step = self._step(prep.key, prep.specs, prep.out_specs)
        return step.trace(self._state, self._abstract_inputs(prep.inputs, prep.specs))

    def memory(self, *args, **kwargs) -> dict:
        """Device bytes per chip of the compiled step for these kwargs
        (`runtime.memory_report`: arguments with this Runner's parameters,
        outputs, temporaries). Compiles the step; a later call with the same
        shapes reuses that executable."""
        return runtime.memory_report(self.trace(*args, **kwargs).lower().compile())

    def spec_kwargs(self, args, kwargs) -> dict:
        """Positional arguments named as the port's `forward_args` (diffusers' order)."""
        if not args:
            return dict(kwargs)
        names = self.spec.forward_args
        if len(args) > len(names):
            raise TypeError(f"{self.spec.name}: too many positional arguments ({len(args)}); pass keywords")
        dup = set(names[:len(args)]) & set(kwargs)
        if dup:
            raise TypeError(f"{self.spec.name}: got multiple values for {sorted(dup)}")
        return {**dict(zip(names, args)), **kwargs}
