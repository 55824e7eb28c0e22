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
class FluxConfig:
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
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.inner_dim * MLP_RATIO)

    @property
    def out_features(self) -> int:
        """proj_out's width: patch_size**2 * out_channels (diffusers leaves unpatchify to the pipeline)."""
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)


def config_from_diffusers(cfg: dict, *, split_rope: bool = True, **overrides) -> FluxConfig:
    """The port config from a diffusers `config.json` dict (or a PRESETS entry).

    Raises ValueError naming the key for values the port does not support.
    """
    cfg = {**cfg, **overrides}
    if cfg.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise ValueError(f"_class_name: {cfg['_class_name']!r} is not {CLASS_NAME}")
    fields = {f.name for f in dataclasses.fields(FluxConfig)} - {"split_rope"}
    unknown = sorted(k for k in cfg if not k.startswith("_") and k not in fields)
    if unknown:
        raise ValueError(f"{unknown[0]}: not a FluxTransformer2DModel config key this port knows "
                         f"(unknown keys: {unknown})")
    values = {k: cfg[k] for k in fields if k in cfg}
    if "axes_dims_rope" in values:
        values["axes_dims_rope"] = tuple(int(d) for d in values["axes_dims_rope"])
    for key in ("patch_size", "in_channels", "num_layers", "num_single_layers", "attention_head_dim",
                "num_attention_heads", "joint_attention_dim", "pooled_projection_dim"):
        if key in values:
            v = values[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key}: {v!r} is not a positive integer")
    if values.get("out_channels") is not None:
        v = values["out_channels"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"out_channels: {v!r} is not a positive integer or null")
    if not isinstance(values.get("guidance_embeds", False), bool):
        raise ValueError(f"guidance_embeds: {values['guidance_embeds']!r} is not a bool")
    c = FluxConfig(**values, split_rope=bool(split_rope))
    if any(d <= 0 or d % 2 for d in c.axes_dims_rope):
        raise ValueError(f"axes_dims_rope: {list(c.axes_dims_rope)} must be positive even numbers "
                         f"(RoPE rotates channel pairs)")
    if sum(c.axes_dims_rope) != c.attention_head_dim:
        raise ValueError(f"axes_dims_rope: {list(c.axes_dims_rope)} sums to {sum(c.axes_dims_rope)}, "
                         f"not attention_head_dim = {c.attention_head_dim}")
    return c
