"""LTX-2 port config: built from a diffusers `config.json`, plus the released presets.

`LTX2Config` mirrors `LTX2VideoTransformer3DModel.__init__`'s arguments
(diffusers 0.42.1 defaults) and adds `split_rope`: True when the checkpoint's
RoPE is interleaved and its q/k projections were permuted at load to
split-halves order (so the forward must use split tables, and a cached copy
is never permuted twice). Released LTX-2 configs are natively `rope_type="split"`
and are never permuted.
"""

from __future__ import annotations

import dataclasses

from difflet_tpu import port_config as PC

CLASS_NAME = "LTX2VideoTransformer3DModel"


@dataclasses.dataclass(frozen=True)
class LTX2Config(PC.PortConfig):
    # video
    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple = (8, 32, 32)
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    gated_attn: bool = False
    cross_attn_mod: bool = False
    # audio
    audio_in_channels: int = 128
    audio_out_channels: int | None = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_gated_attn: bool = False
    audio_cross_attn_mod: bool = False
    # shared
    num_layers: int = 48
    activation_fn: str = "gelu-approximate"
    qk_norm: str = "rms_norm_across_heads"
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: int = 1000
    cross_attn_timestep_scale_multiplier: int = 1000
    rope_type: str = "interleaved"
    use_prompt_embeddings: bool = True
    perturbed_attn: bool = False
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_prompt_adaln_single: bool = True
    use_keyframes_abs_pos_embedding: bool = False
    # port: q/k permuted to split halves at load (interleaved checkpoints only)
    split_rope: bool = False

    # ---- derived (and inner_dim, from PC.PortConfig) ---------------------
    @property
    def audio_inner_dim(self) -> int:
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @property
    def video_out_channels(self) -> int:
        return self.out_channels or self.in_channels

    @property
    def audio_output_channels(self) -> int:
        return self.audio_out_channels or self.audio_in_channels

    @property
    def prompt_modulation(self) -> bool:
        """LTX-2.3: text K/V modulated per block (`prompt_scale_shift_table`)."""
        return self.cross_attn_mod or self.audio_cross_attn_mod

    @property
    def text_dim(self) -> int:
        return self.caption_channels if self.use_prompt_embeddings else self.cross_attention_dim

    @property
    def audio_text_dim(self) -> int:
        return self.caption_channels if self.use_prompt_embeddings else self.audio_cross_attention_dim

    @property
    def cross_pos_embed_max_pos(self) -> int:
        return max(self.pos_embed_max_pos, self.audio_pos_embed_max_pos)


_I, _F, _B, _S = PC.pos_int, PC.pos_float, PC.boolean, PC.string
# Every LTX2VideoTransformer3DModel.__init__ argument (diffusers transformer_ltx2.py) and its type.
SCHEMA = {
    "in_channels": _I, "out_channels": PC.optional(_I), "patch_size": _I, "patch_size_t": _I,
    "num_attention_heads": _I, "attention_head_dim": _I, "cross_attention_dim": _I,
    "vae_scale_factors": PC.pos_ints(3), "pos_embed_max_pos": _I, "base_height": _I, "base_width": _I,
    "gated_attn": _B, "cross_attn_mod": _B,
    "audio_in_channels": _I, "audio_out_channels": PC.optional(_I), "audio_patch_size": _I,
    "audio_patch_size_t": _I, "audio_num_attention_heads": _I, "audio_attention_head_dim": _I,
    "audio_cross_attention_dim": _I, "audio_scale_factor": _I, "audio_pos_embed_max_pos": _I,
    "audio_sampling_rate": _I, "audio_hop_length": _I, "audio_gated_attn": _B, "audio_cross_attn_mod": _B,
    "num_layers": _I, "activation_fn": _S, "qk_norm": _S, "norm_elementwise_affine": _B, "norm_eps": _F,
    "caption_channels": _I, "attention_bias": _B, "attention_out_bias": _B, "rope_theta": _F,
    "rope_double_precision": _B, "causal_offset": PC.nonneg_int, "timestep_scale_multiplier": _F,
    "cross_attn_timestep_scale_multiplier": _F, "rope_type": _S, "use_prompt_embeddings": _B,
    "perturbed_attn": _B, "ff_bias": _B, "audio_ff_bias": _B, "use_prompt_adaln_single": _B,
    "use_keyframes_abs_pos_embedding": _B,
}
assert set(SCHEMA) == {f.name for f in dataclasses.fields(LTX2Config)} - {"split_rope"}
SUPPORTED_ACTIVATIONS = ("gelu-approximate", "gelu")

# diffusers' LTX2VideoTransformer3DModel._keys_to_ignore_on_load_unexpected (none).
IGNORED_KEYS = ()


