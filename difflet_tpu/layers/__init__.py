"""The layers the ports share, Parallel-aware, with diffusers' names and numerics.

* `embeddings`: `get_timestep_embedding` (the one float32 rounding policy),
  `TimestepEmbedding`, `PixArtAlphaTextProjection`, `CombinedTimestepTextProjEmbeddings`;
* `normalization`: float32 `layer_norm` / `rms_norm`, `rms_norm_across_heads`,
  `modulate`, `LayerNorm`, `RMSNorm`, `Weight`, `AdaLN`, `AdaLayerNormContinuous`;
* `attention`: `split_heads` / `merge_heads`, `HeadsOut`, `attend`;
* `rope`: every RoPE form (tables, the split-halves layout, the rotation:
  `apply_rotary_emb`, interleaved or split halves; `rms_norm_rope`);
* `across_heads`: the attention of Wan and LTX-2 (q/k RMSNorm across heads);
* `feedforward`: `FeedForward`, `gelu_tanh`;
* `mmdit`: FLUX's and HunyuanVideo's double- / single-stream blocks, `JointAttention`,
  `PackedProjOut` (imported from `difflet_tpu.layers.mmdit`).
"""

from .attention import attend, merge_heads, split_heads
from .embeddings import (CombinedTimestepTextProjEmbeddings, PixArtAlphaTextProjection, TimestepEmbedding,
                         get_timestep_embedding, timestep_frequencies)
from .feedforward import FeedForward, gelu_tanh
from .normalization import (AdaLayerNormContinuous, AdaLN, LayerNorm, RMSNorm, Weight, layer_norm, modulate, rms_norm,
                            rms_norm_across_heads, rms_scale_across_heads, row_moments)
from .rope import apply_rotary_emb, rms_norm_rope
