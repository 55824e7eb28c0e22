"""The Qwen-Image port's config: built from a diffusers `config.json`, plus the presets.

diffusers' `QwenImageTransformer2DModel.__init__` (transformer_qwenimage.py)
takes: patch_size, in_channels, out_channels, num_layers, attention_head_dim,
num_attention_heads, joint_attention_dim, guidance_embeds, axes_dims_rope,
zero_cond_t, use_additional_t_cond, use_layer3d_rope.

Released config (Qwen/Qwen-Image `transformer/config.json`; Qwen-Image-Edit has
the same transformer shape): 60 dual-stream blocks, 24 heads x 128 (D = 3072),
text from Qwen2.5-VL (3584 wide), 2x2-packed 16-channel latents (in 64,
out 16, proj_out 64), RoPE axes (16, 56, 56), MLP 4D with GELU-tanh.

The four flags and what the port does with each (`config_from_diffusers`
raises a ValueError naming the key for what is refused):

==========================  ===========================================================
key                         port
==========================  ===========================================================
zero_cond_t                 supported (Qwen-Image-Edit-2511): the tokens of every image
                            shape after an item's first are modulated with t = 0
use_additional_t_cond       supported (Qwen-Image-Layered): `additional_t_cond` (B,)
                            in {0, 1} picks a row of `addition_t_embedding`
use_layer3d_rope            supported (Qwen-Image-Layered): `QwenEmbedLayer3DRope`, the
                            last image shape is the condition image at frame -1
guidance_embeds=True        refused: diffusers 0.42.1 builds no guidance embedder for it,
                            and its forward fails whenever `guidance` is passed
zero_cond_t together with   refused: diffusers adds the (B, D) additional embedding to the
use_additional_t_cond       (2B, D) doubled timestep embedding, which fails unless B = 1
==========================  ===========================================================

`pooled_projection_dim` is accepted and ignored, as diffusers ignores it (not
an `__init__` parameter; some exported configs carry it).
"""

from __future__ import annotations

import dataclasses

from difflet_tpu import port_config as PC

CLASS_NAME = "QwenImageTransformer2DModel"
ROPE_THETA = 10000       # QwenEmbedRope(theta=10000, ...), not a config key
ROPE_TABLE = 4096        # QwenEmbedRope's positions: arange(4096) and -4096..-1
EPS = 1e-6               # block norms, q/k RMSNorm, txt_norm, norm_out
MLP_RATIO = 4            # FeedForward(dim, dim_out=dim, activation_fn="gelu-approximate"), mult 4
IGNORED_CONFIG_KEYS = ("pooled_projection_dim",)
IGNORED_KEYS = ()  # checkpoint keys the loader leaves unused (SPEC.ignored_keys): none

PRESETS: dict[str, dict] = {
    "qwen-image": dict(_class_name=CLASS_NAME, patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                       guidance_embeds=False, axes_dims_rope=[16, 56, 56]),
    # The parity fixtures' config (tests/fixtures/qwen_image*; generate.py QWEN_TINY).
    "tiny": dict(_class_name=CLASS_NAME, patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                 attention_head_dim=8, num_attention_heads=4, joint_attention_dim=24, guidance_embeds=False,
                 axes_dims_rope=[2, 2, 4]),
}


@dataclasses.dataclass(frozen=True)
class QwenImageConfig(PC.ImagePatchConfig):
    """The port's frozen config (diffusers names and defaults)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    axes_dims_rope: tuple = (16, 56, 56)
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False
    # q/k of every block (to_q/to_k/add_q_proj/add_k_proj rows and biases, the per-head
    # q/k RMSNorm weights) stored in split-halves RoPE order, permuted per head at load
    # (keys.py); the forward rotates split halves with tables permuted the same way.
    split_rope: bool = True

    @property
    def mlp_dim(self) -> int:
        return self.inner_dim * MLP_RATIO


# Every QwenImageTransformer2DModel.__init__ argument (diffusers transformer_qwenimage.py) and its type.
SCHEMA = {
    "patch_size": PC.pos_int, "in_channels": PC.pos_int, "out_channels": PC.optional(PC.pos_int),
    "num_layers": PC.pos_int, "attention_head_dim": PC.pos_int, "num_attention_heads": PC.pos_int,
    "joint_attention_dim": PC.pos_int, "guidance_embeds": PC.boolean, "axes_dims_rope": PC.pos_ints(3),
    "zero_cond_t": PC.boolean, "use_additional_t_cond": PC.boolean, "use_layer3d_rope": PC.boolean,
}


def config_from_diffusers(cfg: dict, *, split_rope: bool = True, **overrides) -> QwenImageConfig:
    """The port config from a diffusers `config.json` dict (or a PRESETS entry).

    Raises ValueError naming the key for values the port does not support
    (types and ranges: difflet_tpu.port_config).
    """
    cfg = {k: v for k, v in cfg.items() if k not in IGNORED_CONFIG_KEYS}
    values = PC.parse(cfg, overrides, CLASS_NAME, SCHEMA)
    if values.get("guidance_embeds"):
        raise ValueError("guidance_embeds: true is not supported: diffusers 0.42.1 builds no guidance embedder "
                         "for it (QwenImageTransformer2DModel ignores the flag) and its forward raises a "
                         "TypeError whenever `guidance` is passed; released Qwen-Image configs have false")
    if values.get("zero_cond_t") and values.get("use_additional_t_cond"):
        raise ValueError("zero_cond_t with use_additional_t_cond is not supported: diffusers adds the (B, D) "
                         "additional embedding to the (2B, D) doubled timestep embedding, which only runs at "
                         "batch 1; no released Qwen-Image model sets both")
    c = QwenImageConfig(**values, split_rope=bool(split_rope))
    PC.check_rope_axes("axes_dims_rope", c.axes_dims_rope, c.attention_head_dim)
    return c
