"""`--compile-only --pipeline flux|qwen_image`: every stage of prompt -> image, compiled
deviceless for a TPU topology, with HBM per chip, an ESTIMATED time and the placement plan.

Stages (batch 1, bf16, the released sizes, 1024 x 1024 unless --height / --width):

* FLUX.1-dev: CLIP-L text tower (77 tokens), T5-XXL encoder (512 tokens), the transformer
  (28 steps, one call a step: guidance is embedded), AutoencoderKL decode.
* Qwen-Image: Qwen2.5-VL-7B's language model at 167 tokens (128 prompt tokens + the chat
  template's 34 + 5), run twice (prompt and negative prompt: true CFG is on by default), the
  transformer (50 steps, TWO batch-1 calls a step: true CFG; 128 text tokens as the bench's
  transformer rows), the causal-3D VAE decode of one frame.

Each encoder is compiled as the pipelines place it (`encoders/`: Megatron specs over the mesh's
`tp`, GSPMD). The big ones (T5-XXL, Qwen2.5-VL-7B) are also priced the other way: one
contiguous segment of layers per chip, the hidden states handed chip to chip (the reference PR
did this for T5-XXL). At batch 1 those segments run one after another, so one segment is
compiled on one chip and its estimate taken P times, plus P - 1 ICI hops of the hidden states;
chip 0 also holds the embedding table. The faster placement is reported as the default.

Memory: a stage's peak is its compiled program's (`memory_analysis`: its weights, inputs,
outputs, temporaries, code) plus the parameters of every other part resident meanwhile;
`pipeline.placement.decide` says whether the text encoders must go to host memory between
prompts (`Config.encoder_offload`), and then each prompt pays one host-to-device copy of them
(estimated at `runtime.H2D_BYTES_PER_S`, an assumption). Times are the estimator's
(`tools.estimate`) on each compiled schedule, calibrated as the bench's transformer rows.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from difflet_tpu.bench.cases import BenchError
from difflet_tpu.bench.report import ms, write_json

GIB = 2**30
QWEN_PROMPT_TOKENS = 128
QWEN_TEMPLATE_TOKENS = 34 + 5  # the chat template's system turn (dropped after encoding) and its tail


def pipelines():
    """name -> what the plan compiles (the released configs; FLUX.1-dev's `vae/config.json`:
    https://huggingface.co/black-forest-labs/FLUX.1-dev/blob/main/vae/config.json)."""
    from difflet_tpu.encoders import clip, decoder_lm, t5
    from difflet_tpu.vae import AutoencoderKLConfig, Causal3DConfig

    flux_vae = AutoencoderKLConfig(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, sample_size=1024,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    return {
        "flux": dict(model="flux:flux.1-dev", steps=28, calls_per_step=1,
                     encoders=[("clip-l", clip.CLIP_VIT_L_14, 77, False, 1), ("t5-xxl", t5.T5_V1_1_XXL, 512, False, 1)],
                     vae=flux_vae),
        "qwen_image": dict(model="qwen_image:qwen-image", steps=50, calls_per_step=2,
                           encoders=[("qwen2.5-vl-7b", decoder_lm.QWEN2_5_VL_7B,
                                      QWEN_PROMPT_TOKENS + QWEN_TEMPLATE_TOKENS, True, 2)],
                           vae=Causal3DConfig()),
    }


def _layers(config) -> int:
    return getattr(config, "num_layers", None) or config.num_hidden_layers


def _width(config) -> int:
    return getattr(config, "d_model", None) or config.hidden_size


def _priced(compiled, chip, calibration, t0) -> dict:
    from difflet_tpu import runtime
    from difflet_tpu.tools import estimate as E

    from difflet_tpu.tools.calibration import expected_ms

    raw = E.estimate(compiled.as_text(), chip)
    breakdown = E.summarize(raw)  # priced as the bench prices a step: the raw replay, scaled per kind of work
    return dict(hbm=runtime.memory_report(compiled), estimate_ms=round(expected_ms(breakdown, calibration), 3),
                estimate_raw_ms=ms(raw.total), breakdown=breakdown, compile_s=round(time.perf_counter() - t0, 2))


def _sds(shape, dtype, mesh):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def compile_encoder_tp(config, seq: int, masked: bool, mesh, chip, calibration, call: tuple = ()) -> dict:
    """The encoder as `encoders/` runs it on `mesh`: Megatron specs over `tp`, GSPMD. `call`:
    (name, value) keyword arguments of the call (a decoder LM's `hidden_state`, ...)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from difflet_tpu import encoders, runtime

    t0 = time.perf_counter()
    model = encoders.abstract(config, jnp.bfloat16, mesh)
    graphdef, state = nnx.split(model)
    weights = runtime.tree_bytes_per_device(nnx.state(model, nnx.Param))
    ids = _sds((1, seq), jnp.int32, mesh)
    kw = dict(call)
    fn = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, m, **kw) if masked else nnx.merge(graphdef, s)(i, **kw))
    compiled = fn.trace(state, ids, ids).lower().compile()
    return dict(_priced(compiled, chip, calibration, t0), placement="tp", weights_per_chip=weights)


def _segment_forward(model, hidden):
    """The blocks of a T5 encoder / decoder LM on hidden states (no embedding, no final norm)."""
    import jax.numpy as jnp

    from difflet_tpu.encoders import decoder_lm
    from difflet_tpu.encoders.layers import causal_mask

    if isinstance(model, decoder_lm.DecoderLM):
        b, s = hidden.shape[:2]
        pos = jnp.broadcast_to(jnp.arange(s), (3, b, s)) if model.config.mrope_section else jnp.arange(s)[None]
        cos, sin = decoder_lm.rope_cos_sin(model.config, pos, hidden.dtype)
        for layer in model.layers:
            hidden = layer(hidden, causal_mask(s), cos, sin)
        return hidden
    bias = None
    for block in model.encoder.block:
        hidden, bias = block(hidden, None, bias)
    return hidden


def compile_encoder_segments(config, seq: int, devices, chip, calibration) -> dict:
    """One contiguous segment of layers per chip, handed on chip to chip: one segment compiled
    on one chip; time = P x its estimate + (P - 1) hops of the hidden states (they run one
    after another at batch 1); HBM = the segment's + the embedding table on chip 0."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from difflet_tpu import encoders, runtime
    from difflet_tpu.parallel.mesh import make_mesh

    P = len(devices)
    layers = _layers(config)
    if layers % P:
        raise BenchError(f"{layers} layers do not split into {P} equal segments")
    field = "num_layers" if hasattr(config, "num_layers") else "num_hidden_layers"
    seg_config = dataclasses.replace(config, **{field: layers // P})
    mesh = make_mesh(1, devices[:1])
    t0 = time.perf_counter()
    model = encoders.abstract(seg_config, jnp.bfloat16, mesh)
    blocks = model.layers if hasattr(model, "layers") else model.encoder.block
    weights = runtime.tree_bytes_per_device(nnx.state(blocks, nnx.Param))
    graphdef, state = nnx.split(model)
    # T5's residual stream is float32 from the first feed-forward on (wo kept in float32)
    act_dtype = jnp.float32 if hasattr(config, "d_model") else jnp.bfloat16
    hidden = _sds((1, seq, _width(config)), act_dtype, mesh)
    fn = jax.jit(lambda s, h: _segment_forward(nnx.merge(graphdef, s), h))
    priced = _priced(fn.trace(state, hidden).lower().compile(), chip, calibration, t0)
    # the segment program's arguments hold the whole abstract model's parameters (its embedding
    # too, unread): count the blocks' on every chip and the embedding on chip 0 only
    embed = config.vocab_size * _width(config) * 2
    seg_args = priced["hbm"]["arguments"]
    per_chip = priced["hbm"]["total"] - seg_args + weights + int(np.prod(hidden.shape)) * jnp.dtype(act_dtype).itemsize
    hop = np.prod(hidden.shape) * jnp.dtype(act_dtype).itemsize / chip.ici_link_bw + chip.ici_latency
    segment_ms = priced["estimate_ms"]
    return dict(priced, placement="segments", segments=P, segment_ms=segment_ms, hop_ms=ms(hop),
                estimate_ms=round(P * segment_ms + 1e3 * (P - 1) * hop, 3),
                estimate_raw_ms=round(P * priced["estimate_raw_ms"] + 1e3 * (P - 1) * hop, 3),
                hbm=dict(priced["hbm"], total=per_chip + embed, segment_program=priced["hbm"]["total"]),
                weights_per_chip=weights + embed)


def compile_vae(config, height: int, width: int, mesh, chip, calibration) -> dict:
    """The pipeline's decode (`vae.loading.call_jitted`): batch 1 does not split over the mesh,
    so the parameters and the latents are replicated and every chip decodes the image."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from difflet_tpu.vae import AutoencoderKL, AutoencoderKLCausal3D
    from difflet_tpu.vae import loading as VL

    t0 = time.perf_counter()
    causal = not hasattr(config, "latent_channels")
    cls = AutoencoderKLCausal3D if causal else AutoencoderKL
    model = nnx.eval_shape(lambda: cls(config, dtype=jnp.bfloat16, rngs=None))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: _sds(x.shape, x.dtype, mesh), state)
    channels = config.z_dim if causal else config.latent_channels
    h, w = height // 8, width // 8
    latents = _sds((1, channels, 1, h, w) if causal else (1, channels, h, w), jnp.bfloat16, mesh)
    method = "decode_image" if causal else "decode_latents"
    compiled = VL._apply_jit.trace(graphdef, state, method, latents).lower().compile()
    from difflet_tpu import runtime

    return dict(_priced(compiled, chip, calibration, t0), placement="replicated",
                weights_per_chip=runtime.tree_bytes_per_device(state))


def plan_totals(rows: dict, p: dict, transformer: dict, setting: str, chip) -> dict:
    """The placement decision and the end-to-end ESTIMATE for one transformer variant.

    rows: encoder name -> its chosen row; p: the pipeline entry; transformer: compile_one's row."""
    from difflet_tpu import runtime
    from difflet_tpu.pipeline import placement

    enc = {name: rows[name] for name, *_ in p["encoders"]}
    weights = {**{n: r["weights_per_chip"] for n, r in enc.items()},
               "transformer": transformer["hbm"]["arguments"], "vae": rows["vae"]["weights_per_chip"]}
    stages = ([dict(name=n, component=n, kind=placement.ENCODE, total=r["hbm"]["total"]) for n, r in enc.items()]
              + [dict(name="transformer", component="transformer", kind=placement.DENOISE,
                      total=transformer["hbm"]["total"]),
                 dict(name="vae", component="vae", kind=placement.DECODE, total=rows["vae"]["hbm"]["total"])])
    resident = placement.stage_peaks(stages, weights, set(enc), offload=False)
    offloaded = placement.stage_peaks(stages, weights, set(enc), offload=True)
    offload, reason = placement.decide(setting, resident, chip.hbm_bytes, host_memory=True)
    peaks = offloaded if offload else resident
    enc_bytes = sum(weights[n] for n in enc)
    bw = runtime.H2D_BYTES_PER_S.get(chip.name)
    load_ms = ms(enc_bytes / bw) if offload and bw else 0.0
    calls = {name: n for name, _, _, _, n in p["encoders"]}
    encode_ms = sum(calls[n] * r["estimate_ms"] for n, r in enc.items()) + (load_ms or 0.0)
    denoise_ms = p["steps"] * p["calls_per_step"] * transformer["estimate_ms"]
    decode_ms = rows["vae"]["estimate_ms"]
    share = (encode_ms + decode_ms) / denoise_ms
    return dict(mode=transformer["mode"], encoder_offload=dict(setting=setting, enabled=offload, reason=reason,
                                                               host_to_device_ms=load_ms, h2d_bytes_per_s=bw),
                peaks_resident=resident, peaks=peaks, fits=max(peaks.values()) <= chip.hbm_bytes,
                steps=p["steps"], calls_per_step=p["calls_per_step"], encode_ms=round(encode_ms, 3),
                denoise_ms=round(denoise_ms, 3), decode_ms=decode_ms, total_ms=round(encode_ms + denoise_ms + decode_ms, 3),
                encode_decode_share=round(share, 4), within_10_percent=share <= 0.10)


def print_plan(report: dict, out=None) -> None:
    out = out or sys.stdout
    print(f"prompt -> {report.get('output', 'image')} plan, ESTIMATES for {report['topology']} ({report['pipeline']}, "
          f"{report['height']}x{report['width']}, batch 1, bf16; HBM {report['chip']['hbm_bytes'] / GIB:.0f} GiB/chip)",
          file=out)
    print(f"{'stage':34} {'placement':10} {'weights GiB':>11} {'HBM GiB':>8} {'est ms':>9} {'raw ms':>9} {'x/image':>8}",
          file=out)
    for r in report["stages"]:
        if "error" in r:
            print(f"{r['stage']:34} {r.get('placement', '-'):10} ERROR: {r['error']}", file=out)
            continue
        mark = " *" if r.get("chosen") else ""
        print(f"{r['stage'] + mark:34} {r['placement']:10} {r['weights_per_chip'] / GIB:11.2f} "
              f"{r['hbm']['total'] / GIB:8.2f} {r['estimate_ms']:9.1f} {r['estimate_raw_ms']:9.1f} "
              f"{r['calls_per_image']:8d}", file=out)
    print("  * the default placement (the faster); HBM = the stage's program alone", file=out)
    for t in report["plans"]:
        o = t["encoder_offload"]
        peaks = ", ".join(f"{k} {v / GIB:.2f}" for k, v in t["peaks"].items())
        print(f"transformer {t['mode']}: encode {t['encode_ms']:.1f} ms + denoise {t['steps']} x {t['calls_per_step']} "
              f"calls = {t['denoise_ms']:.1f} ms + decode {t['decode_ms']:.1f} ms = {t['total_ms']:.1f} ms; "
              f"(encode + decode) / denoise = {100 * t['encode_decode_share']:.1f}% "
              f"({'within' if t['within_10_percent'] else 'OVER'} 10%)", file=out)
        print(f"  peak GiB/chip by stage (other parts resident): {peaks}; fits: {'yes' if t['fits'] else 'NO'}; "
              f"text encoders {'offloaded to host between prompts' if o['enabled'] else 'stay on the chips'} "
              f"({o['reason']})", file=out)


class Stages:
    """A plan's stages as they compile, in order (`rows`): each compiled by `fn(*fa)`, or taken
    from an earlier plan's JSON (`earlier`: stage name -> row, `reused_stages`); a failure is
    kept as the stage's `error` (and `failed`), so one stage that does not compile does not
    lose the others. `report(done)`: the plan JSON, rewritten to `json_path` after each stage,
    so a long run keeps what it compiled so far."""

    def __init__(self, topology: str, earlier: dict | None = None, json_path: str | None = None, report=None):
        self.topology, self.earlier, self.json_path, self.report = topology, earlier or {}, json_path, report
        self.rows, self.failed = [], False

    def __call__(self, name, calls, fn, *fa, reused=None) -> dict:
        reused = reused if reused is not None else self.earlier.get(name)
        if reused is not None:
            print(f"{name}: reused from {reused['source']}", file=sys.stderr, flush=True)
            r = dict(stage=name, calls_per_image=calls, **reused)
        else:
            print(f"compiling {name} for {self.topology} ...", file=sys.stderr, flush=True)
            try:
                r = dict(stage=name, calls_per_image=calls, **fn(*fa))
            except Exception as e:  # noqa: BLE001
                self.failed = True
                r = dict(stage=name, calls_per_image=calls, error=f"{type(e).__name__}: {str(e)[:400]}")
        self.rows.append(r)
        if self.json_path and self.report is not None:
            write_json(self.json_path, self.report(False))
        return r


def run_pipeline_plan(args) -> int:
    """Deviceless compiles of every stage of `args.pipeline` for `args.topology`."""
    from difflet_tpu.tools import deviceless

    try:
        devices, chip, calibration = deviceless.compile_target(args.topology)
    except ValueError as e:
        raise BenchError(str(e)) from None
    from difflet_tpu.bench import cases, compile_only
    from difflet_tpu.parallel.mesh import format_mesh, make_mesh
    from difflet_tpu.pipeline import denoise as PL
    p = pipelines()[args.pipeline]
    height, width = args.height or 1024, args.width or 1024
    mesh = make_mesh(len(devices), devices)
    rows = {}
    stage = Stages(args.topology)
    stages = stage.rows

    for name, config, seq, masked, calls in p["encoders"]:
        tp = stage(f"{name} ({seq} tokens) tp", calls, compile_encoder_tp, config, seq, masked, mesh, chip, calibration)
        options = [tp]
        if _layers(config) >= 24:  # the big encoders (T5-XXL, Qwen2.5-VL-7B): the other placement too
            options.append(stage(f"{name} ({seq} tokens) segments", calls, compile_encoder_segments, config, seq,
                                 devices, chip, calibration))
        ok = [r for r in options if "error" not in r]
        if ok:
            best = min(ok, key=lambda r: r["estimate_ms"])
            best["chosen"] = True
            rows[name] = best
    rows["vae"] = stage("vae decode", 1, compile_vae, p["vae"], height, width, mesh, chip, calibration)
    rows["vae"]["chosen"] = True
    spec, preset = PL.resolve_model(p["model"])
    cfg = cases.build_config(spec, preset)
    shape = dict(height=height, width=width, frames=1)
    axes = cases.mesh_axes_for(spec, cfg, len(devices), 1, None, False)
    tmesh = make_mesh(devices=devices, **axes)
    plans = []
    for variant in args.modes:
        name = f"transformer {variant} ({format_mesh(dict(tmesh.shape))})"
        args.offload = "off"  # one-expert models: nothing to offload
        r = stage(name, p["steps"] * p["calls_per_step"], lambda: _transformer(
            compile_only, spec, preset, cfg, shape, variant, tmesh, chip, calibration, args))
        if "error" not in r and all("error" not in rows.get(n, {"error": 1}) for n, *_ in p["encoders"]) \
                and "error" not in rows["vae"]:
            plans.append(plan_totals(rows, p, r, args.encoder_offload, chip))
    report = dict(kind="pipeline-plan", pipeline=args.pipeline, topology=args.topology, chip=chip.to_dict(),
                  height=height, width=width,
                  calibration=dict(calibration.as_dict(), band=list(calibration.band), source=calibration.source),
                  note="estimates from deviceless compiles, not measurements", stages=stages, plans=plans)
    print_plan(report)
    if args.json:
        write_json(args.json, report)
    return 1 if stage.failed else 0


def _transformer(compile_only, spec, preset, cfg, shape, variant, mesh, chip, calibration, args) -> dict:
    r = compile_only.compile_one(spec, preset, cfg, shape, variant, mesh, chip, calibration, args, 1)
    return dict(r, placement=variant, weights_per_chip=r["hbm"]["arguments"])
