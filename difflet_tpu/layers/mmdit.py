"""The MMDiT double-stream and single-stream blocks of FLUX and HunyuanVideo.

diffusers writes them twice (`FluxTransformerBlock` / `FluxSingleTransformerBlock`
in `transformer_flux.py`, `HunyuanVideoTransformerBlock` /
`HunyuanVideoSingleTransformerBlock` in `transformer_hunyuan_video.py`) with the
same structure: adaLN-zero modulation, joint attention with per-head q/k
RMSNorm and `add_{q,k,v}_proj` for the text stream, gated residuals, a GELU-tanh
MLP, and in the single blocks one `proj_out` over `cat([attn, mlp])`. What
differs is a parameter here: the order of the streams in the joint sequence
(FLUX `[text | image]`, HunyuanVideo `[image | text]`), which rows RoPE rotates
(the tables given), FLUX's float16 clip, HunyuanVideo's token_replace
modulation, and the order the submodules are built in (the ports' classes).
Under SP both enter the single blocks the same way (`single_stream_rows`).

Parallel layout (the ports' PLANs add their own rows to `PLAN`): q/k/v,
`add_*_proj`, `proj_mlp` and `ff*.net.0.proj` column-parallel (heads / MLP
columns), `to_out.0`, `to_add_out`, `ff*.net.2` and the two `proj_out` kernels
row-parallel, the adaLN linears column-parallel with their `(B, kD)` outputs
gathered (`normalization.AdaLN`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from difflet_tpu.layers import nn
from difflet_tpu.parallel.modes import COLUMN, ROW

from .attention import HeadsOut, attend, merge_heads, split_heads
from .rope import apply_rotary_emb
from .feedforward import FeedForward, gelu_tanh
from .normalization import AdaLN, Weight, modulate, rms_norm


def joint_attention_plan(prefix: str) -> dict:
    """The PLAN rows of a `JointAttention(added_kv=True)` at module path `prefix`: the q/k/v
    projections of both streams column-parallel (heads), both outputs row-parallel."""
    qkv = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
    return {**{f"{prefix}.{name}": COLUMN for name in qkv}, f"{prefix}.to_out.0": ROW, f"{prefix}.to_add_out": ROW}


PLAN = {
    "transformer_blocks.norm1.linear": COLUMN,
    "transformer_blocks.norm1_context.linear": COLUMN,
    **joint_attention_plan("transformer_blocks.attn"),
    "transformer_blocks.ff.net.0.proj": COLUMN,
    "transformer_blocks.ff.net.2": ROW,
    "transformer_blocks.ff_context.net.0.proj": COLUMN,
    "transformer_blocks.ff_context.net.2": ROW,
    "single_transformer_blocks.norm.linear": COLUMN,
    "single_transformer_blocks.attn.to_q": COLUMN,
    "single_transformer_blocks.attn.to_k": COLUMN,
    "single_transformer_blocks.attn.to_v": COLUMN,
    "single_transformer_blocks.proj_mlp": COLUMN,
    "single_transformer_blocks.proj_out.attn": ROW,
    "single_transformer_blocks.proj_out.mlp": ROW,
    "norm_out.linear": COLUMN,
}


def rope_rows(rope, rows: slice):
    """The RoPE `(cos, sin, split)` of the sequence rows `rows` (None stays None)."""
    return None if rope is None else (rope[0][rows], rope[1][rows], rope[2])


class StreamRope(NamedTuple):
    """A joint sequence's RoPE and its two streams' rows (`stream_rope`)."""

    joint: tuple
    first: tuple
    second: tuple


def stream_rope(rope, n_first: int) -> StreamRope:
    """The RoPE `(cos, sin, split)` of a joint sequence with the rows of its first stream
    (`n_first`) and of its second sliced out, for `JointAttention` under SP. Sliced once
    per step, before the layer loop: inside it XLA slices the tables again every layer."""
    return StreamRope(rope, rope_rows(rope, slice(0, n_first)), rope_rows(rope, slice(n_first, None)))


def clip_fp16(x):
    """FLUX's `clip(-65504, 65504)` of float16 activations (identity otherwise)."""
    return jnp.clip(x, -65504, 65504) if x.dtype == jnp.float16 else x


