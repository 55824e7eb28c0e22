"""Attention with q/k RMSNorm across all heads: diffusers' `WanAttention` and
`LTX2Attention`, written once for one device, TP and SP.

q/k/v are column-parallel projections (under SP the all-gather ring feeds
them, with each row's sum of squares for the norms), q and k are normalised
over every head's channels (`normalization.rms_norm_across_heads`: the sum is
psum'd over `tp`) and rotated (`layers.rope`), the attention runs on this
rank's heads (`attention.attend`, which dispatches to `sdpa`), and `to_out.0`
is row-parallel. What differs between the models is a parameter:

* `kvpar`: the key side's `Parallel` where keys and queries come from streams
  sharded differently (LTX-2's audio and text stay replicated under SP);
* `kv`: cached K/V (Wan's text, computed once per prompt by `context_kv`), with
  Wan's I2V image tokens as a second attention added before `to_out`;
* `local`: this attention is in the model's `SP_LOCAL_PLAN`; where
  `Parallel.cross_local` holds (the one gather condition) its queries run on
  this rank's rows with every head and replicated weights, and its K/V are
  gathered to every head;
* `gated` (LTX-2's per-head `to_gate_logits`), `perturbation` (LTX-2's STG),
  `row_major` (`nn.column`'s barrier: LTX-2 always, Wan on the local path);
* the RoPE form: `rope.HeadRope` (tables per head; the norm folded into the
  rotation by `rms_norm_rope`) or `rope.GroupedRope` (LTX-2's flat rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from difflet_tpu.layers import nn, sdpa

from .attention import attend, merge_heads, split_heads
from .normalization import Weight, rms_norm_across_heads, rms_scale_across_heads
from .rope import HeadRope, rms_norm_rope


def torch_lerp(start, end, weight):
    """`torch.lerp` as its CPU kernel computes it (exact at weight 0 and 1)."""
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * (end - start), end - (end - start) * (1 - weight))


class AcrossHeadsAttention(nnx.Module):
    """to_q, to_k, to_v, norm_q, norm_k, to_out.0 (diffusers' names), optionally
    `to_gate_logits` (`gated`) or I2V's add_k_proj / add_v_proj / norm_added_k
    (`added_kv_dim`)."""

    def __init__(self, query_dim: int, heads: int, head_dim: int, *, kv_dim: int | None = None,
                 added_kv_dim: int | None = None, bias: bool = True, out_bias: bool = True, eps: float = 1e-6,
                 gated: bool = False, row_major: bool = False, dtype, rngs: nnx.Rngs):
        self.heads, self.head_dim, self.inner_dim, self.eps = heads, head_dim, heads * head_dim, eps
        self.row_major = row_major
        inner, kv_dim = self.inner_dim, query_dim if kv_dim is None else kv_dim
        # parameters in diffusers' order of creation (the random init draws them so)
        self.to_q = nn.Linear(query_dim, inner, bias=bias, dtype=dtype, rngs=rngs)
        self.to_k = nn.Linear(kv_dim, inner, bias=bias, dtype=dtype, rngs=rngs)
        self.to_v = nn.Linear(kv_dim, inner, bias=bias, dtype=dtype, rngs=rngs)
        self.to_out = nnx.Dict({"0": nn.Linear(inner, query_dim, bias=out_bias, dtype=dtype, rngs=rngs)})
        self.norm_q = Weight(inner, dtype=dtype)
        self.norm_k = Weight(inner, dtype=dtype)
        self.to_gate_logits = nn.Linear(query_dim, heads, dtype=dtype, rngs=rngs) if gated else None
        if added_kv_dim is not None:
            self.add_k_proj = nn.Linear(added_kv_dim, inner, dtype=dtype, rngs=rngs)
            self.add_v_proj = nn.Linear(added_kv_dim, inner, dtype=dtype, rngs=rngs)
            self.norm_added_k = Weight(inner, dtype=dtype)
        else:
            self.add_k_proj = self.add_v_proj = self.norm_added_k = None

    def _norm(self, par, x, weight, sum_sq=None):
        return rms_norm_across_heads(par, x, weight.scale[...], self.eps, self.inner_dim, sum_sq=sum_sq)

    def _heads(self, t):
        return t if t.ndim == 4 else split_heads(t, self.head_dim)

    def _qk(self, par, x, sum_sq, weight, rope):
        """q or k normalised across heads and rotated: `[B, S, H, D]` for a `HeadRope` (the
        norm's factor and weight folded into the rotation, `rms_norm_rope`: the same bits,
        no pass writes the normalised x), else flat `[B, S, H * D]`."""
        if isinstance(rope, HeadRope):
            h = par.local_heads(self.heads)
            r = rms_scale_across_heads(par, sum_sq, self.eps, self.inner_dim)[..., None]  # [B, S, 1, 1]
            return rms_norm_rope(split_heads(x, self.head_dim), r, weight.scale[...].reshape(h, self.head_dim),
                                 rope.cos[:, None], rope.sin[:, None], rope.split)
        x = self._norm(par, x, weight, sum_sq)
        return x if rope is None else rope.apply(par, x)

    def _every_head(self, par, t):
        """A K or V of this rank's heads gathered to every head (kept if it has them all)."""
        return t if t.shape[-1] == self.inner_dim else par.gather_columns(t)

    def context_kv(self, par, context, context_image=None, all_heads: bool = False):
        """K/V from replicated context tokens (Wan's text, and I2V's image tokens): local
        columns, no gather, normalised. They do not depend on the latents or the timestep,
        so a pipeline computes them once per prompt (`Runner.encode_text`). `all_heads`:
        every head's K/V on every rank (gathered once here; `par.cross_local`'s cache)."""
        kv = {"k": self._norm(par, self.to_k(context), self.norm_k), "v": self.to_v(context)}
        if self.add_k_proj is not None:
            kv["k_img"] = self._norm(par, self.add_k_proj(context_image), self.norm_added_k)
            kv["v_img"] = self.add_v_proj(context_image)
        return {k: par.gather_columns(v) for k, v in kv.items()} if all_heads else kv

    def __call__(self, par, x, context=None, *, kvpar=None, kv=None, local: bool = False, rope=None,
                 key_rope=None, local_rope=None, kv_mask=None, bias=None, perturbation=None, sparse=None):
        """Attention of x's rows (`par`) to themselves, to `context` (`kvpar`, default
        `par`), or to cached `kv` (`context_kv`'s, already normalised; no RoPE).

        rope: the queries' (and, without `key_rope`, the keys') RoPE, a `rope.HeadRope`
        or `rope.GroupedRope`; local_rope: the queries' tables on this rank's rows with
        every channel, used where `local` holds. kv_mask: bool `[Skv]` / `[B, Skv]`,
        False for pad keys; bias: additive `(B, 1, Skv)`; perturbation: STG's lerp
        weight `(B, 1, 1)` (1 = attention, 0 = values only); sparse: self-attention's block-sparse
        mask (`layers.sparse_masks.BlockSparsity`) over the rows in the order given.
        """
        if sparse is not None and (context is not None or kv is not None):
            raise ValueError("a block-sparse mask applies to self-attention only")
        local = local and par.cross_local
        qpar = par.local() if local else par
        kvpar = par if kvpar is None else kvpar
        row_major = self.row_major or local
        gates = [] if self.to_gate_logits is None else [self.to_gate_logits]
        qpar.local_heads(self.heads)  # a clear error if the heads do not divide over the ranks
        if local:
            rope = local_rope if rope is not None else None
            if kv is not None:  # one all-gather per layer, which XLA can overlap with the work before
                kv = {k: self._every_head(par, v) for k, v in kv.items()}
                if (not gates and rope is None and "k_img" not in kv
                        and sdpa.fuses_rms_cross(qpar, (*x.shape[:-1], self.inner_dim), kv["k"], x.dtype,
                                                 self.head_dim)):
                    # the q norm, splash's relayouts and the heads' split / merge in one kernel
                    (q,) = nn.column(qpar, x, [self.to_q])
                    o = sdpa.rms_cross_attention(qpar, q, self.norm_q.scale[...], kv["k"], kv["v"],
                                                 head_dim=self.head_dim, eps=self.eps)
                    return nn.row(qpar, [(o, self.to_out["0"])])

        # q and k come with their per-row sums of squares over this rank's columns for the norms
        # (accumulated by the all-gather kernel, else by the dot's epilogue)
        if context is None and kv is None:  # self-attention: one gather feeds q, k, v (and the gate)
            outs = nn.column(qpar, x, [self.to_q, self.to_k, self.to_v] + gates,
                             sum_squares=[True, True, False] + [False] * len(gates), row_major=row_major)
            (q, q_ssq), (k, k_ssq), v = outs[:3]
        else:
            outs = nn.column(qpar, x, [self.to_q] + gates, sum_squares=[True] + [False] * len(gates),
                             row_major=row_major)
            q, q_ssq = outs[0]
            if kv is None:
                (k, k_ssq), v = nn.column(kvpar, context, [self.to_k, self.to_v], sum_squares=[True, False],
                                          row_major=row_major)
        gate_logits = outs[-1] if gates else None

        q = self._qk(qpar, q, q_ssq, self.norm_q, rope)
        if kv is None:
            k = self._qk(kvpar, k, k_ssq, self.norm_k, rope if key_rope is None or rope is None else key_rope)
            if local:  # queries with every head: keys and values too
                k, v = self._every_head(kvpar, k), self._every_head(kvpar, v)
        else:
            k, v = kv["k"], kv["v"]
        q = self._heads(q)

        img = None
        if kv is not None and "k_img" in kv:  # I2V: a separate attention over the image tokens, added before to_out
            img = merge_heads(attend(qpar, q, self._heads(kv["k_img"]), self._heads(kv["v_img"])))
        out = merge_heads(attend(qpar, q, self._heads(k), self._heads(v), kv_mask, bias, sparse=sparse))
        if out.dtype != q.dtype:
            out = out.astype(q.dtype)
        if img is not None:
            out = out + img
        if perturbation is not None:
            out = torch_lerp(v, out, perturbation.astype(out.dtype))
        if gate_logits is not None:
            gates = 2.0 * jax.nn.sigmoid(gate_logits)
            out = merge_heads(split_heads(out, self.head_dim) * gates[..., None])
        return nn.row(qpar, [(out, self.to_out["0"])])