def config_from_diffusers(cfg: dict, *, split_rope: bool = True, **overrides) -> LTX2Config:
    """The port config of a diffusers LTX2VideoTransformer3DModel `config.json` dict.

    `split_rope`: for `rope_type="interleaved"` checkpoints, permute q/k to
    split halves at load (the port's faster layout). Ignored (False) for
    natively split checkpoints. Raises ValueError naming the key for anything
    the port does not support (types and ranges: difflet_tpu.port_config).
    """
    c = LTX2Config(**PC.parse(cfg, overrides, CLASS_NAME, SCHEMA))
    _check(c)
    return dataclasses.replace(c, split_rope=bool(split_rope) and c.rope_type == "interleaved")


def _check(c: LTX2Config):
    if c.qk_norm != "rms_norm_across_heads":
        raise ValueError(f"qk_norm: only 'rms_norm_across_heads' is supported (diffusers too), got {c.qk_norm!r}")
    if c.rope_type not in ("interleaved", "split"):
        raise ValueError(f"rope_type: must be 'interleaved' or 'split', got {c.rope_type!r}")
    if c.activation_fn not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"activation_fn: {c.activation_fn!r} is not supported; use one of {SUPPORTED_ACTIVATIONS}")
    if len(c.vae_scale_factors) != 3:
        raise ValueError(f"vae_scale_factors: need 3 values (t, h, w), got {c.vae_scale_factors!r}")
    if c.audio_cross_attention_dim != c.audio_inner_dim:
        raise ValueError(
            f"audio_cross_attention_dim: {c.audio_cross_attention_dim} must equal audio_num_attention_heads * "
            f"audio_attention_head_dim = {c.audio_inner_dim} (it is the a2v/v2a RoPE width; diffusers fails otherwise)")
    if c.use_prompt_embeddings and c.cross_attention_dim != c.inner_dim:
        raise ValueError(
            f"cross_attention_dim: {c.cross_attention_dim} must equal num_attention_heads * attention_head_dim = "
            f"{c.inner_dim} when use_prompt_embeddings (the caption projection outputs inner_dim)")
    for name, dim, heads in (("num_attention_heads", c.inner_dim, c.num_attention_heads),
                             ("audio_num_attention_heads", c.audio_inner_dim, c.audio_num_attention_heads)):
        if (dim // 2) % heads:
            raise ValueError(f"{name}: split RoPE needs inner_dim/2 = {dim // 2} divisible by {heads} heads")
    if c.audio_cross_attention_dim // 2 % c.num_attention_heads and c.rope_type == "split":
        raise ValueError(f"num_attention_heads: split cross RoPE needs audio_cross_attention_dim/2 = "
                         f"{c.audio_cross_attention_dim // 2} divisible by {c.num_attention_heads}")


# --------------------------------------------------------------------------
# Presets: released configs (diffusers config dicts) and the fixture config
# --------------------------------------------------------------------------

_LTX2_0 = {
    "_class_name": CLASS_NAME,
    "in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1,
    "num_attention_heads": 32, "attention_head_dim": 128, "cross_attention_dim": 4096,
    "vae_scale_factors": [8, 32, 32], "pos_embed_max_pos": 20, "base_height": 2048, "base_width": 2048,
    "gated_attn": False, "cross_attn_mod": False,
    "audio_in_channels": 128, "audio_out_channels": 128, "audio_patch_size": 1, "audio_patch_size_t": 1,
    "audio_num_attention_heads": 32, "audio_attention_head_dim": 64, "audio_cross_attention_dim": 2048,
    "audio_scale_factor": 4, "audio_pos_embed_max_pos": 20, "audio_sampling_rate": 16000,
    "audio_hop_length": 160, "audio_gated_attn": False, "audio_cross_attn_mod": False,
    "num_layers": 48, "activation_fn": "gelu-approximate", "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False, "norm_eps": 1e-6, "caption_channels": 3840,
    "attention_bias": True, "attention_out_bias": True, "rope_theta": 10000.0,
    "rope_double_precision": True, "causal_offset": 1, "timestep_scale_multiplier": 1000,
    "cross_attn_timestep_scale_multiplier": 1000, "rope_type": "split",
    "use_prompt_embeddings": True, "perturbed_attn": False,
}

PRESETS: dict[str, dict] = {
    # Lightricks/LTX-2 (convert_ltx2_to_diffusers.py): split RoPE.
    "ltx-2.0": _LTX2_0,
    # LTX-2.3: gated attention, cross-attention (text-q) modulation, prompt AdaLN, STG processor.
    "ltx-2.3": dict(_LTX2_0, gated_attn=True, cross_attn_mod=True, audio_gated_attn=True,
                    audio_cross_attn_mod=True, use_prompt_embeddings=False, perturbed_attn=True),
    # tests/fixtures/ltx2 (tests/fixtures/generate.py).
    "tiny": dict(_LTX2_0, in_channels=16, out_channels=16, num_attention_heads=4, attention_head_dim=16,
                 cross_attention_dim=64, audio_in_channels=16, audio_out_channels=16,
                 audio_num_attention_heads=4, audio_attention_head_dim=8, audio_cross_attention_dim=32,
                 num_layers=2, caption_channels=24),
}
