"""Placing a model on a mesh and compiling its step as one `shard_map`.

A port's step is a function `fn(model, par, *inputs) -> outputs` written
once for every mode; `compile_step` wraps it:

* one device (`mesh=None`): `jax.jit(fn)` with `Parallel()`;
* TP / SP: `jax.jit(jax.shard_map(fn))` over the `tp` axis, parameters
  sharded by the model's parallel plan, inputs by the caller's specs.

Padding, slicing and permutations happen before this, eagerly.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding

from difflet_tpu.parallel import Parallel, check_divisible, param_specs


def place(model, mesh, plan):
    """Puts every parameter of `model` on `mesh` with its plan sharding (in place)."""
    state = nnx.state(model)
    check_divisible(plan, state, mesh.shape["tp"])
    specs = param_specs(state, plan)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs)
    nnx.update(model, placed)
    return model


def compile_step(model, fn, par: Parallel, mesh=None, plan=None, in_specs=(), out_specs=None,
                 static_argnums=()):
    """A jitted `step(state, *inputs)` and the model state to call it with.

    `fn(model, par, *inputs)` is the port's step; under a mesh it runs inside
    one `shard_map` with the parameters sharded by `plan`.
    """
    graphdef, state = nnx.split(model)

    def inner(state, *inputs):
        return fn(nnx.merge(graphdef, state), par, *inputs)

    if mesh is None:
        return jax.jit(inner), state
    specs = param_specs(state, plan)
    mapped = jax.shard_map(inner, mesh=mesh, in_specs=(specs, *in_specs), out_specs=out_specs,
                           check_vma=False)
    return jax.jit(mapped), state


def abstract_model(build, mesh=None, plan=None):
    """`build()` as an abstract model (no memory): parameters are
    ShapeDtypeStructs, with their plan shardings on `mesh`. For deviceless
    compiles of released model sizes."""
    model = nnx.eval_shape(build)
    if mesh is None:
        return model
    state = nnx.state(model)
    specs = param_specs(state, plan)
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                          state, specs)
    nnx.update(model, placed)
    return model
