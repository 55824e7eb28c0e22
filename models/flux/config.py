"""The FLUX.1 port's config: built from a diffusers `config.json`, plus the released presets.

Released configs (the `transformer/config.json` of black-forest-labs/FLUX.1-dev and -schnell;
diffusers `FluxTransformer2DModel` defaults):

================  ======  =====  ============  =========  ========  ===============
preset            blocks  D      heads x dim   text dim   pooled    guidance embed
================  ======  =====  ============  =========  ========  ===============
FLUX.1-dev        19+38   3072   24 x 128      4096 (T5)  768       yes
FLUX.1-schnell    19+38   3072   24 x 128      4096 (T5)  768       no
================  ======  =====  ============  =========  ========  ===============

Both use in_channels 64 (2x2-packed 16-channel latents), RoPE axes (16, 56, 56)
with theta 10000, MLP ratio 4 and eps 1e-6.
"""

from __future__ import annotations

import dataclasses

from difflet_tpu import port_config as PC

CLASS_NAME = "FluxTransformer2DModel"
ROPE_THETA = 10000.0  # FluxTransformer2DModel builds FluxPosEmbed(theta=10000, ...); not a config key
MLP_RATIO = 4.0       # FluxSingleTransformerBlock's default; FeedForward's default mult is 4 too
EPS = 1e-6

_RELEASED = dict(
    _class_name=CLASS_NAME, patch_size=1, in_channels=64, out_channels=None, num_layers=19,
    num_single_layers=38, attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
    pooled_projection_dim=768, axes_dims_rope=[16, 56, 56],
)

PRESETS: dict[str, dict] = {
    "flux.1-dev": dict(_RELEASED, guidance_embeds=True),
    "flux.1-schnell": dict(_RELEASED, guidance_embeds=False),
    # The parity-fixture config (tests/fixtures/generate.py, tests/fixtures/flux*).
    "tiny": dict(_class_name=CLASS_NAME, patch_size=1, in_channels=16, out_channels=None, num_layers=2,
                 num_single_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                 pooled_projection_dim=24, guidance_embeds=True, axes_dims_rope=[4, 6, 6]),
}


@dataclasses.dataclass(frozen=True)
class FluxConfig(PC.ImagePatchConfig):
    """The port's frozen config (diffusers names)."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple = (16, 56, 56)
    # q/k of every attention are stored in split-halves RoPE order (to_q/to_k/
    # add_q_proj/add_k_proj rows and biases and the per-head q/k RMSNorm weights
    # permuted per head at load); the forward rotates split halves with tables
    # permuted the same way. Recorded so a cached copy is not permuted twice.
    split_rope: bool = True

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.inner_dim * MLP_RATIO)


# Every FluxTransformer2DModel.__init__ argument (diffusers transformer_flux.py) and its type.
SCHEMA = {
    "patch_size": PC.pos_int,
    "in_channels": PC.pos_int,
    "out_channels": PC.optional(PC.pos_int),
    "num_layers": PC.pos_int,
    "num_single_layers": PC.pos_int,
    "attention_head_dim": PC.pos_int,
    "num_attention_heads": PC.pos_int,
    "joint_attention_dim": PC.pos_int,
    "pooled_projection_dim": PC.pos_int,
    "guidance_embeds": PC.boolean,
    "axes_dims_rope": PC.pos_ints(),
}

# diffusers' FluxTransformer2DModel._keys_to_ignore_on_load_unexpected (none).
IGNORED_KEYS = ()


def config_from_diffusers(cfg: dict, *, split_rope: bool = True, **overrides) -> FluxConfig:
    """The port config from a diffusers `config.json` dict (or a PRESETS entry).

    Raises ValueError naming the key for values the port does not support
    (types and ranges: difflet_tpu.port_config).
    """
    values = PC.parse(cfg, overrides, CLASS_NAME, SCHEMA)
    c = FluxConfig(**values, split_rope=bool(split_rope))
    PC.check_rope_axes("axes_dims_rope", c.axes_dims_rope, c.attention_head_dim)
    return c