class JointAttention(nnx.Module):
    """diffusers' `FluxAttention` / HunyuanVideo's `Attention(qk_norm="rms_norm")` with
    their processors. `added_kv`: the text stream's `add_{q,k,v}_proj`,
    `norm_added_{q,k}` and `to_add_out` (double blocks); `pre_only`: no
    `to_out` (single blocks: the block runs q/k/v with its MLP and calls
    `heads_out`). `context_first`: the joint sequence is `[text | image]`
    (FLUX), else `[image | text]` (HunyuanVideo).
    """

    def __init__(self, query_dim: int, heads: int, dim_head: int, *, added_kv: bool = False, pre_only: bool = False,
                 context_first: bool = True, eps: float = 1e-6, dtype, rngs: nnx.Rngs):
        self.heads, self.head_dim, self.eps, self.context_first = heads, dim_head, eps, context_first
        inner = heads * dim_head
        self.norm_q = Weight(dim_head, dtype=dtype)
        self.norm_k = Weight(dim_head, dtype=dtype)
        self.to_q = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
        self.to_k = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
        self.to_v = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
        if not pre_only:
            self.to_out = nnx.Dict({"0": nn.Linear(inner, query_dim, dtype=dtype, rngs=rngs)})
        if added_kv:
            self.norm_added_q = Weight(dim_head, dtype=dtype)
            self.norm_added_k = Weight(dim_head, dtype=dtype)
            self.add_q_proj = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
            self.add_k_proj = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
            self.add_v_proj = nn.Linear(query_dim, inner, dtype=dtype, rngs=rngs)
            self.to_add_out = nn.Linear(inner, query_dim, dtype=dtype, rngs=rngs)

    def _norm(self, t, weight):
        return rms_norm(split_heads(t, self.head_dim), weight.scale[...], self.eps)

    def _rope(self, t, rope):
        if rope is None:
            return t
        cos, sin, split = rope
        return apply_rotary_emb(t, cos[:, None], sin[:, None], split)

    def attend(self, par, q, k, v, rope, kv_mask, sparse=None):
        """Attention over one sequence: q, k (normalized), v `[B, S, heads_local, head_dim]`,
        RoPE (`rope`: (cos, sin `[S, head_dim]`, split) or None) on q and k, `sparse` a
        block-sparse mask over the rows (`sparse_masks.with_dense_tail`) or None;
        returns `[B, S, heads_local * head_dim]`."""
        return merge_heads(attend(par, self._rope(q, rope), self._rope(k, rope), v, kv_mask, sparse=sparse))

    def heads_out(self, rope, added: bool = False):
        """q, k, v as attention takes them (`HeadsOut`): q and k normalised per head
        (`norm_q` / `norm_k`, or the text stream's `norm_added_*`) and rotated by
        `rope` (q also scaled), v head-major."""
        nq, nk = (self.norm_added_q, self.norm_added_k) if added else (self.norm_q, self.norm_k)
        return (HeadsOut(self.head_dim, nq.scale[...], self.eps, rope, scale_q=True),
                HeadsOut(self.head_dim, nk.scale[...], self.eps, rope), HeadsOut(self.head_dim))

    def __call__(self, par, hidden_states, encoder_hidden_states, rope, kv_mask, sparse=None):
        """Joint attention of the image and text streams (each every row, or this rank's
        under SP, gathered by the rings); `rope` covers the joint sequence (identity
        rows where nothing rotates); `sparse`: a block-sparse mask over the joint rows
        (HunyuanVideo's `[video | text]`, `sparse_masks.with_dense_tail`) or None.
        Returns (image out, text out), row-parallel."""
        par.local_heads(self.heads)  # a clear error if the heads do not divide over the ranks
        if par.seq_sharded:
            return self._sequence_parallel(par, hidden_states, encoder_hidden_states, rope, kv_mask, sparse)
        q, k, v = nn.column(par, hidden_states, [self.to_q, self.to_k, self.to_v], heads=True)
        eq, ek, ev = nn.column(par, encoder_hidden_states,
                               [self.add_q_proj, self.add_k_proj, self.add_v_proj], heads=True)
        # per stream: (query, norm weight), (key, norm weight), value
        img = ((q, self.norm_q), (k, self.norm_k), split_heads(v, self.head_dim))
        txt = ((eq, self.norm_added_q), (ek, self.norm_added_k), split_heads(ev, self.head_dim))
        first, second = (txt, img) if self.context_first else (img, txt)
        n = first[0][0].shape[1]
        if isinstance(rope, StreamRope):
            rope = rope.joint
        q, k = (jnp.concatenate([self._norm(*a), self._norm(*b)], axis=1) for a, b in zip(first[:2], second[:2]))
        o = self.attend(par, q, k, jnp.concatenate([first[2], second[2]], axis=1), rope, kv_mask, sparse)
        out_first, out_second = o[:, :n], o[:, n:]
        return self._outputs(par, out_first, out_second)

    def _sequence_parallel(self, par, hidden_states, encoder_hidden_states, rope, kv_mask, sparse=None):
        """Under SP each stream's q, k, v come from its all-gather kernel head-major,
        normalised and rotated (`HeadsOut`: the kernel does it on its tiles); one
        attention call per stream's queries over the joint keys [first | second]
        (the reduce-scatter kernels take each stream's output as a whole array, and
        a row slice of one joint output is a copy: Qwen-Image 55 us a layer,
        estimated); each query row's softmax is over the same keys either way."""
        streams = [(hidden_states, (self.to_q, self.to_k, self.to_v), False),
                   (encoder_hidden_states, (self.add_q_proj, self.add_k_proj, self.add_v_proj), True)]
        if self.context_first:
            streams.reverse()
        n = streams[0][0].shape[1] * par.size  # the first stream's rows, gathered
        ropes = ((rope.first, rope.second) if isinstance(rope, StreamRope)
                 else (rope_rows(rope, slice(0, n)), rope_rows(rope, slice(n, None))))
        (q1, k1, v1), (q2, k2, v2) = (nn.column(par, x, linears, heads=True, heads_out=self.heads_out(r, added))
                                      for (x, linears, added), r in zip(streams, ropes))
        k, v = jnp.concatenate([k1, k2], axis=2), jnp.concatenate([v1, v2], axis=2)
        if sparse is not None:  # the mask is over the joint rows: one call over the joint queries
            o = attend(par, jnp.concatenate([q1, q2], axis=2), k, v, kv_mask, head_major=True, q_scaled=True,
                       sparse=sparse)
            return self._outputs(par, merge_heads(o[:, :n]), merge_heads(o[:, n:]))
        out_first, out_second = (merge_heads(attend(par, q, k, v, kv_mask, head_major=True, q_scaled=True))
                                 for q in (q1, q2))
        return self._outputs(par, out_first, out_second)

    def _outputs(self, par, out_first, out_second):
        encoder_out, hidden_out = (out_first, out_second) if self.context_first else (out_second, out_first)
        hidden_out = nn.row(par, [(hidden_out, self.to_out["0"])])
        encoder_out = nn.row(par, [(encoder_out, self.to_add_out)])
        return hidden_out, encoder_out


