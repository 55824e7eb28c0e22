"""Every `DIFFLET_TPU_*` toggle, parsed once into a frozen, typed object.

`Config.from_env()` reads the environment; keyword arguments override it
(`Config.from_env(sp=True)`), and `dataclasses.replace` derives variants.
Unknown `DIFFLET_TPU_*` names and malformed values are errors that name the
variable, the value and what is allowed: a typo must not silently run TP.
docs/configuration.md documents each toggle.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

PREFIX = "DIFFLET_TPU_"

BOOL_VALUES = {"0": False, "1": True}
KERNEL_VALUES = ("jax", "pallas")
RS_KERNEL_VALUES = ("auto", "jax", "pallas")
ASSEMBLE_VALUES = ("concat", "dus")
OFFLOAD_VALUES = ("auto", "on", "off")
SPREAD_VALUES = ("auto", "on", "off")


class ConfigError(ValueError):
    """A `DIFFLET_TPU_*` variable or an explicit override is malformed."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Runtime toggles. Field docs are the single source for docs/configuration.md.

    sp: Megatron-style sequence parallelism between layers (`DIFFLET_TPU_SP`);
        False runs plain tensor parallelism (all-reduce after row-parallel linears).
    sp_kernel: all-gather-matmul implementation under SP, "jax" (the ring) or
        "pallas" (the Pallas kernel, kernels/all_gather_matmul_stream/); None takes the model's default on
        TPU and the JAX ring elsewhere (`DIFFLET_TPU_SP_KERNEL`). On a TPU with
        chip constants, a site with too few rows per rank for the ring to pay
        takes the plain all-gather instead (`parallel.site_plan.plain_collective_pays`).
    sp_rs_kernel: matmul-reduce-scatter implementation under SP: "jax" (the
        ring), "pallas" (the kernel) or "auto": on a TPU whose chip constants are
        known (`parallel.chips.CHIPS`), the kernel at each site whose ring hops are
        ICI-bound (`kernels.matmul_reduce_scatter_stream.ici_bound`) and the ring
        elsewhere; the ring off TPU (`DIFFLET_TPU_SP_RS_KERNEL`). On a TPU with
        chip constants, a site with too few rows per rank for the ring it would run
        to pay takes the plain reduce-scatter instead (`parallel.site_plan.plain_collective_pays`).
    sp_ag_assemble: how the JAX all-gather ring builds its output: "concat"
        (one gather over the arrived chunks) or "dus" (dynamic_update_slice
        into a buffer) (`DIFFLET_TPU_SP_AG_ASSEMBLE`).
    sp_single: HunyuanVideo's single-stream blocks under SP too (`DIFFLET_TPU_SP_SINGLE`).
    sp_cross_local: under SP, cross-attention runs on this rank's rows alone, with
        every head (`DIFFLET_TPU_SP_CROSS_LOCAL`; Wan's text cross-attention, LTX-2's
        audio-to-video attention): its q and output projections replicated over tp
        (the port's `PortSpec.sp_local_plan`) and the K/V of all heads, so the
        cross-attention needs no ring (its all-gather and reduce-scatter hops are
        ICI-bound at these shapes). Costs the replicated weights' memory
        (Wan2.1-14B: +3.1 GB per chip, LTX-2.0: +1.1 GiB) and, in a step that
        computes the K/V itself, one all-gather of each layer's K/V heads; Wan's
        cached K/V (`Runner.encode_text`) is then stored with all heads on every
        rank. TP and one device ignore it; so do models without the mechanism.
    sp_pad: under SP, pad token streams that do not split into whole ring halves
        (pad keys masked); False refuses them with the rule (`DIFFLET_TPU_SP_PAD`).
        The Runner's `pad=` argument overrides it.
    check_vma: `shard_map`'s varying-manual-axes check, so an output declared
        replicated that differs by rank fails to trace (`DIFFLET_TPU_CHECK_VMA`;
        the test suite turns it on).
    split_rope: split-halves RoPE by a one-time q/k weight permutation for
        checkpoints with interleaved RoPE (`DIFFLET_TPU_SPLIT_ROPE`).
    mesh: the device mesh as "AXIS=SIZE,..." over the axes cfg (classifier-free
        guidance: unconditional and conditional rows on two groups), data (more
        batch rows) and tp (the TP/SP ring), e.g. "cfg=2,tp=4"; None: one `tp`
        ring over every device (`DIFFLET_TPU_MESH`). Stored normalised
        ("cfg=2,tp=4", axes in mesh order); `mesh_axes()` gives the sizes.
    compile_cache: a directory for JAX's persistent compilation cache, so a
        later process loads the compiled steps instead of recompiling; None
        turns it off (`DIFFLET_TPU_COMPILE_CACHE`). The Runner and the bench
        enable it with `runtime.enable_compile_cache`, which creates the
        directory and checks that it is writable.
    expert_offload: where a two-expert model (Wan2.2 A14B) keeps its idle
        expert (`DIFFLET_TPU_EXPERT_OFFLOAD`): "on" in host memory
        (`memory_kind="pinned_host"` on the same mesh, moved to the devices when
        the pipeline switches experts, `pipeline.Denoiser`); "off" on the
        devices; "auto" (default) offloads only when both experts do not fit:
        when the devices report a memory limit (TPU) and the first expert's
        compiled step plus the other expert's parameters per device exceed it
        (Wan2.2 A14B at 720x1280x81 on a v5e-4), so a shape that fits pays no
        swap. Off TPU no limit is known and "auto" keeps both on the devices.
        "on" where the devices have no host memory kind is an error before any
        work; a one-expert model has nothing to offload (every value is a no-op).
    encoder_offload: where a prompt -> image pipeline keeps its text encoders
        between prompts (`DIFFLET_TPU_ENCODER_OFFLOAD`): "on" in host memory
        (`memory_kind="pinned_host"`, same shardings) after the prompts are
        encoded, back on the devices before the next encode
        (`pipeline.placement.EncoderHome`); "off" on the devices; "auto"
        (default) offloads only when the parts do not fit together: when the
        devices report a memory limit (TPU) and the transformer's compiled step
        plus the encoders' and the VAE's parameters per device exceed it,
        decided at the first call. Off TPU no limit is known and "auto" moves
        nothing; "on" where the devices have no host memory kind is an error
        when the pipeline loads. `python -m difflet_tpu.bench --compile-only
        --pipeline flux|qwen_image` prints the plan (docs/benchmarks.md).
    transformer_offload: where the transformer waits outside the denoise loop
        (`DIFFLET_TPU_TRANSFORMER_OFFLOAD`): "on" in host memory during the text
        encode and the VAE decode (its parameters dropped from the devices and
        copied back after the next encode, with the shardings its steps were
        compiled for; the host copy kept, no recompile; `Runner.offload` / `load`);
        "off" on the devices; "auto" (default) stages it for the encode when the
        devices report a memory limit (TPU) and, at the first call, the parameters
        per device of the text encoders, the transformer and the VAEs plus 1 GiB
        (`placement.ENCODE_MARGIN`) exceed it once `encoder_stream` is decided, and
        for the decode when XLA reports the decode out of device memory beside it
        (the text encoders leave first and the decode runs again; if still out of
        memory the transformer leaves too; later calls make that room first:
        HunyuanVideo 720x1280x129 on a v5e-4). Off TPU "auto" moves nothing; "on" without a host memory kind is
        an error at load.
    encoder_stream: whether a pipeline's decoder-LM text encoder keeps its layers in
        host memory and streams them through the devices a group at a time during its
        encode (`DIFFLET_TPU_ENCODER_STREAM`, `encoders.streaming.LayerStream`; the
        prompt's embedding rows gathered on the host): "on" always; "off" never;
        "auto" (default) when the devices report a memory limit (TPU) and, when the
        pipeline has loaded, the parameters per device of the text encoders, the
        transformer(s) and the VAEs plus 1 GiB (`placement.ENCODE_MARGIN`) exceed it
        (LTX-2's Gemma-3-12B on a v5e-4). Where it may stream ("on", or "auto" with a
        limit) the LM is loaded into host memory, so it never needs its whole size on
        the chips; if it then does not stream it moves to the devices at load's end. It comes before `transformer_offload`: with the LM streamed the
        transformer stays on the devices for the encode when the rest fits. Each encode
        copies the layers once (Gemma-3-12B: 5.0 GiB per chip under tp=4). Used by
        LTX2Pipeline. Off TPU "auto" streams nothing; "on" without a host memory kind
        is an error at load.
    kernel_tiles: a column-tile table (JSON) written by `python -m
        difflet_tpu.tools.sweep_tiles` on the same chip: the collective-matmul kernels
        then multiply in the tile measured fastest at each site it lists
        (`difflet_tpu.kernels.tiles`); None (default) or an unlisted site: the
        largest tile up to 512 columns that fits VMEM (`DIFFLET_TPU_KERNEL_TILES`).
        Checked when set (format, sites, tiles) and again against the mesh's
        device kind (a table measured on another chip is an error).
    vae_spread: how the video VAEs (the causal-3D family: Wan 2.x, Qwen-Image;
        HunyuanVideo's; LTX-2's video VAE) decode on a mesh of several devices (`DIFFLET_TPU_VAE_SPREAD`): "auto" (default) shards the batch
        when the devices divide it and otherwise spreads each video's rows over
        every device (`vae/spread.py`: a spatial split with one-row halos, exact,
        not diffusers' blended tiling), so one long clip decodes on all chips;
        "on" spreads the rows whatever the batch; "off" never (the batch sharded
        when it divides, else the decode replicated on every device). The
        `spread=` argument of `decode` / `decode_video` overrides it.
    text_trim: LTX-2's Gemma-3 encodes only the prompts' real tokens: the left padding
        every prompt of the call shares is cut before the encoder (the kept width
        rounded up to a power of two), each token at its untrimmed position
        (`DIFFLET_TPU_TEXT_TRIM`; `models/ltx2/text.py`). Off by default: the default
        runs diffusers' padded encode. Equal up to float rounding (measured on the
        tiny fixture: embeddings max abs 8e-6 of 15, connector outputs 2.3e-6).
    """

    sp: bool = False
    sp_kernel: str | None = None
    sp_rs_kernel: str = "auto"
    sp_ag_assemble: str = "concat"
    sp_single: bool = True
    sp_cross_local: bool = True
    sp_pad: bool = True
    check_vma: bool = False
    split_rope: bool = True
    mesh: str | None = None
    compile_cache: str | None = None
    expert_offload: str = "auto"
    encoder_offload: str = "auto"
    transformer_offload: str = "auto"
    encoder_stream: str = "auto"
    kernel_tiles: str | None = None
    vae_spread: str = "auto"
    text_trim: bool = False
    step_cache: str | None = None

    def __post_init__(self):
        for name in ("sp", "sp_single", "sp_cross_local", "sp_pad", "check_vma", "split_rope", "text_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        if self.sp_kernel is not None and self.sp_kernel not in KERNEL_VALUES:
            raise ConfigError(f"Config.sp_kernel must be one of {KERNEL_VALUES} or None, got {self.sp_kernel!r}")
        if self.sp_rs_kernel not in RS_KERNEL_VALUES:
            raise ConfigError(f"Config.sp_rs_kernel must be one of {RS_KERNEL_VALUES}, got {self.sp_rs_kernel!r}")
        if self.sp_ag_assemble not in ASSEMBLE_VALUES:
            raise ConfigError(f"Config.sp_ag_assemble must be one of {ASSEMBLE_VALUES}, got {self.sp_ag_assemble!r}")
        if self.expert_offload not in OFFLOAD_VALUES:
            raise ConfigError(f"Config.expert_offload must be one of {OFFLOAD_VALUES}, got {self.expert_offload!r}")
        if self.encoder_offload not in OFFLOAD_VALUES:
            raise ConfigError(f"Config.encoder_offload must be one of {OFFLOAD_VALUES}, got {self.encoder_offload!r}")
        if self.encoder_stream not in OFFLOAD_VALUES:
            raise ConfigError(f"Config.encoder_stream must be one of {OFFLOAD_VALUES}, got {self.encoder_stream!r}")
        if self.transformer_offload not in OFFLOAD_VALUES:
            raise ConfigError(f"Config.transformer_offload must be one of {OFFLOAD_VALUES}, "
                              f"got {self.transformer_offload!r}")
        if self.vae_spread not in SPREAD_VALUES:
            raise ConfigError(f"Config.vae_spread must be one of {SPREAD_VALUES}, got {self.vae_spread!r}")
        if self.compile_cache is not None:
            _check_cache_path("Config.compile_cache", self.compile_cache)
        if self.mesh is not None:
            object.__setattr__(self, "mesh", _normal_mesh("Config.mesh", self.mesh))
        if self.kernel_tiles is not None:
            _check_tile_table("Config.kernel_tiles", self.kernel_tiles)
        if self.step_cache is not None:
            options = parse_step_cache(self.step_cache, "Config.step_cache")
            object.__setattr__(self, "step_cache", None if options is None else options.spec())

    def mesh_axes(self) -> dict | None:
        """{"cfg": 2, "tp": 4} from `mesh`, or None when unset."""
        from difflet_tpu.parallel.mesh import parse_mesh

        return None if self.mesh is None else parse_mesh(self.mesh)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Config":
        """Reads every `DIFFLET_TPU_*` variable; explicit `overrides` win."""
        environ = os.environ if environ is None else environ
        values = {}
        for var, value in environ.items():
            if not var.startswith(PREFIX):
                continue
            if var not in ENV_VARS:
                raise ConfigError(
                    f"unknown variable {var}={value!r}; known: {', '.join(sorted(ENV_VARS))}")
            field, parse = ENV_VARS[var]
            values[field] = parse(var, value)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown Config fields {sorted(unknown)}")
        values.update(overrides)
        return cls(**values)

    def ag_kernel(self, model_default: str, platform: str) -> str:
        """The all-gather-matmul implementation to use under SP.

        An explicit choice wins; otherwise the model's default on TPU and the
        JAX ring elsewhere (the Pallas kernel only runs interpreted off TPU).
        """
        if self.sp_kernel is not None:
            return self.sp_kernel
        return model_default if platform == "tpu" else "jax"

    def rs_kernel(self, platform: str, chip) -> str:
        """The matmul-reduce-scatter implementation under SP: "auto" (chosen per
        site, `Parallel.row`) stays "auto" on a TPU whose constants are known
        (`chip`, a `difflet_tpu.parallel.chips.Chip` or None) and is the JAX ring elsewhere."""
        if self.sp_rs_kernel == "auto" and (platform != "tpu" or chip is None):
            return "jax"
        return self.sp_rs_kernel


def _parse_bool(var: str, value: str) -> bool:
    if value.strip() not in BOOL_VALUES:
        raise ConfigError(f"{var}={value!r} is not allowed; use one of 0, 1")
    return BOOL_VALUES[value.strip()]


def _parse_choice(choices):
    def parse(var: str, value: str) -> str:
        v = value.strip().lower()
        if v not in choices:
            raise ConfigError(f"{var}={value!r} is not allowed; use one of {', '.join(choices)}")
        return v
    return parse


def _check_cache_path(name: str, value) -> None:
    # the directory itself is created and tested by runtime.enable_compile_cache
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name}={value!r} is not allowed; use one of: a directory path, or unset it")
    if "://" in value:
        raise ConfigError(f"{name}={value!r} is not allowed; use one of: a local directory path "
                          f"(remote caches are not supported)")


def _check_tile_table(name: str, value) -> None:
    from difflet_tpu.kernels import tiles as kernel_tiles

    use = "use one of: a table written by python -m difflet_tpu.tools.sweep_tiles, or unset it"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name}={value!r} is not allowed; {use}")
    try:
        kernel_tiles.load(value.strip())
    except ValueError as e:
        raise ConfigError(f"{name}={value!r} is not allowed; {use} ({e})") from None


def _parse_tile_table(var: str, value: str) -> str:
    _check_tile_table(var, value)
    return value.strip()


def _normal_mesh(name: str, value) -> str:
    from difflet_tpu.parallel.mesh import AXES, format_mesh, parse_mesh

    try:
        return format_mesh(parse_mesh(value))
    except ValueError as e:
        raise ConfigError(f"{name}={value!r} is not allowed; use one of: AXIS=SIZE[,AXIS=SIZE...] over the axes "
                          f"{', '.join(AXES)}, e.g. cfg=2,tp=4 ({e})") from None


def _parse_mesh(var: str, value: str) -> str:
    return _normal_mesh(var, value)


def _parse_path(var: str, value: str) -> str:
    _check_cache_path(var, value)
    return value.strip()


# --------------------------------------------------------------------------
# Step caching (difflet_tpu.step_cache): the option string, parsed and checked here only
# --------------------------------------------------------------------------

CACHE_METHODS = ("first-block",)


@dataclasses.dataclass(frozen=True)
class StepCacheOptions:
    """First-block residual caching (cache-dit's DBCache; ParaAttention's First-Block Cache
    when `last` is 0): each transformer call runs its `first` blocks; when the relative L1
    change of their output residual since the call's last full pass is below `threshold`,
    the middle blocks are skipped and their residual from that full pass is added instead;
    the `last` blocks always run.

    threshold: the relative L1 change below which a step reuses the cache (0: never).
    warmup: the first `warmup` calls (of each CFG branch, and again after an expert switch)
        always run every block (at least 1: the first call fills the cache).
    max_skips: at most this many cached calls in a row, then a full pass.
    first / last: the blocks that always run at the start / end of the model's block chain
        (cache-dit's Fn / Bn).
    force: a fixed pattern per step instead of the threshold (tests, experiments): "F" a
        full pass, "S" a cached one, "A" the threshold's decision; warmup and max_skips do
        not apply to F / S, and a step past the pattern's end decides by the threshold.
    """

    method: str = "first-block"
    threshold: float = 0.08
    warmup: int = 2
    max_skips: int = 3
    first: int = 1
    last: int = 0
    force: str | None = None

    def spec(self) -> str:
        """The option string that parses back to these options."""
        keys = ("threshold", "warmup", "max_skips", "first", "last", "force")
        return f"{self.method}:" + ",".join(f"{k}={getattr(self, k)}" for k in keys if getattr(self, k) is not None)


CACHE_USAGE = ("off, or first-block[:KEY=VALUE,...] with KEY in threshold (>= 0), warmup (>= 1), max_skips (>= 1), "
               "first (>= 1), last (>= 0), force (letters F, S, A), e.g. first-block:threshold=0.08,warmup=2,max_skips=3")


def parse_step_cache(value, name: str = "cache") -> StepCacheOptions | None:
    """`cache=` / `--cache` / DIFFLET_TPU_STEP_CACHE: None, "" or "off" -> None (no cache); a
    `StepCacheOptions` as it is (checked); "first-block[:KEY=VALUE,...]" with the keys of
    `StepCacheOptions`. Anything else is a ConfigError naming the part that is wrong."""
    if value is None or isinstance(value, StepCacheOptions):
        return value if value is None else parse_step_cache(value.spec(), name)

    def bad(why: str):
        return ConfigError(f"{name}={value!r}: {why}; use one of: {CACHE_USAGE}")

    if not isinstance(value, str):
        raise bad("not an option string")
    text = value.strip()
    if text.lower() in ("", "off", "none"):
        return None
    method, _, rest = (p.strip() for p in text.partition(":"))
    if method not in CACHE_METHODS:
        raise bad(f"unknown caching method {method!r}")
    kinds = {"threshold": float, "warmup": int, "max_skips": int, "first": int, "last": int, "force": str}
    values = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = (p.strip() for p in item.partition("="))
        if key not in kinds or not eq or not raw:
            raise bad(f"{item!r} is not KEY=VALUE with a known KEY")
        if key in values:
            raise bad(f"{key} is given twice")
        try:
            values[key] = kinds[key](raw)
        except ValueError:
            raise bad(f"{key}={raw!r} is not {'a number' if kinds[key] is float else 'an integer'}") from None
    o = StepCacheOptions(method=method, **values)
    problems = []
    if not (o.threshold >= 0 and o.threshold != float("inf")):
        problems.append(f"threshold={o.threshold} must be a finite number >= 0")
    if o.warmup < 1:
        problems.append(f"warmup={o.warmup} must be >= 1 (the first call fills the cache)")
    if o.max_skips < 1:
        problems.append(f"max_skips={o.max_skips} must be >= 1")
    if o.first < 1:
        problems.append(f"first={o.first} must be >= 1 (the first blocks' residual decides)")
    if o.last < 0:
        problems.append(f"last={o.last} must be >= 0")
    if o.force is not None and set(o.force.upper()) - set("FSA"):
        problems.append(f"force={o.force!r} must be letters F (full), S (cached), A (by the threshold)")
    if problems:
        raise bad("; ".join(problems))
    return o if o.force is None else dataclasses.replace(o, force=o.force.upper())


def _parse_step_cache(var: str, value: str) -> str | None:
    options = parse_step_cache(value, var)
    return None if options is None else options.spec()


# Variable -> (Config field, parser). The one list of toggles.
ENV_VARS = {
    "DIFFLET_TPU_SP": ("sp", _parse_bool),
    "DIFFLET_TPU_SP_KERNEL": ("sp_kernel", _parse_choice(KERNEL_VALUES)),
    "DIFFLET_TPU_SP_RS_KERNEL": ("sp_rs_kernel", _parse_choice(RS_KERNEL_VALUES)),
    "DIFFLET_TPU_SP_AG_ASSEMBLE": ("sp_ag_assemble", _parse_choice(ASSEMBLE_VALUES)),
    "DIFFLET_TPU_SP_SINGLE": ("sp_single", _parse_bool),
    "DIFFLET_TPU_SP_CROSS_LOCAL": ("sp_cross_local", _parse_bool),
    "DIFFLET_TPU_SP_PAD": ("sp_pad", _parse_bool),
    "DIFFLET_TPU_CHECK_VMA": ("check_vma", _parse_bool),
    "DIFFLET_TPU_SPLIT_ROPE": ("split_rope", _parse_bool),
    "DIFFLET_TPU_MESH": ("mesh", _parse_mesh),
    "DIFFLET_TPU_COMPILE_CACHE": ("compile_cache", _parse_path),
    "DIFFLET_TPU_EXPERT_OFFLOAD": ("expert_offload", _parse_choice(OFFLOAD_VALUES)),
    "DIFFLET_TPU_ENCODER_OFFLOAD": ("encoder_offload", _parse_choice(OFFLOAD_VALUES)),
    "DIFFLET_TPU_TRANSFORMER_OFFLOAD": ("transformer_offload", _parse_choice(OFFLOAD_VALUES)),
    "DIFFLET_TPU_ENCODER_STREAM": ("encoder_stream", _parse_choice(OFFLOAD_VALUES)),
    "DIFFLET_TPU_KERNEL_TILES": ("kernel_tiles", _parse_tile_table),
    "DIFFLET_TPU_VAE_SPREAD": ("vae_spread", _parse_choice(SPREAD_VALUES)),
    "DIFFLET_TPU_TEXT_TRIM": ("text_trim", _parse_bool),
    "DIFFLET_TPU_STEP_CACHE": ("step_cache", _parse_step_cache),
}
