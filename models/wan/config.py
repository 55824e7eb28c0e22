"""The Wan port's config: built from a diffusers `config.json`, plus the released presets.

Released configs (the `transformer/config.json` of the Wan-AI `*-Diffusers`
checkpoints; all share patch (1, 2, 2), head_dim 128, freq_dim 256, text_dim
4096, eps 1e-6, across-heads q/k norm and cross_attn_norm):

=====================  =====  ====  =====  ======  =====  ==========================
preset                 heads  D     ffn    layers  in/out extra
=====================  =====  ====  =====  ======  =====  ==========================
Wan2.1-T2V-1.3B        12     1536  8960   30      16/16
Wan2.1-T2V-14B         40     5120  13824  40      16/16
Wan2.1-I2V-14B-480P    40     5120  13824  40      36/16  CLIP image tokens, add_k/v_proj
Wan2.2-T2V-A14B        40     5120  13824  40      16/16  2 experts, boundary 0.875
Wan2.2-I2V-A14B        40     5120  13824  40      36/16  2 experts, boundary 0.9, no CLIP
Wan2.2-TI2V-5B         24     3072  14336  30      48/48  per-token timesteps
=====================  =====  ====  =====  ======  =====  ==========================

The two-expert Wan2.2 checkpoints are pipelines whose `transformer` (high
noise) and `transformer_2` (low noise) each have the per-expert config above;
`EXPERT_BOUNDARY` holds their pipelines' `boundary_ratio` and `FLOW_SHIFTS`
the pipelines' flow shifts (the port's `SPEC.experts` and schedule read these).
"""

from __future__ import annotations

import dataclasses

from difflet_tpu import port_config as PC

CLASS_NAME = "WanTransformer3DModel"
TEXT_LEN_I2V = 512  # diffusers' WanAttnProcessor splits image | text at (L - 512)

_COMMON = dict(
    _class_name=CLASS_NAME, patch_size=[1, 2, 2], attention_head_dim=128, text_dim=4096, freq_dim=256,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
    added_kv_proj_dim=None, rope_max_seq_len=1024, pos_embed_seq_len=None,
)
_14B = dict(_COMMON, num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=16, out_channels=16)

