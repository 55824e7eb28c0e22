"""The layers the ports share, Parallel-aware, with diffusers' names and numerics.

* `embeddings`: `get_timestep_embedding` (the one float32 rounding policy),
  `TimestepEmbedding`, `PixArtAlphaTextProjection`, `CombinedTimestepTextProjEmbeddings`;
* `normalization`: float32 `layer_norm` / `rms_norm`, `rms_norm_across_heads`,
  `modulate`, `LayerNorm`, `RMSNorm`, `Weight`, `AdaLN`, `AdaLayerNormContinuous`;
* `attention`: `split_heads` / `merge_heads`, `apply_rotary_emb` (interleaved or
  split halves), `attend`;
* `feedforward`: `FeedForward`, `gelu_tanh`;
* `mmdit`: FLUX's and HunyuanVideo's double- / single-stream blocks, `JointAttention`,
  `PackedProjOut` (imported from `difflet_tpu.layers.mmdit`).
"""

from .attention import apply_rotary_emb, attend, merge_heads, rms_norm_rope, split_heads
from .embeddings import (CombinedTimestepTextProjEmbeddings, PixArtAlphaTextProjection, TimestepEmbedding,
                         get_timestep_embedding, timestep_frequencies)
from .feedforward import FeedForward, gelu_tanh
from .normalization import (AdaLayerNormContinuous, AdaLN, LayerNorm, RMSNorm, Weight, layer_norm, modulate, rms_norm,
                            rms_norm_across_heads, rms_scale_across_heads, row_moments)
