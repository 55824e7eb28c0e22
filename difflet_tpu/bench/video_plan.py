"""`--compile-only --pipeline wan`: every stage of prompt -> video, compiled deviceless for a
TPU topology, with HBM per chip, an ESTIMATED time and the placement plan (the same plan JSON
as the image pipelines, `pipeline_plan.py`).

Stages of `WanPipeline.__call__` (models/wan/pipeline.py; batch 1, bf16, the released sizes):

* UMT5-XXL encoder at 512 tokens with the attention mask, twice (prompt and negative prompt),
  as `encoders/` places it (tp) and as one segment of layers per chip (`pipeline_plan`).
* The transformer: 50 steps, ONE call a step on the [uncond; cond] batch of 2 (CFG).
* The VAE's `decode_video` (uint8 frames out), on one chip and spread over every chip of the
  mesh (`vae/spread.py`); the spread one is the pipeline's default on a mesh (batch 1 does
  not split) and is the one the plan sums. With `DIFFLET_TPU_VAE_SPREAD=off` the pipeline
  decodes on one chip, and the plan compiles and sums only that.
* Wan2.2 A14B: two experts with the same shapes. Both resident beside the other parts, or
  the idle one staged through host memory (`placement.ExpertHome`): then each video pays two
  host-to-device copies of one expert (the high-noise one back in at the start, the low-noise
  one at the boundary), estimated at `runtime.H2D_BYTES_PER_S` (an assumption) and added to
  the denoise. The resident plan is kept when it fits, as ExpertHome's "auto".
"""

from __future__ import annotations

import sys
import time

from difflet_tpu.bench import pipeline_plan as PP
from difflet_tpu.bench.cases import BenchError
from difflet_tpu.bench.report import ms, write_json

# the released Wan 2.1 VAE (Wan-AI/Wan2.1-T2V-14B-Diffusers vae/config.json; Wan2.2 A14B ships it too)
WAN21_VAE = dict(class_name="AutoencoderKLWan", base_dim=96, z_dim=16, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                 temperal_downsample=(False, True, True))
# the Wan 2.2 VAE of Wan-AI/Wan2.2-TI2V-5B-Diffusers (vae/config.json, as tests/fixtures/vae/generate.py
# records it): 16x spatial, 48 latent channels, patch 2; latents_mean / std are placeholders (shapes only)
WAN22_VAE = dict(class_name="AutoencoderKLWan", base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=(1, 2, 4, 4),
                 num_res_blocks=2, temperal_downsample=(False, True, True), is_residual=True, in_channels=12,
                 out_channels=12, patch_size=2, latents_mean=(0.0,) * 48, latents_std=(1.0,) * 48)
