"""A decoder LM's encode with its layers in host memory, streamed through the devices a group at
a time (`Config.encoder_stream`).

Where a text encoder does not fit on the chips beside the transformer (Gemma-3-12B, 6.9 GiB per
chip under tp=4, beside LTX-2's transformer, 10.1 GiB, and the connectors on a v5e-4), staging the
whole transformer out for every encode copies the larger part back each video. `LayerStream`
keeps the LM's layers in host memory instead (`runtime.HOST_MEMORY_KIND`, with their tp
shardings) and its encode copies one group of layers to the devices, runs it, and drops it
before the next: one host-to-device copy of the layers a prompt, one group on the devices at a
time. The embedding table never goes to the devices: the prompt's rows are gathered from a host
copy (a [B, S, D] copy instead of Gemma-3's 262k x 3840 table, which is replicated on every chip).
The final norm stays on the devices (one vector).

Groups of alike layers (Gemma-3's five sliding and one full layer, six at a time) share one
compiled program. The copies and the groups' compute run one after the other (each group
waits for its copy; nothing is prefetched), so at most one group is on the devices.

The result is the model's own `__call__` (the same layers, the same order); only the program
boundaries differ, so it agrees to float rounding (tests/encoders/test_streaming.py).
"""

from __future__ import annotations

import gc
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .decoder_lm import DecoderLM, layer_inputs, scale_embeddings


def default_group(model: DecoderLM) -> int:
    """Layers per group: the smallest whole number of periods of the layer types with at least 4
    layers (Gemma-3: its 5 sliding + 1 full, 6; alike layers: 4), at most every layer. Groups
    that start on a period are alike, so they share one program."""
    types = model.config.layer_types or ("full_attention",)
    period = next(p for p in range(1, len(types) + 1)
                  if all(types[i] == types[i % p] for i in range(len(types))))
    return min(period * -(-4 // period), model.config.num_hidden_layers)


@partial(jax.jit, static_argnums=(0, 4))
def _group_forward(graphdef, state, hidden_states, kinds, sliding: tuple):
    """The group's layers on `hidden_states`: each layer's output (transformers' hidden_states)."""
    layers = nnx.merge(graphdef, state)
    out = []
    for layer, s in zip(layers, sliding):
        hidden_states = layer(hidden_states, *kinds[s])
        out.append(hidden_states)
    return tuple(out)


class LayerStream:
    """`model`'s encode with its layers in host memory (module docstring). Called like the model:
    `(input_ids, attention_mask=None, position_ids=None, hidden_state=-1, output_hidden_states=False)`.

    Making one moves the layers' and the embedding's parameters to host memory, unless they were
    loaded there (`placement.lm_load_kind`), and the final norm to the devices; the model then
    holds host arrays: call it only through this stream. `bytes_per_chip()` is what a prompt's
    encode copies to each chip."""

    def __init__(self, model: DecoderLM, group: int | None = None):
        from difflet_tpu import runtime

        self.model = model
        self.copy_s = 0.0  # seconds spent waiting for the groups' copies, summed over calls
        n = model.config.num_hidden_layers
        group = group or default_group(model)
        if not 1 <= group <= n:
            raise ValueError(f"LayerStream: group {group} must be in [1, {n}] (the LM's layers)")
        self.groups = [(i, min(i + group, n)) for i in range(0, n, group)]
        weight = model.embed_tokens.weight
        self.devices = sorted(weight.sharding.device_set, key=lambda d: d.id)
        kind = runtime.host_memory_kind(self.devices)
        if kind is None:
            raise ValueError(f"the {self.devices[0].platform} devices have no {runtime.HOST_MEMORY_KIND} memory "
                             f"to stream the text encoder's layers from (set DIFFLET_TPU_ENCODER_STREAM=off)")
        on_device = self.devices[0].default_memory().kind  # the parameters may come loaded in host memory
        # replicated: the gathered rows go where the table would be
        self.rows_sharding = weight.sharding.with_memory_kind(on_device)
        self.table = np.asarray(jax.device_get(weight[...]))  # the prompts' rows are gathered here
        self._graphdefs, self._host, self._shardings = [], [], []
        for a, b in self.groups:
            graphdef, state = nnx.split(nnx.List(model.layers[a:b]))
            self._graphdefs.append(graphdef)
            self._shardings.append(jax.tree.map(lambda x: x.sharding.with_memory_kind(on_device), state))
            host = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), state)
            self._host.append(jax.block_until_ready(host))
        for (a, b), host in zip(self.groups, self._host):
            nnx.update(nnx.List(model.layers[a:b]), host)  # the device copies are dropped
        weight.set_value(jax.device_put(weight[...], weight.sharding.with_memory_kind(kind)))
        norm = nnx.state(model.norm, nnx.Param)  # the final norm runs on the devices (loaded in host memory or not)
        nnx.update(model.norm, jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(on_device)), norm))
        gc.collect()  # nnx graphs hold reference cycles: free the dropped device arrays now

    @property
    def config(self):
        return self.model.config

    def check_inputs(self, input_ids, attention_mask=None):
        self.model.check_inputs(input_ids, attention_mask)

    def layers_for(self, hidden_state: int) -> int:
        return self.model.layers_for(hidden_state)

    def bytes_per_chip(self) -> int:
        """The layers' parameter bytes per chip: what one encode copies from host memory."""
        from difflet_tpu import runtime

        return sum(runtime.tree_bytes_per_device(h) for h in self._host)

    def memory_kinds(self) -> set:
        return {x.sharding.memory_kind for h in self._host for x in jax.tree.leaves(h)}

    def __call__(self, input_ids, attention_mask=None, position_ids=None, hidden_state: int = -1,
                 output_hidden_states: bool = False):
        model, config = self.model, self.model.config
        self.check_inputs(input_ids, attention_mask)
        run = config.num_hidden_layers if output_hidden_states else self.layers_for(hidden_state)
        ids = np.asarray(input_ids)
        rows = jax.device_put(self.table[ids], self.rows_sharding)  # the embedding lookup, on the host
        batch, length = ids.shape
        hidden_states, kinds = _prelude(config, batch, length, rows.dtype, rows,
                                        None if attention_mask is None else jnp.asarray(attention_mask),
                                        None if position_ids is None else jnp.asarray(position_ids), run)
        states = [hidden_states]
        for (a, b), graphdef, host, shardings in zip(self.groups, self._graphdefs, self._host, self._shardings):
            if a >= run:
                break
            start = time.perf_counter()
            params = jax.block_until_ready(jax.tree.map(jax.device_put, host, shardings))  # the group's copy
            self.copy_s += time.perf_counter() - start
            sliding = tuple(config.sliding(i) for i in range(a, b))
            out = _group_forward(graphdef, params, states[-1], kinds, sliding)
            states += list(out[:run - a])
            jax.block_until_ready(out)
            del params  # dropped before the next group's copy: one group on the devices at a time
        if run == config.num_hidden_layers:
            states[-1] = _norm(model.norm, states[-1])
        return tuple(states) if output_hidden_states else states[-1]


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 7))
def _prelude(config, batch, length, dtype, rows, attention_mask, position_ids, run):
    """The embedded rows scaled as the model scales them, and every layer's (mask, cos, sin)."""
    return scale_embeddings(config, rows), layer_inputs(config, batch, length, dtype, attention_mask, position_ids, run)


@nnx.jit
def _norm(norm, hidden_states):
    return norm(hidden_states)