class DoubleStreamBlock(nnx.Module):
    """diffusers' `FluxTransformerBlock` / `HunyuanVideoTransformerBlock`: adaLN-zero per
    stream (`norm1`, `norm1_context`), joint attention, gated residuals, a GELU-tanh
    MLP per stream (`ff`, `ff_context`)."""

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int, mlp_dim: int, *,
                 context_first: bool, clip_fp16: bool = False, eps: float = 1e-6, dtype, rngs: nnx.Rngs):
        self.eps, self.clip_fp16 = eps, clip_fp16
        self.norm1 = AdaLN(dim, 6, dtype=dtype, rngs=rngs)
        self.norm1_context = AdaLN(dim, 6, dtype=dtype, rngs=rngs)
        self.attn = JointAttention(dim, num_attention_heads, attention_head_dim, added_kv=True,
                                   context_first=context_first, eps=eps, dtype=dtype, rngs=rngs)
        self.ff = FeedForward(dim, inner_dim=mlp_dim, dtype=dtype, rngs=rngs)
        self.ff_context = FeedForward(dim, inner_dim=mlp_dim, dtype=dtype, rngs=rngs)

    def __call__(self, par, hidden_states, encoder_hidden_states, temb, rope, kv_mask, token_replace=None,
                 sparse=None):
        """hidden_states: the image stream, encoder_hidden_states: the text stream (each
        this rank's rows under SP); `rope`, `kv_mask`: the joint sequence's rows.
        token_replace: see `AdaLN` (image rows only); sparse: `JointAttention`'s."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(par, temb, token_replace)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(par, temb)

        # 1. Joint attention
        norm_hidden_states = modulate(hidden_states, shift_msa, scale_msa, self.eps)
        norm_encoder_hidden_states = modulate(encoder_hidden_states, c_shift_msa, c_scale_msa, self.eps)
        attn_output, context_attn_output = self.attn(par, norm_hidden_states, norm_encoder_hidden_states, rope,
                                                     kv_mask, sparse)

        # 2. Modulation and residual connection
        hidden_states = hidden_states + gate_msa * attn_output
        encoder_hidden_states = encoder_hidden_states + c_gate_msa * context_attn_output
        norm_hidden_states = modulate(hidden_states, shift_mlp, scale_mlp, self.eps)
        norm_encoder_hidden_states = modulate(encoder_hidden_states, c_shift_mlp, c_scale_mlp, self.eps)

        # 3. Feed-forward
        hidden_states = hidden_states + gate_mlp * self.ff(par, norm_hidden_states)
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp * self.ff_context(par, norm_encoder_hidden_states)
        if self.clip_fp16:
            encoder_hidden_states = clip_fp16(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


class PackedProjOut(nnx.Module):
    """The single blocks' `proj_out = Linear(D + F -> D)` over `cat([attn, mlp])`, as two
    kernels over its two input ranges (the loader slices the checkpoint weight,
    `Key(in_range=...)`): `attn` (`[D, D]`, no bias) and `mlp` (`[F, D]`, with
    proj_out's bias). Both row-parallel, so each rank holds the rows of the inputs
    it computed (its heads, its MLP columns): one reduce-scatter (SP) or
    all-reduce (TP) over the two products, the bias added once, no concatenation."""

    def __init__(self, attn_dim: int, mlp_dim: int, out_dim: int, *, dtype, rngs: nnx.Rngs):
        self.attn = nn.Linear(attn_dim, out_dim, bias=False, dtype=dtype, rngs=rngs)
        self.mlp = nn.Linear(mlp_dim, out_dim, dtype=dtype, rngs=rngs)

    def __call__(self, par, attn_output, mlp_hidden_states):
        return par.row([(attn_output, nn.weight(self.attn)), (mlp_hidden_states, nn.weight(self.mlp))],
                       self.mlp.bias[...])


class SingleStreamBlock(nnx.Module):
    """The forward of diffusers' `FluxSingleTransformerBlock` / `HunyuanVideoSingleTransformerBlock`.

    The ports subclass it and build `norm` (`AdaLN(D, 3)`), `proj_mlp`,
    `proj_out` (`PackedProjOut`), `attn` (`JointAttention(pre_only=True)`) in
    diffusers' order, and set `eps` and `clip_fp16`.
    """

    eps: float = 1e-6
    clip_fp16: bool = False

    def __call__(self, par, hidden_states, temb, rope, kv_mask, token_replace=None, sparse=None, order=None):
        """hidden_states: rows of the joint sequence (under SP this rank's; the gathered
        rows are in the order `rope` and `kv_mask` describe). sparse: a block-sparse mask
        over the joint rows (`sparse_masks.with_dense_tail`) or None; order: where the
        gathered rows come from in the joint sequence (`single_stream_order`), None when
        they are in its order."""
        residual = hidden_states
        shift_msa, scale_msa, gate = self.norm(par, temb, token_replace)
        norm_hidden_states = modulate(hidden_states, shift_msa, scale_msa, self.eps)
        attn = self.attn
        par.local_heads(attn.heads)
        # q, k, v and the MLP share one column-parallel group (one all-gather ring under SP);
        # q, k, v come head-major, normalised and rotated (under SP by the kernel itself)
        q, k, v, mlp_hidden_states = nn.column(par, norm_hidden_states,
                                               [attn.to_q, attn.to_k, attn.to_v, self.proj_mlp],
                                               [None, None, None, gelu_tanh], heads=True,
                                               heads_out=[*attn.heads_out(rope), None])
        attn_output = merge_heads(joint_attend(par, q, k, v, kv_mask, sparse, order))
        # proj_out(cat([attn_output, mlp_hidden_states])): two row-parallel pairs, one collective
        hidden_states = residual + gate * self.proj_out(par, attn_output, mlp_hidden_states)
        return clip_fp16(hidden_states) if self.clip_fp16 else hidden_states


def joint_attend(par, q, k, v, kv_mask, sparse=None, order=None):
    """`attend` of head-major, scaled q, k, v `[B, H, S, D]`, block-sparse when `sparse` is given:
    rows gathered in another order than the joint sequence's (`order`, static) are put in the
    joint order for the kernel and back after it (a copy of q, k, v and the output, where the
    attention is quadratic), so one mask serves one device, TP and SP. Returns `[B, S, H, D]`."""
    if sparse is None:
        return attend(par, q, k, v, kv_mask, head_major=True, q_scaled=True)
    if order is None:
        return attend(par, q, k, v, kv_mask, head_major=True, q_scaled=True, sparse=sparse)
    to_joint = np.argsort(order)  # joint row i is gathered row to_joint[i]
    q, k, v = (jnp.take(t, to_joint, axis=2) for t in (q, k, v))
    kv_mask = None if kv_mask is None else jnp.take(kv_mask, to_joint, axis=-1)
    out = attend(par, q, k, v, kv_mask, head_major=True, q_scaled=True, sparse=sparse)
    return jnp.take(out, order, axis=1)  # gathered row j is joint row order[j]


# --------------------------------------------------------------------------
# The single blocks' rows under SP
# --------------------------------------------------------------------------

def single_stream_order(n_first: int, n_second: int, ranks: int) -> np.ndarray:
    """Where the single blocks' gathered rows come from, as indices into the joint
    sequence [first | second] (FLUX: [text | image]; HunyuanVideo: [image | text]).

    Under SP each rank enters the single blocks with its own rows of both streams,
    [first_r | second_r], concatenated locally: no communication. The all-gather
    ring returns the ranks' rows in rank order, so row j of the gathered sequence
    is joint row `order[j]`: [first_0, second_0, first_1, second_1, ...]. Per-token
    inputs of attention (RoPE tables, key masks) are permuted to this order once
    per step; attention is otherwise indifferent to the order of keys.
    """
    if n_first % ranks or n_second % ranks:
        raise ValueError(f"streams of {n_first} and {n_second} rows do not split over {ranks} ranks")
    a, b = n_first // ranks, n_second // ranks
    return np.concatenate([np.concatenate([np.arange(r * a, (r + 1) * a), n_first + np.arange(r * b, (r + 1) * b)])
                           for r in range(ranks)])


def single_stream_rows(par, first, second, tables=(), masks=()):
    """The single blocks' input: `[first | second]` rows (this rank's rows of each
    under SP) with the per-token `tables` (`[S, ...]`) and key `masks` (`[..., S]`)
    in the gathered order (`single_stream_order`); unchanged on one device and TP.
    Returns (x, tables, masks); `x[:, :first.shape[1]]` are the first stream's rows."""
    x = jnp.concatenate([first, second], axis=1)
    if not par.seq_sharded:
        return x, tuple(tables), tuple(masks)
    order = single_stream_order(first.shape[1] * par.size, second.shape[1] * par.size, par.size)
    tables = tuple(None if t is None else jnp.take(t, order, axis=0) for t in tables)
    masks = tuple(None if m is None else jnp.take(m, order, axis=-1) for m in masks)
    return x, tables, masks