# `wan:tiny` (tests: the CLI path in seconds): a 4-layer UMT5 and a base_dim 8 VAE
TINY_UMT5 = dict(vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=4, num_heads=4, per_layer_relative_bias=True)
TINY_VAE = dict(WAN21_VAE, base_dim=8, z_dim=4, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
# preset -> (VAE, spatial factor, default height x width x frames (the diffusers docs' examples), UMT5)
MODELS = {
    "Wan2.1-T2V-14B": (WAN21_VAE, 8, (480, 832, 81), None),
    "Wan2.1-T2V-1.3B": (WAN21_VAE, 8, (480, 832, 81), None),
    "Wan2.2-T2V-A14B": (WAN21_VAE, 8, (720, 1280, 81), None),
    "Wan2.2-TI2V-5B": (WAN22_VAE, 16, (704, 1280, 121), None),
    "tiny": (TINY_VAE, 8, (32, 32, 5), TINY_UMT5),
}
TEXT_TOKENS = 512
STEPS = 50


def resolve(model: str | None):
    """`--model` (None: Wan2.1-T2V-14B) -> (spec, preset, VAE config dict, spatial factor,
    default shape, UMT5 config)."""
    from difflet_tpu.encoders import t5
    from difflet_tpu.pipeline import denoise as PL

    spec, preset = PL.resolve_model(model or "wan:Wan2.1-T2V-14B")
    if spec.name != "wan":
        raise BenchError(f"--pipeline wan plans a Wan model (--model wan:<preset>), got {model!r}")
    preset = preset or "Wan2.1-T2V-14B"
    if preset not in MODELS:
        raise BenchError(f"--pipeline wan: no plan for {preset!r}; choose one of: "
                         + ", ".join(f"wan:{m}" for m in MODELS))
    vae, scale, shape, encoder = MODELS[preset]
    return spec, preset, vae, scale, shape, t5.T5Config(**encoder) if encoder else t5.UMT5_XXL


def compile_decode(vae: dict, scale: int, height: int, width: int, frames: int, devices, chip, calibration,
                   spread: bool) -> dict:
    """`AutoencoderKLCausal3D.decode_video(..., uint8=True)` as the pipeline calls it: on one
    chip, or (`spread`) each video's rows spread over every chip of `devices` (the axis the
    VAE chooses), as benchmark/vae_spread.py compiles it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from difflet_tpu import runtime
    from difflet_tpu.vae import AutoencoderKLCausal3D, Causal3DConfig
    from difflet_tpu.vae import loading as VL

    t0 = time.perf_counter()
    config = Causal3DConfig(**vae)
    mesh = Mesh(np.array(devices if spread else devices[:1]), ("tp",))
    model = nnx.eval_shape(lambda: AutoencoderKLCausal3D(config, dtype=jnp.bfloat16))
    model.mesh = mesh
    graphdef, state = nnx.split(model)
    replicated = NamedSharding(mesh, PartitionSpec())
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state)
    shape = (1, config.z_dim, (frames - 1) // 4 + 1, height // scale, width // scale)
    latents = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=replicated)
    axis = model.spread_axis(shape, "on") if spread else None
    compiled = VL._apply_jit.trace(graphdef, state, "decode_video_latents", latents, (("spread_axis", axis),),
                                   True).lower().compile()
    return dict(PP._priced(compiled, chip, calibration, t0), placement=f"spread {axis}" if spread else "one chip",
                chips=mesh.size, latents=list(shape), weights_per_chip=runtime.tree_bytes_per_device(state))


def reused_decode(path: str, vae: dict, topology: str, height: int, width: int, frames: int,
                  placement: str) -> dict | None:
    """The row of benchmark/vae_spread.py's result `path` for this shape and placement ("one",
    "height", "width") when it compiled the same program (the Wan 2.1 VAE, uint8 frames, the
    same topology), as a stage row; None when it has none."""
    import json

    data = json.loads(open(path).read())
    if vae is not WAN21_VAE or data.get("topology") != topology:
        return None
    for r in data["rows"]:
        if (r.get("height"), r.get("width"), r.get("frames"), r.get("placement"), r.get("output")) == \
                (height, width, frames, placement, "uint8") and "error" not in r:
            where = "one chip" if placement == "one" else f"spread {placement}"
            # its `arguments` are the parameters plus the (small) latents
            return dict(hbm=r["hbm"], estimate_ms=r["estimate_ms"], estimate_raw_ms=r["estimate_raw_ms"],
                        compile_s=r["compile_s"], placement=where, chips=r["chips"], latents=r["latents"],
                        weights_per_chip=r["hbm"]["arguments"], source=f"{path} (benchmark/vae_spread.py)")
    return None


def reused_stages(path: str, model: str, topology: str, height: int, width: int, frames: int,
                  pipeline: str = "wan") -> dict:
    """The stages that compiled (no `error`) in the earlier plan JSON `path`, by stage name, as
    reusable rows (`source` names the file); BenchError when it plans another model, shape or
    topology."""
    import json
    import os

    data = json.loads(open(path).read())
    got = (data.get("pipeline"), data.get("model"), data.get("topology"), data.get("height"), data.get("width"),
           data.get("frames"))
    if got != (pipeline, model, topology, height, width, frames):
        raise BenchError(f"--reuse-stages {path}: it plans {got[1]} {got[3]}x{got[4]}x{got[5]} on {got[2]}, "
                         f"not {model} {height}x{width}x{frames} on {topology}")
    keep = ("stage", "calls_per_image", "chosen", "source")
    return {r["stage"]: dict({k: v for k, v in r.items() if k not in keep},
                             source=r.get("source") or f"an earlier plan, {os.path.basename(path)}")
            for r in data["stages"] if "error" not in r}


def expert_plans(rows: dict, p: dict, transformer: dict, setting: str, chip) -> list[dict]:
    """Wan2.2 A14B's two placements of its experts (compile_one's row with `other_experts`
    resident): both resident, and the idle one staged through host memory (2 copies a video).
    The first is `chosen` when it fits, else the second. One-expert models: [plan_totals]."""
    from difflet_tpu import runtime

    other = transformer["hbm"].get("other_experts")
    if not other:
        return [dict(PP.plan_totals(rows, p, transformer, setting, chip), experts="one")]
    hbm = transformer["hbm"]
    both = dict(transformer, hbm=dict(hbm, arguments=hbm["arguments"] + other))
    resident = dict(PP.plan_totals(rows, p, both, setting, chip), experts="both resident", expert_move_ms=0.0)
    one = dict(transformer, hbm=dict(hbm, total=hbm["total"] - other, other_experts=0))
    staged = dict(PP.plan_totals(rows, p, one, setting, chip), experts="staged through host memory")
    bw = runtime.H2D_BYTES_PER_S.get(chip.name)
    move = ms(2 * other / bw) if bw else None
    staged.update(expert_move_ms=move, expert_bytes_per_chip=other, h2d_bytes_per_s=bw)
    if move:
        staged["denoise_ms"] = round(staged["denoise_ms"] + move, 3)
        staged["total_ms"] = round(staged["encode_ms"] + staged["denoise_ms"] + staged["decode_ms"], 3)
        share = (staged["encode_ms"] + staged["decode_ms"]) / staged["denoise_ms"]
        staged.update(encode_decode_share=round(share, 4), within_10_percent=share <= 0.10)
    chosen = resident if resident["fits"] else staged
    chosen["chosen"] = True
    return [resident, staged]


def run_video_plan(args) -> int:
    """Deviceless compiles of every stage of a Wan text-to-video call for `args.topology`."""
    from difflet_tpu.tools import deviceless

    try:
        devices, chip, calibration = deviceless.compile_target(args.topology)
    except ValueError as e:
        raise BenchError(str(e)) from None
    from difflet_tpu.bench import cases, compile_only
    from difflet_tpu.parallel.mesh import format_mesh, make_mesh

    model = args.model[0] if args.model else None
    spec, preset, vae, scale, default, encoder = resolve(model)
    height, width, frames = args.height or default[0], args.width or default[1], args.frames or default[2]
    for name, v in (("height", height), ("width", width)):
        if v % (2 * scale):
            raise BenchError(f"--{name} {v}: must be a multiple of {2 * scale} for {preset} (the VAE's {scale}x "
                             "and the transformer's 2x2 patches)")
    if (frames - 1) % 4:
        raise BenchError(f"--frames {frames}: must be 1 + 4k (the VAE's 4x temporal compression)")
    steps = args.steps or STEPS
    p = dict(model=f"wan:{preset}", steps=steps, calls_per_step=1,
             encoders=[("umt5-xxl", encoder, TEXT_TOKENS, True, 2)])
    mesh = make_mesh(len(devices), devices)
    plans = []
    earlier = (reused_stages(args.reuse_stages, p["model"], args.topology, height, width, frames)
               if args.reuse_stages else {})

    def report(done: bool) -> dict:
        r = dict(kind="pipeline-plan", pipeline="wan", model=f"wan:{preset}", topology=args.topology,
                 chip=chip.to_dict(), height=height, width=width, frames=frames, batch=1, cfg_batch=2,
                 calibration=dict(calibration.as_dict(), band=list(calibration.band), source=calibration.source),
                 note="estimates from deviceless compiles, not measurements", stages=stages, plans=plans)
        return r if done else dict(r, incomplete="written after each stage; the plan follows the last one")

    stage = PP.Stages(args.topology, earlier, args.json, report)
    stages = stage.rows

    rows = {}
    name, config, seq, masked, calls = p["encoders"][0]
    options = [stage(f"{name} ({seq} tokens) tp", calls, PP.compile_encoder_tp, config, seq, masked, mesh, chip,
                     calibration)]
    if PP._layers(config) % len(devices) == 0 and PP._layers(config) >= len(devices):
        options.append(stage(f"{name} ({seq} tokens) segments", calls, PP.compile_encoder_segments, config, seq,
                             devices, chip, calibration))
    ok = [r for r in options if "error" not in r]
    if ok:
        rows[name] = min(ok, key=lambda r: r["estimate_ms"])
        rows[name]["chosen"] = True
    cfg = cases.build_config(spec, preset)
    shape = dict(height=height, width=width, frames=frames)
    axes = cases.mesh_axes_for(spec, cfg, len(devices), 2, None, False)
    tmesh = make_mesh(devices=devices, **axes)
    steps_rows = []
    for variant in args.modes:
        args.offload = "off"  # both experts priced resident here; expert_plans prices the staging
        steps_rows.append(stage(f"transformer {variant} batch 2 ({format_mesh(dict(tmesh.shape))})", steps,
                                _transformer, compile_only, spec, preset, cfg, shape, variant, tmesh, chip,
                                calibration, args))

    def decode(name, spread):
        axis = "one"
        if spread:
            from difflet_tpu.vae import spread as vae_spread

            axis = vae_spread.choose_axis(height // scale, width // scale, len(devices))
        reused = args.decode_rows and reused_decode(args.decode_rows, vae, args.topology, height, width, frames, axis)
        return stage(name, 1, compile_decode, vae, scale, height, width, frames, devices, chip, calibration, spread,
                     reused=reused or None)

    rows["vae"] = one = decode("vae decode_video, one chip", False)
    from difflet_tpu.config import Config

    # DIFFLET_TPU_VAE_SPREAD=off: the pipeline decodes on one chip, so the plan compiles only that
    if len(devices) > 1 and Config.from_env().vae_spread != "off":
        spread = decode(f"vae decode_video, spread over {len(devices)}", True)
        rows["vae"] = spread if "error" not in spread else one
    rows["vae"]["chosen"] = True
    for r in steps_rows:
        if "error" not in r and name in rows and "error" not in rows["vae"]:
            plans.extend(expert_plans(rows, p, r, args.encoder_offload, chip))
    print_video_plan(report(True))
    if args.json:
        write_json(args.json, report(True))
    return 1 if stage.failed else 0


def print_video_plan(report: dict, out=None) -> None:
    out = out or sys.stdout
    PP.print_plan(dict(report, output="video", height=f"{report['height']}x{report['width']}",
                       width=f"{report['frames']} frames"),
                  out)
    for t in report["plans"]:
        if t.get("experts") not in (None, "one"):
            move = t.get("expert_move_ms")
            print(f"  {t['mode']} experts {t['experts']}{' (chosen)' if t.get('chosen') else ''}: "
                  f"fits {'yes' if t['fits'] else 'NO'}, expert moves {move if move is not None else '?'} ms a video",
                  file=out)



def _transformer(compile_only, spec, preset, cfg, shape, variant, mesh, chip, calibration, args) -> dict:
    """One step on the CFG batch of 2 ([uncond; cond], `WanPipeline.denoise_video`)."""
    r = compile_only.compile_one(spec, preset, cfg, shape, variant, mesh, chip, calibration, args, 2)
    return dict(r, placement=variant, weights_per_chip=r["hbm"]["arguments"])
