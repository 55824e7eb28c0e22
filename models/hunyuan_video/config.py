"""The port's config, built from a diffusers `config.json`, and the released presets.

`HunyuanVideoConfig` mirrors `HunyuanVideoTransformer3DModel.__init__`'s
arguments (diffusers 0.42.1) plus `split_rope`, the q/k layout the weights
were loaded in (recorded so the forward permutes its RoPE tables to match and
a cached copy is never permuted twice).
"""

from __future__ import annotations

import dataclasses

from difflet_tpu import port_config as PC

CLASS_NAME = "HunyuanVideoTransformer3DModel"
IMAGE_CONDITION_TYPES = (None, "latent_concat", "token_replace")


@dataclasses.dataclass(frozen=True)
class HunyuanVideoConfig(PC.PortConfig):
    in_channels: int = 16
    out_channels: int = 16
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    num_layers: int = 20
    num_single_layers: int = 40
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 2
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    guidance_embeds: bool = True
    text_embed_dim: int = 4096
    pooled_projection_dim: int = 768
    rope_theta: float = 256.0
    rope_axes_dim: tuple = (16, 56, 56)
    image_condition_type: str | None = None
    split_rope: bool = True  # q/k rows permuted at load to split-halves RoPE

    @property
    def mlp_dim(self) -> int:  # diffusers: int(hidden_size * mlp_ratio)
        return int(self.inner_dim * self.mlp_ratio)

    @property
    def patch_volume(self) -> int:
        return self.patch_size_t * self.patch_size * self.patch_size

    @property
    def token_replace(self) -> bool:
        return self.image_condition_type == "token_replace"


# Every HunyuanVideoTransformer3DModel.__init__ argument (diffusers transformer_hunyuan_video.py) and its type.
SCHEMA = {
    "in_channels": PC.pos_int,
    "out_channels": PC.optional(PC.pos_int),
    "num_attention_heads": PC.pos_int,
    "attention_head_dim": PC.pos_int,
    "num_layers": PC.pos_int,
    "num_single_layers": PC.pos_int,
    "num_refiner_layers": PC.pos_int,
    "mlp_ratio": PC.pos_float,
    "patch_size": PC.pos_int,
    "patch_size_t": PC.pos_int,
    "qk_norm": PC.string,
    "guidance_embeds": PC.boolean,
    "text_embed_dim": PC.pos_int,
    "pooled_projection_dim": PC.pos_int,
    "rope_theta": PC.pos_float,
    "rope_axes_dim": PC.pos_ints(3),
    "image_condition_type": PC.optional(PC.string),
}

# diffusers' HunyuanVideoTransformer3DModel._keys_to_ignore_on_load_unexpected (none).
IGNORED_KEYS = ()


def config_from_diffusers(cfg: dict, *, split_rope: bool = True, **overrides) -> HunyuanVideoConfig:
    """The port config from a diffusers `config.json` dict (keys starting with `_` are ignored).

    Raises ValueError naming the key for a value the port does not support
    (types and ranges: difflet_tpu.port_config).
    """
    values = PC.parse(cfg, overrides, CLASS_NAME, SCHEMA)
    values["out_channels"] = values.get("out_channels") or values.get("in_channels", 16)
    c = HunyuanVideoConfig(**values, split_rope=bool(split_rope))
    if c.qk_norm != "rms_norm":
        raise ValueError(f"qk_norm={c.qk_norm!r} is not supported (only 'rms_norm', per head)")
    if c.image_condition_type not in IMAGE_CONDITION_TYPES:
        raise ValueError(f"image_condition_type={c.image_condition_type!r} is not supported "
                         f"(one of {IMAGE_CONDITION_TYPES})")
    PC.check_rope_axes("rope_axes_dim", c.rope_axes_dim, c.attention_head_dim)
    if c.mlp_dim % c.num_attention_heads:
        raise ValueError(f"mlp_ratio={c.mlp_ratio}: the MLP width {c.mlp_dim} must divide by "
                         f"num_attention_heads={c.num_attention_heads} (the single blocks' packed "
                         f"proj_out is grouped per head)")
    return c


_RELEASED = dict(
    in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
    qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
    rope_theta=256.0, rope_axes_dim=[16, 56, 56], image_condition_type=None,
)

# Released configs (diffusers scripts/convert_hunyuan_video_to_diffusers.py TRANSFORMER_CONFIGS),
# as diffusers config dicts, plus "tiny" (the fixtures' config, tests/fixtures/generate.py).
PRESETS: dict[str, dict] = {
    # hunyuanvideo-community/HunyuanVideo ("HYVideo-T/2-cfgdistill" = the class defaults)
    "hunyuan-video": {"_class_name": CLASS_NAME, **_RELEASED},
    # hunyuanvideo-community/HunyuanVideo-I2V ("HYVideo-T/2-I2V-33ch")
    "hunyuan-video-i2v-latent-concat": {"_class_name": CLASS_NAME, **_RELEASED, "in_channels": 33,
                                        "guidance_embeds": False, "image_condition_type": "latent_concat"},
    # "HYVideo-T/2-I2V-16ch"
    "hunyuan-video-i2v-token-replace": {"_class_name": CLASS_NAME, **_RELEASED,
                                        "image_condition_type": "token_replace"},
    "tiny": {"_class_name": CLASS_NAME, "in_channels": 4, "out_channels": 4, "num_attention_heads": 4,
             "attention_head_dim": 16, "num_layers": 2, "num_single_layers": 2, "num_refiner_layers": 2,
             "mlp_ratio": 4.0, "patch_size": 2, "patch_size_t": 1, "qk_norm": "rms_norm",
             "guidance_embeds": True, "text_embed_dim": 24, "pooled_projection_dim": 12, "rope_theta": 256.0,
             "rope_axes_dim": [4, 6, 6], "image_condition_type": None},
}
