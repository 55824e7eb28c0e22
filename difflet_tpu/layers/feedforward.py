"""diffusers' `FeedForward` (`attention.py`): `net.0.proj` -> activation -> `net.2`."""

from __future__ import annotations

import jax
from flax import nnx

from difflet_tpu.parallel import collective_matmul
from difflet_tpu.layers import nn


# diffusers' "gelu-approximate" / "gelu_tanh": the one the Pallas all-gather kernel
# can apply in its epilogue (nn.epilogue recognises it by identity)
gelu_tanh = collective_matmul.gelu_tanh


# diffusers' activation_fn names -> the function after net.0.proj
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu-approximate": gelu_tanh,
    "linear-silu": jax.nn.silu,
}


class FeedForward(nnx.Module):
    """`net.0.proj` column-parallel with the activation in its epilogue, `net.2`
    row-parallel: under SP an all-gather ring in and a reduce-scatter ring out.

    `inner_dim` defaults to `int(dim * mult)`, `dim_out` to `dim`, as diffusers.
    """

    def __init__(self, dim: int, *, dim_out: int | None = None, mult: float = 4, inner_dim: int | None = None,
                 activation_fn: str = "gelu-approximate", bias: bool = True, dtype, rngs: nnx.Rngs):
        if activation_fn not in ACTIVATIONS:
            raise ValueError(f"activation_fn must be one of {sorted(ACTIVATIONS)}, got {activation_fn!r}")
        inner_dim = int(dim * mult) if inner_dim is None else inner_dim
        self.activation_fn = activation_fn
        self.net = nnx.Dict({"0": nnx.Dict({"proj": nn.Linear(dim, inner_dim, bias=bias, dtype=dtype, rngs=rngs)}),
                             "2": nn.Linear(inner_dim, dim if dim_out is None else dim_out, bias=bias, dtype=dtype,
                                            rngs=rngs)})

    def __call__(self, par, hidden_states):
        """`par`: the rows' Parallel (`Parallel()` for replicated rows on every rank)."""
        (h,) = nn.column(par, hidden_states, [self.net["0"]["proj"]], [ACTIVATIONS[self.activation_fn]])
        return nn.row(par, [(h, self.net["2"])])
