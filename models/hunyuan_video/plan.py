"""HunyuanVideo's parallel plan over the mesh's `tp` axis (P ranks), declared once.

| module (per stacked block)                              | role       | notes                                   |
|---------------------------------------------------------|------------|-----------------------------------------|
| dual `attn.to_q/k/v`, `attn.add_q/k/v_proj`             | COLUMN     | heads split over ranks                  |
| dual `ff.net.0.proj`, `ff_context.net.0.proj`           | COLUMN     | GELU-tanh in the ring's epilogue        |
| dual `attn.to_out.0`, `attn.to_add_out`, `ff*.net.2`    | ROW        | psum (TP) / reduce-scatter (SP)         |
| single `attn.to_q/k/v`, `proj_mlp`                      | COLUMN     | one all-gather ring for q, k, v and mlp |
| single `proj_out.packed.weight` [D, D+F] (torch layout) | SHARDED    | input features, grouped per head unit   |
|                                                         |            | `[head_u (hd) | mlp_u (F/H)]`, so each  |
|                                                         |            | rank's slice is its heads + MLP columns;|
|                                                         |            | split once by the Runner into           |
| single `proj_out.attn`, `proj_out.mlp` kernels          | ROW        | two pairs of one reduce-scatter / psum  |
| adaLN `norm1.linear`, `norm1_context.linear`,           | COLUMN     | (B, kD) output gathered with            |
| single `norm.linear`, final `norm_out.linear`           |            | `par.gather_columns` (3.5 B params)     |
| replicated                                              |            | per-head q/k RMSNorm weights, single    |
|                                                         |            | `proj_out.bias`, `x_embedder`, the whole|
|                                                         |            | token refiner `context_embedder` (runs  |
|                                                         |            | replicated on the text), `time_text_    |
|                                                         |            | embed`, final `proj_out`, RoPE tables   |

Sequence-sharded under SP (between layers): the dual blocks' image stream and
text stream, each on its own (rank r holds rows [r*n/P, (r+1)*n/P) of each,
padded to a multiple of 2P); the single blocks' joint `[image | text]`
sequence as one contiguous chunk per rank (`Config.sp_single`).
"""

from difflet_tpu.parallel import COLUMN, ROW, SHARDED

PLAN = {
    # dual-stream blocks
    "transformer_blocks.norm1.linear": COLUMN,
    "transformer_blocks.norm1_context.linear": COLUMN,
    "transformer_blocks.attn.to_q": COLUMN,
    "transformer_blocks.attn.to_k": COLUMN,
    "transformer_blocks.attn.to_v": COLUMN,
    "transformer_blocks.attn.add_q_proj": COLUMN,
    "transformer_blocks.attn.add_k_proj": COLUMN,
    "transformer_blocks.attn.add_v_proj": COLUMN,
    "transformer_blocks.attn.to_out.0": ROW,
    "transformer_blocks.attn.to_add_out": ROW,
    "transformer_blocks.ff.net.0.proj": COLUMN,
    "transformer_blocks.ff.net.2": ROW,
    "transformer_blocks.ff_context.net.0.proj": COLUMN,
    "transformer_blocks.ff_context.net.2": ROW,
    # single-stream blocks
    "single_transformer_blocks.norm.linear": COLUMN,
    "single_transformer_blocks.attn.to_q": COLUMN,
    "single_transformer_blocks.attn.to_k": COLUMN,
    "single_transformer_blocks.attn.to_v": COLUMN,
    "single_transformer_blocks.proj_mlp": COLUMN,
    "single_transformer_blocks.proj_out.packed": SHARDED,   # as loaded
    "single_transformer_blocks.proj_out.attn": ROW,         # after unpack_proj_out (the Runner)
    "single_transformer_blocks.proj_out.mlp": ROW,
    # final layer
    "norm_out.linear": COLUMN,
}