PRESETS: dict[str, dict] = {
    "Wan2.1-T2V-1.3B": dict(_COMMON, num_attention_heads=12, ffn_dim=8960, num_layers=30,
                            in_channels=16, out_channels=16),
    "Wan2.1-T2V-14B": dict(_14B),
    "Wan2.1-I2V-14B-480P": dict(_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
    "Wan2.1-I2V-14B-720P": dict(_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
    "Wan2.2-T2V-A14B": dict(_14B),                   # per expert (transformer, transformer_2)
    "Wan2.2-I2V-A14B": dict(_14B, in_channels=36),   # per expert; no CLIP branch
    "Wan2.2-TI2V-5B": dict(_COMMON, num_attention_heads=24, ffn_dim=14336, num_layers=30,
                           in_channels=48, out_channels=48),
    # The parity fixtures' config (tests/fixtures/wan_*).
    "tiny": dict(_COMMON, patch_size=[1, 2, 2], num_attention_heads=4, attention_head_dim=16,
                 in_channels=4, out_channels=4, text_dim=24, ffn_dim=128, num_layers=2,
                 rope_max_seq_len=32),
}

# Two-expert pipelines: model_index.json's boundary_ratio (diffusers WanPipeline:
# the high-noise `transformer` runs while t >= boundary_ratio * 1000).
EXPERT_BOUNDARY = {"Wan2.2-T2V-A14B": 0.875, "Wan2.2-I2V-A14B": 0.9}
NUM_TRAIN_TIMESTEPS = 1000

# WanPipeline's flow shift (the scheduler's static shift): 3.0 for 480p, 5.0 for
# 720p (diffusers' Wan docs), Wan2.2 A14B as its generation configs' sample_shift
# (Wan2.2 `wan/configs/wan_t2v_A14B.py`: 12.0; `wan_i2v_A14B.py`: 5.0).
FLOW_SHIFT = 3.0
FLOW_SHIFTS = {"Wan2.2-T2V-A14B": 12.0, "Wan2.2-I2V-A14B": 5.0, "Wan2.1-I2V-14B-720P": 5.0}

# Per-token timesteps (`expand_timesteps`) are what the TI2V pipeline passes.
PER_TOKEN_TIMESTEP_PRESETS = ("Wan2.2-TI2V-5B",)


@dataclasses.dataclass(frozen=True)
class WanConfig(PC.PortConfig):
    """The port's frozen config (diffusers names)."""

    patch_size: tuple = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None  # FLF2V: the image embedder's position embedding (2 images' tokens)
    # Self-attention q/k are stored in split-halves RoPE order (to_q/to_k rows
    # and norm_q/norm_k weights permuted per head at load); the forward rotates
    # split halves with permuted tables. Recorded so a cache is not permuted twice.
    split_rope: bool = True

    @property
    def patch_features(self) -> int:
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """(t, h, w) channels of each head, as diffusers' WanRotaryPosEmbed splits them."""
        h = w = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - h - w, h, w


# Every WanTransformer3DModel.__init__ argument (diffusers transformer_wan.py) and its type.
SCHEMA = {
    "patch_size": PC.pos_ints(3),
    "num_attention_heads": PC.pos_int,
    "attention_head_dim": PC.pos_int,
    "in_channels": PC.pos_int,
    "out_channels": PC.optional(PC.pos_int),
    "text_dim": PC.pos_int,
    "freq_dim": PC.pos_int,
    "ffn_dim": PC.pos_int,
    "num_layers": PC.pos_int,
    "cross_attn_norm": PC.boolean,
    "qk_norm": PC.optional(PC.string),
    "eps": PC.pos_float,
    "image_dim": PC.optional(PC.pos_int),
    "added_kv_proj_dim": PC.optional(PC.pos_int),
    "rope_max_seq_len": PC.pos_int,
    "pos_embed_seq_len": PC.optional(PC.pos_int),
}

# diffusers' WanTransformer3DModel._keys_to_ignore_on_load_unexpected: regexes (re.search) of
# checkpoint keys the reference drops on load. The published Wan2.1 I2V checkpoints carry
# `blocks.{i}.attn2.norm_added_q.weight`, which no diffusers module uses.
IGNORED_KEYS = ("norm_added_q",)


def config_from_diffusers(cfg: dict, *, split_rope: bool = True, **overrides) -> WanConfig:
    """The port config from a diffusers `config.json` dict.

    Raises ValueError naming the key for values the port does not support
    (types and ranges: difflet_tpu.port_config).
    """
    values = PC.parse(cfg, overrides, CLASS_NAME, SCHEMA)
    qk_norm = values.pop("qk_norm", "rms_norm_across_heads")
    if qk_norm != "rms_norm_across_heads":
        raise ValueError(f"qk_norm: {qk_norm!r} is not supported (only 'rms_norm_across_heads', "
                         f"the value of every released Wan checkpoint)")
    if values.get("cross_attn_norm", True) is not True:
        raise ValueError("cross_attn_norm: False is not supported (every released Wan config uses True)")
    if values.get("out_channels") is None:
        values["out_channels"] = values.get("in_channels", 16)
    c = WanConfig(**values, split_rope=bool(split_rope))
    if c.attention_head_dim % 2:
        raise ValueError(f"attention_head_dim: {c.attention_head_dim} must be even for RoPE")
    if (c.image_dim is None) != (c.added_kv_proj_dim is None):
        raise ValueError(f"image_dim ({c.image_dim}) and added_kv_proj_dim ({c.added_kv_proj_dim}) "
                         f"must be set together (the I2V image branch)")
    if c.added_kv_proj_dim is not None and c.added_kv_proj_dim != c.inner_dim:
        raise ValueError(f"added_kv_proj_dim: {c.added_kv_proj_dim} must equal heads*head_dim = "
                         f"{c.inner_dim} (it projects the image embedder's output)")
    if c.pos_embed_seq_len is not None and (c.image_dim is None or c.pos_embed_seq_len % 2):
        raise ValueError(f"pos_embed_seq_len: {c.pos_embed_seq_len} needs the image branch (image_dim) and an "
                         f"even length (the first and last images' tokens)")
    return c


def preset(name: str, *, split_rope: bool = True) -> WanConfig:
    """A released Wan config by name (see PRESETS)."""
    if name not in PRESETS:
        raise KeyError(f"unknown Wan preset {name!r}; known: {', '.join(PRESETS)}")
    return config_from_diffusers(PRESETS[name], split_rope=split_rope)
