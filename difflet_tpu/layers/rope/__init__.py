"""RoPE, every form the ports use, in one place.

* `layout`: the split-halves layout (q/k rows and tables permuted once at load so
  the step rotates halves, not pairs), `RopeLayout`, torch's inverse frequencies;
* `axes`: the tables over position axes (FLUX, Wan, HunyuanVideo, Qwen-Image),
  each model's precision as diffusers forms it;
* `fractional`: LTX-2's tables over fractional coordinates (seconds, pixels);
* `rotate`: the rotation in the step (`rotate`, the one formula the Pallas
  all-gather kernel's head epilogue shares), `apply_rotary_emb`, `rms_norm_rope`,
  and the tables as the step takes them (`HeadRope`, `GroupedRope`).

Tables are numpy, built once per geometry on the host (`Runner.constant`); the
compiled step only rotates.
"""

from .axes import grid_tables, pad_identity, position_tables, segment_tables
from .layout import RopeLayout, heads_permutation, rope_inv_freqs, rope_permutation
from .rotate import (GroupedRope, HeadRope, apply_rotary_emb, rms_norm_rope, rotate, rotation_matrix,
                     rotation_source)
