"""Running an encoder: input checks before the work, one jitted forward, finite outputs.

`encode(model, input_ids, attention_mask)` is the entry point a pipeline calls for a text
encoder, `encode_image(model, pixel_values)` for CLIP's vision tower. It checks the
inputs on the host (`check_token_inputs`: rank, dtype, ids inside the vocabulary, a 0/1 mask),
runs the model's `__call__` under `jax.jit` (compiled once per model graph and input shape;
with parameters sharded on a mesh GSPMD partitions it), and raises if any output is not
finite. The models' `__call__` itself checks only what a trace can see (shapes, dtypes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_token_inputs(input_ids, attention_mask=None, *, vocab_size: int, max_length: int | None = None,
                       name: str = "encoder"):
    """Raises ValueError/TypeError on bad token inputs. Shapes and dtypes always; the id range
    and the mask's values only for concrete arrays (not under a trace)."""
    shape = getattr(input_ids, "shape", None)
    dtype = getattr(input_ids, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{name}: input_ids must be an integer array [batch, seq], got {type(input_ids).__name__}")
    if len(shape) != 2:
        raise ValueError(f"{name}: input_ids must be [batch, seq], got shape {tuple(shape)}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name}: input_ids must have an integer dtype, got {dtype}")
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{name}: input_ids is empty: shape {tuple(shape)}")
    if max_length is not None and shape[1] > max_length:
        raise ValueError(f"{name}: sequence length {shape[1]} exceeds max_position_embeddings {max_length}")
    if _is_concrete(input_ids):
        ids = np.asarray(input_ids)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name}: input_ids must be in [0, {vocab_size}) (the vocabulary), got [{lo}, {hi}]")
    if attention_mask is None:
        return
    mshape = getattr(attention_mask, "shape", None)
    mdtype = getattr(attention_mask, "dtype", None)
    if mshape is None or tuple(mshape) != tuple(shape):
        raise ValueError(f"{name}: attention_mask must have input_ids' shape {tuple(shape)}, got "
                         f"{None if mshape is None else tuple(mshape)}")
    if not (jnp.issubdtype(mdtype, jnp.integer) or jnp.issubdtype(mdtype, jnp.floating) or mdtype == jnp.bool_):
        raise TypeError(f"{name}: attention_mask must be bool, integer or float 0/1, got {mdtype}")
    if _is_concrete(attention_mask):
        m = np.asarray(attention_mask)
        if not np.isin(m, (0, 1)).all():
            raise ValueError(f"{name}: attention_mask must hold only 0 and 1")


@nnx.jit(static_argnames="options")
def _forward(model, input_ids, attention_mask, position_ids=None, options=()):
    if position_ids is None:  # encoders without position ids (T5, CLIP) are called without them
        return model(input_ids, attention_mask, **dict(options))
    return model(input_ids, attention_mask, position_ids, **dict(options))


@nnx.jit(static_argnames="hidden_state")
def _forward_image(model, pixel_values, hidden_state):
    return model(pixel_values, hidden_state)


def _finite(model, out):
    for i, leaf in enumerate(jax.tree.leaves(out)):
        if not bool(jnp.isfinite(leaf).all()):
            raise FloatingPointError(f"{type(model).__name__}: output {i} of shape {leaf.shape} is not finite")
    return out


def encode(model, input_ids, attention_mask=None, position_ids=None, **options):
    """`model(input_ids, attention_mask, **options)` under `jax.jit` (`options`: static keyword
    arguments such as the decoder LM's `output_hidden_states=True` or `hidden_state=-3`,
    transformers' `hidden_states[-3]`; `position_ids`, an array, only for models that take them:
    the decoder LM), inputs checked first, outputs checked finite. Returns what the model returns
    (an array or a tuple of arrays). `model` may be a `streaming.LayerStream` (a decoder LM whose
    layers stream from host memory, `Config.encoder_stream`): it runs its groups itself."""
    model.check_inputs(input_ids, attention_mask)
    if options.get("hidden_state") is not None:
        model.layers_for(options["hidden_state"])  # a clear error before the compile
    options = {k: v for k, v in options.items() if v is not None}
    from .streaming import LayerStream

    if isinstance(model, LayerStream):  # a decoder LM whose layers stream from host memory (streaming.py)
        return _finite(model.model, model(input_ids, attention_mask, position_ids, **options))
    return _finite(model, _forward(model, jnp.asarray(input_ids),
                                   None if attention_mask is None else jnp.asarray(attention_mask),
                                   None if position_ids is None else jnp.asarray(position_ids),
                                   tuple(sorted(options.items()))))


def encode_image(model, pixel_values, hidden_state: int = -2):
    """`model(pixel_values, hidden_state)` (a `clip_vision.CLIPVisionModel`: transformers'
    `hidden_states[hidden_state]`, by default the `[-2]` Wan 2.1 I2V reads) under `jax.jit`,
    inputs checked first, the output checked finite."""
    model.check_inputs(pixel_values, hidden_state)
    return _finite(model, _forward_image(model, jnp.asarray(pixel_values), hidden_state))
