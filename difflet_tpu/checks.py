"""Checks that keep a wrong result from passing as a success."""

from __future__ import annotations

import jax
import jax.numpy as jnp


class NonFiniteError(FloatingPointError):
    """An output held NaN or inf."""


def check_finite(tree, what: str = "output"):
    """Raises `NonFiniteError` naming `what` if any floating array in `tree` has a NaN
    or inf. One reduction per array on its device; only a bool comes back."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and not bool(jnp.isfinite(x).all()):
            where = jax.tree_util.keystr(path)
            raise NonFiniteError(f"{what}{where} is not finite (NaN or inf)")
    return tree
