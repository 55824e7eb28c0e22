"""Checkpoint keys of the HunyuanVideo port: parameter path -> diffusers key and
transform, for `difflet_tpu.loading.load_transformer`.

Everything follows `weights.default_key_map` (Linear kernel = torch weight
transposed, norm `scale` = `weight`, stacked blocks `name.{i}.`), except:

* `x_embedder.proj`: the Conv3d weight `[D, C, pt, p, p]` as a Linear over
  patches flattened `(c, pt, ph, pw)` ("conv_as_linear").
* the single blocks' `proj_out`: one torch Linear over cat([attn (D), mlp (F)])
  (`single_transformer_blocks.{i}.proj_out.weight` `[D, D + F]`), held as two
  row-parallel kernels, `proj_out.attn` = input features [0, D) and
  `proj_out.mlp` = [D, D + F) (`Key(in_range=...)`), the bias with
  `proj_out.mlp`. The loader reads each device's rows of each range only;
  nothing depends on P.
* split-halves RoPE (`config.split_rope`): every q/k that meets RoPE in the
  joint attention (image `to_q/to_k`, and so the text `add_q_proj/add_k_proj`
  it is dotted with; the single blocks' `to_q/to_k`) has its output rows
  (kernel columns, bias) permuted per head to `[0, 2, 4, ..., 1, 3, 5, ...]`,
  and the per-head q/k RMSNorm weights the same way. The token refiner has no
  RoPE and is left alone.
"""

from __future__ import annotations

from difflet_tpu.layers.rope import RopeLayout
from difflet_tpu.loading.checkpoint import Key, default_key_map

from .config import HunyuanVideoConfig


def key_map(config: HunyuanVideoConfig, model) -> dict[str, Key]:
    """Parameter path -> diffusers key (the Conv3d patch embedder, the packed
    single-block proj_out ranges and the split-halves RoPE permutation included)."""
    c = config
    L, Ls, Lr = c.num_layers, c.num_single_layers, c.num_refiner_layers
    D, F = c.inner_dim, c.mlp_dim
    out = default_key_map(model, stacked={"transformer_blocks": L, "single_transformer_blocks": Ls,
                                          "context_embedder.token_refiner.refiner_blocks": Lr})
    out["x_embedder.proj.kernel"] = Key("x_embedder.proj.weight", "conv_as_linear")
    packed = "single_transformer_blocks.{i}.proj_out"
    out["single_transformer_blocks.proj_out.attn.kernel"] = Key(f"{packed}.weight", "linear", layers=Ls,
                                                                in_range=(0, D))
    out["single_transformer_blocks.proj_out.mlp.kernel"] = Key(f"{packed}.weight", "linear", layers=Ls,
                                                               in_range=(D, D + F))
    out["single_transformer_blocks.proj_out.mlp.bias"] = Key(f"{packed}.bias", layers=Ls)
    rope = RopeLayout(c.num_attention_heads, c.attention_head_dim, c.split_rope)
    for prefix, names, norms in (
            ("transformer_blocks", ("to_q", "to_k", "add_q_proj", "add_k_proj"),
             ("norm_q", "norm_k", "norm_added_q", "norm_added_k")),
            ("single_transformer_blocks", ("to_q", "to_k"), ("norm_q", "norm_k"))):
        rope.permute_keys(out, qk=[f"{prefix}.attn.{n}.{leaf}" for n in names for leaf in ("kernel", "bias")],
                          head_norms=[f"{prefix}.attn.{n}.scale" for n in norms])
    return out
