"""`--compile-only --pipeline hunyuan_video | ltx2`: every stage of HunyuanVideo's and LTX-2's
prompt -> video (and sound) call compiled deviceless for a TPU topology, with HBM per chip, an
ESTIMATED time and the placement plan: the plan JSON of the image and Wan plans
(`pipeline_plan.py`, `video_plan.py`), on the same compile and pricing functions.

Stages (batch 1, bf16, the released sizes; models/*/pipeline.py):

* HunyuanVideoPipeline (720 x 1280 x 129, 50 steps): the Llama encoder (llava-llama-3-8b's
  text model) on the template's 95 + 256 tokens with the mask, run up to `hidden_states[-3]`
  (30 of its 32 layers), and CLIP-L (77 tokens); `true_cfg_scale` 1 (the default): one prompt,
  and ONE transformer call a step (guidance is embedded).
* LTX2Pipeline (its default 512 x 768 x 121, 30 steps, guidance 3; or `--guidance 1`): Gemma-3-12B
  on 1024 left-padded tokens with every hidden state kept, then LTX-2's text connectors; with
  guidance > 1 both prompts (two encoder calls, the connectors on both rows) and a call a step on
  the [uncond; cond] batch of 2, plus the modality-isolation call (`modality_scale` 3, the
  default: a batch-1 call, priced as a plain batch-1 call); `--guidance 1` plans
  `guidance_scale=1, stg_scale=0, modality_scale=1`: one batch-1 call a step. LTX-2.0 has no
  perturbed attention, so STG is off (the port refuses `stg_scale` > 0 for it).
  Decodes: the video VAE, then the audio VAE and the vocoder (summed as the decode stage).
* The video decode on one chip and spread over every chip of the mesh (`vae/spread.py`, the
  pipelines' default on a mesh: batch 1 does not split), the spread one summed (with
  `DIFFLET_TPU_VAE_SPREAD=off` only the one-chip decode, as the pipeline then runs); float32
  frames out (the "np" output; "pil" converts them to uint8 on the chips: not compiled here).
  LTX-2's audio VAE and vocoder stay replicated (one chip's work), as the pipeline runs them.

The text encoders are placed as `encoders/` places them (tp over the mesh); where the encoders
do not fit beside the transformer they wait in host memory between prompts and the move is
added to the encode stage (`plan_totals`, `placement.decide`), as in the image plans. Where an
encode or decode stage still does not fit beside the resident transformer (Gemma-3-12B + the
connectors beside LTX-2's 19B transformer; HunyuanVideo's 720p decode beside its transformer; on
16 GiB chips), a second plan stages the transformer through host memory outside the denoise
(`staged_transformer`: one copy of it back a video, added to the encode), as the pipelines'
runtime does (`Config.transformer_offload`); the first plan that fits is `chosen`.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from difflet_tpu.bench import pipeline_plan as PP
from difflet_tpu.bench.cases import BenchError
from difflet_tpu.bench.report import write_json

HUNYUAN_TEMPLATE_TOKENS = 95  # DEFAULT_PROMPT_TEMPLATE's crop_start (models/hunyuan_video/pipeline.py)
HUNYUAN_PROMPT_TOKENS = 256  # max_sequence_length
LTX2_TOKENS = 1024  # max_sequence_length


def _llama_3_8b():
    """hunyuanvideo-community/HunyuanVideo `text_encoder/config.json` (llava-llama-3-8b's LlamaModel)."""
    from difflet_tpu.encoders.decoder_lm import DecoderLMConfig

    return DecoderLMConfig.from_dict(dict(
        model_type="llama", vocab_size=128320, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192))


def _gemma_3_12b():
    """Lightricks/LTX-2 `text_encoder/config.json` (google/gemma-3-12b's text config)."""
    from difflet_tpu.encoders.decoder_lm import DecoderLMConfig

    return DecoderLMConfig.from_dict(dict(
        model_type="gemma3_text", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=1024, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072))


def presets():
    """pipeline -> preset -> the parts: encoders (name, config, tokens, masked, call kwargs),
    the VAE class and config, default shape, steps and guidance. "tiny": small configs of the
    same classes (tests: the CLI path in seconds)."""
    from difflet_tpu.encoders import clip
    from difflet_tpu.encoders.decoder_lm import DecoderLMConfig
    from difflet_tpu.vae import (AutoencoderKLHunyuanVideo, AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video,
                                 LTX2Vocoder)
    from difflet_tpu.vae.hunyuan_video import HunyuanVideoVAEConfig
    from difflet_tpu.vae.ltx2_audio import LTX2AudioVAEConfig
    from difflet_tpu.vae.ltx2_video import LTX2VideoVAEConfig
    from difflet_tpu.vae.ltx2_vocoder import LTX2VocoderConfig
    from difflet_tpu.models.ltx2.connectors import LTX2TextConnectorsConfig

    tiny_lm = DecoderLMConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=4)
    tiny_gemma = dataclasses.replace(tiny_lm, norm_offset=True, embed_scale=True, sandwich_norm=True, qk_norm=True,
                                     hidden_act="gelu_pytorch_tanh", head_dim=16, query_pre_attn_scalar=16.0,
                                     layer_types=("sliding_attention",) * 3 + ("full_attention",), sliding_window=8)
    tiny_clip = dataclasses.replace(clip.CLIP_VIT_L_14, vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4)
    hv = dict(steps=50, guidance=6.0, scale=(4, 8), vae=(AutoencoderKLHunyuanVideo, HunyuanVideoVAEConfig()),
              encoders=[("llama-3-8b", _llama_3_8b, HUNYUAN_TEMPLATE_TOKENS + HUNYUAN_PROMPT_TOKENS, True,
                         (("hidden_state", -3),)),
                        ("clip-l", lambda: clip.CLIP_VIT_L_14, 77, False, ())])
    ltx = dict(steps=30, guidance=3.0, scale=(8, 32), vae=(AutoencoderKLLTX2Video, LTX2VideoVAEConfig()),
               audio=((AutoencoderKLLTX2Audio, LTX2AudioVAEConfig()), (LTX2Vocoder, LTX2VocoderConfig())),
               connectors=LTX2TextConnectorsConfig(), fps=24.0,
               encoders=[("gemma-3-12b", _gemma_3_12b, LTX2_TOKENS, True, (("output_hidden_states", True),))])
    tiny_hv_vae = HunyuanVideoVAEConfig(latent_channels=4, block_out_channels=(8, 8, 8, 8), norm_num_groups=4)
    # tests/fixtures/vae/generate_ltx2.py's decoder (16x spatial, 4x temporal)
    tiny_ltx_vae = LTX2VideoVAEConfig(latent_channels=16, decoder_block_out_channels=(4, 4, 16),
                                      decoder_layers_per_block=(1, 1, 1, 1),
                                      upsample_type=("spatiotemporal", "spatial", "temporal"), upsample_factor=(2, 1, 2))
    tiny_audio = LTX2AudioVAEConfig(base_channels=8, ch_mult=(1, 2), num_res_blocks=1, latent_channels=2,
                                    mel_bins=16, output_channels=2)
    tiny_vocoder = LTX2VocoderConfig(in_channels=32, hidden_channels=16, upsample_kernel_sizes=(4, 4),
                                     upsample_factors=(2, 2), resnet_kernel_sizes=(3,), resnet_dilations=((1,),))
    tiny_connectors = LTX2TextConnectorsConfig(
        caption_channels=32, text_proj_in_factor=5, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8)
    return {
        "hunyuan_video": {
            "hunyuan-video": dict(hv, shape=(720, 1280, 129)),
            "tiny": dict(hv, shape=(32, 32, 5), vae=(AutoencoderKLHunyuanVideo, tiny_hv_vae),
                         encoders=[("llama-3-8b", lambda: tiny_lm, 24, True, (("hidden_state", -3),)),
                                   ("clip-l", lambda: tiny_clip, 77, False, ())]),
        },
        "ltx2": {
            "ltx-2.0": dict(ltx, shape=(512, 768, 121)),
            "tiny": dict(ltx, shape=(64, 64, 9), scale=(4, 16), vae=(AutoencoderKLLTX2Video, tiny_ltx_vae),
                         audio=((AutoencoderKLLTX2Audio, tiny_audio), (LTX2Vocoder, tiny_vocoder)),
                         connectors=tiny_connectors,
                         encoders=[("gemma-3-12b", lambda: tiny_gemma, 32, True, (("output_hidden_states", True),))]),
        },
    }


def resolve(pipeline: str, model: str | None):
    """(spec, preset, parts) for `--pipeline` and `--model` (None: the released preset)."""
    from difflet_tpu.pipeline import denoise as PL

    table = presets()[pipeline]
    released = next(iter(table))
    spec, preset = PL.resolve_model(model or f"{pipeline}:{released}")
    if spec.name != pipeline:
        raise BenchError(f"--pipeline {pipeline} plans a {pipeline} model (--model {pipeline}:<preset>), got {model!r}")
    preset = preset or released
    if preset not in table:
        raise BenchError(f"--pipeline {pipeline}: no plan for {preset!r}; choose one of: "
                         + ", ".join(f"{pipeline}:{m}" for m in table))
    return spec, preset, table[preset]


def compile_vae_method(cls, config, method: str, shape, dtype, devices, chip, calibration,
                       spread: bool = False) -> dict:
    """`model.<method>(x)` as `vae.loading.call_jitted` runs it (float32 out) on one chip, or
    (`spread`: a video decode) each video's rows spread over every chip of `devices` along the
    axis the VAE chooses (`vae/spread.py`), as benchmark/vae_spread.py compiles it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from difflet_tpu import runtime
    from difflet_tpu.vae import loading as VL

    t0 = time.perf_counter()
    model = nnx.eval_shape(lambda: cls(config, dtype=jnp.bfloat16))
    mesh = Mesh(np.array(devices if spread else devices[:1]), ("tp",))
    model.mesh = mesh
    graphdef, state = nnx.split(model)
    rep = NamedSharding(mesh, PartitionSpec())
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
    x = jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
    axis = model.spread_axis(shape, "on") if spread else None
    options = (("spread_axis", axis),) if spread else ()
    compiled = VL._apply_jit.trace(graphdef, state, method, x, options, False).lower().compile()
    out = jax.eval_shape(lambda s, x: VL._apply(graphdef, s, method, x, options)[0], state, x)
    return dict(PP._priced(compiled, chip, calibration, t0), placement=f"spread {axis}" if spread else "one chip",
                chips=mesh.size, input=list(shape), output=list(out.shape),
                weights_per_chip=runtime.tree_bytes_per_device(state))


def compile_connectors(config, seq: int, batch: int, mesh, chip, calibration) -> dict:
    """LTX-2's text connectors (parameters replicated on the encoder's mesh, connectors.py) on the
    stacked Gemma-3 hidden states of `batch` prompts."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from difflet_tpu import runtime
    from difflet_tpu.models.ltx2 import connectors

    t0 = time.perf_counter()
    model = nnx.eval_shape(lambda: connectors.build(config, dtype=jnp.bfloat16))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: PP._sds(x.shape, x.dtype, mesh), state)
    hidden = PP._sds((batch, seq, config.caption_channels * config.text_proj_in_factor), jnp.bfloat16, mesh)
    mask = PP._sds((batch, seq), jnp.int32, mesh)
    fn = jax.jit(lambda s, h, m: connectors._forward(nnx.merge(graphdef, s), h, m, "left"))
    compiled = fn.trace(state, hidden, mask).lower().compile()
    return dict(PP._priced(compiled, chip, calibration, t0), placement="replicated",
                weights_per_chip=runtime.tree_bytes_per_device(state))


def compile_encoder_stream(config, seq: int, mesh, chip, calibration) -> dict:
    """One group of a decoder LM's layers as `encoders/streaming.py` runs it when the LM streams
    from host memory (`Config.encoder_stream`): the group's parameters tp-sharded on `mesh` (as
    they are copied in), the hidden states and the layers' (mask, cos, sin) replicated, batch 1
    (the pipelines encode each prompt alone). The row also carries what the plan adds: the number
    of groups, the layers' bytes per chip (copied from host memory at every encode) and the hidden
    states an encode keeps on the chips (every layer's, for LTX-2)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from difflet_tpu import encoders, runtime
    from difflet_tpu.encoders import decoder_lm, streaming

    t0 = time.perf_counter()
    model = encoders.abstract(config, jnp.bfloat16, mesh)
    group = streaming.default_group(model)
    n = config.num_hidden_layers
    graphdef, state = nnx.split(nnx.List(model.layers[:group]))
    hidden = PP._sds((1, seq, config.hidden_size), jnp.bfloat16, mesh)
    mask = PP._sds((1, seq), jnp.int32, mesh)
    kinds = jax.eval_shape(lambda m: decoder_lm.layer_inputs(config, 1, seq, jnp.bfloat16, m, None, n), mask)
    kinds = jax.tree.map(lambda x: PP._sds(x.shape, x.dtype, mesh), kinds)
    sliding = tuple(config.sliding(i) for i in range(group))
    compiled = streaming._group_forward.trace(graphdef, state, hidden, kinds, sliding).lower().compile()
    return dict(PP._priced(compiled, chip, calibration, t0), placement=f"tp, {group} layers a group",
                weights_per_chip=runtime.tree_bytes_per_device(state), group=group, groups=-(-n // group),
                layers_bytes_per_chip=runtime.tree_bytes_per_device(nnx.state(model.layers, nnx.Param)),
                states_bytes=(n + 1) * seq * config.hidden_size * 2)


def streamed_encoder(plan: dict, rows: dict, p: dict, step: dict, chip, lm: str, stream: dict, reason: str) -> dict:
    """`plan` with the decoder LM `lm` streaming its layers from host memory during its encode
    instead (`compile_encoder_stream`'s row `stream`), as the pipelines' runtime does it first when
    the parts do not fit together (`Config.encoder_stream`): the LM's layers and embedding never
    stay on the chips; every encode runs the groups one after the other and copies the layers once
    from host memory at `runtime.H2D_BYTES_PER_S` (an assumption; the copies are not overlapped
    with the groups' compute here, as the runtime runs them); the other parts stay resident, but
    for a decode that does not fit beside them (then the other encoders leave for it, and the
    transformer too if that is not enough; their copies back are added to the encode)."""
    from difflet_tpu import runtime
    from difflet_tpu.bench.report import ms
    from difflet_tpu.pipeline import placement

    others = [n for n, *_ in p["encoders"] if n != lm]
    w = {n: rows[n]["weights_per_chip"] for n in others}
    tw, vae_w = step["hbm"]["arguments"], rows["vae"]["weights_per_chip"]
    rest = sum(w.values())
    peaks = {lm: stream["hbm"]["total"] + stream["states_bytes"] + rest + tw + vae_w}
    peaks.update({n: rows[n]["hbm"]["total"] + rest - w[n] + tw + vae_w for n in others})
    peaks["transformer"] = step["hbm"]["total"] + rest + vae_w
    peaks["vae"] = rows["vae"]["hbm"]["total"] + tw + rest
    # a decode that does not fit gets room as the runtime's `with_room` makes it: the other
    # encoders out (back at the next encode), and if that is not enough the transformer too
    room, moved = [], 0
    if peaks["vae"] > chip.hbm_bytes and rest:
        room, moved, peaks["vae"] = ["encoders"], rest, peaks["vae"] - rest
    if peaks["vae"] > chip.hbm_bytes:
        room, moved, peaks["vae"] = room + ["transformer"], moved + tw, peaks["vae"] - tw
    calls = {name: n for name, _, _, _, n in p["encoders"]}
    bw = runtime.H2D_BYTES_PER_S.get(chip.name)
    copy_ms = ms(calls[lm] * stream["layers_bytes_per_chip"] / bw) if bw else None
    room_ms = ms(moved / bw) if bw and moved else 0.0
    encode_ms = (calls[lm] * stream["groups"] * stream["estimate_ms"] + (copy_ms or 0.0) + room_ms
                 + sum(calls[n] * rows[n]["estimate_ms"] for n in others))
    _, offload_reason = placement.decide("auto", {"transformer": peaks["transformer"]}, chip.hbm_bytes, True)
    t = dict(plan, peaks=peaks, fits=max(peaks.values()) <= chip.hbm_bytes,
             encoder_offload=dict(plan["encoder_offload"], enabled=False, host_to_device_ms=0.0,
                                  reason=f"{offload_reason} (the other encoders beside the transformer's step)"),
             encoder_stream=dict(enabled=True, reason=reason, encoder=lm, group=stream["group"],
                                 groups=stream["groups"], layers_bytes_per_chip=stream["layers_bytes_per_chip"],
                                 copies=calls[lm], host_to_device_ms=copy_ms, h2d_bytes_per_s=bw),
             decode_room=dict(moved=room, bytes_per_chip=moved, host_to_device_ms=room_ms),
             transformer_staged="transformer" in room,
             encode_ms=round(encode_ms, 3))
    return _with_totals(t)


def _with_totals(t: dict) -> dict:
    """`t` with its total and (encode + decode) / denoise share from its stage times."""
    share = (t["encode_ms"] + t["decode_ms"]) / t["denoise_ms"]
    return dict(t, total_ms=round(t["encode_ms"] + t["denoise_ms"] + t["decode_ms"], 3),
                encode_decode_share=round(share, 4), within_10_percent=share <= 0.10)


def combined(rows: list[dict], counts: list[int], name: str, shared: bool = False) -> dict:
    """Stages that run one after another as one row: time sum(count x estimate); HBM the largest
    program plus the other parts' weights (all resident); weights the sum. `shared`: programs of
    one model (the transformer's calls at two batch sizes), so its weights count once."""
    weights = (max if shared else sum)(r["weights_per_chip"] for r in rows)
    total = max(r["hbm"]["total"] + (0 if shared else weights - r["weights_per_chip"]) for r in rows)
    args = max(r["hbm"]["arguments"] for r in rows)
    est = sum(n * r["estimate_ms"] for r, n in zip(rows, counts))
    raw = sum(n * r["estimate_raw_ms"] for r, n in zip(rows, counts))
    return dict(stage=name, hbm=dict(total=total, arguments=args), weights_per_chip=weights, estimate_ms=round(est, 3),
                estimate_raw_ms=round(raw, 3), parts=[r["stage"] for r in rows], counts=counts)


def staged_transformer(plan: dict, rows: dict, p: dict, step: dict, chip) -> dict:
    """`plan` (text encoders in host memory between prompts, `plan_totals`) with the transformer
    ALSO staged through host memory outside the denoise, as the pipelines' runtime does it
    (`Config.transformer_offload`): dropped from HBM for the encode and the decode (the host
    keeps its parameters) and copied back after the next encode, one host-to-device copy of its
    parameters a video at `runtime.H2D_BYTES_PER_S` (an assumption), added to the encode. For
    when an encode or decode stage does not fit beside the resident transformer."""
    from difflet_tpu import runtime
    from difflet_tpu.bench.report import ms

    enc = [n for n, *_ in p["encoders"]]
    w = {n: rows[n]["weights_per_chip"] for n in enc}
    vae_w = rows["vae"]["weights_per_chip"]
    peaks = {n: rows[n]["hbm"]["total"] + sum(w[m] for m in enc if m != n) + vae_w for n in enc}
    peaks["transformer"] = step["hbm"]["total"] + vae_w
    peaks["vae"] = rows["vae"]["hbm"]["total"]
    bw = runtime.H2D_BYTES_PER_S.get(chip.name)
    move = ms(step["hbm"]["arguments"] / bw) if bw else None
    t = dict(plan, peaks=peaks, fits=max(peaks.values()) <= chip.hbm_bytes, transformer_staged=True,
             transformer_move_ms=move, transformer_bytes_per_chip=step["hbm"]["arguments"])
    if move:
        t["encode_ms"] = round(plan["encode_ms"] + move, 3)
        t = _with_totals(t)
    return t


def _is_decoder_lm(config) -> bool:
    from difflet_tpu.encoders.decoder_lm import DecoderLMConfig

    return isinstance(config, DecoderLMConfig)


def _transformer(compile_only, spec, preset, cfg, shape, variant, mesh, chip, calibration, args, batch) -> dict:
    r = compile_only.compile_one(spec, preset, cfg, shape, variant, mesh, chip, calibration, args, batch)
    return dict(r, placement=variant, weights_per_chip=r["hbm"]["arguments"])


def run_av_plan(args) -> int:
    """Deviceless compiles of every stage of a HunyuanVideo / LTX-2 call for `args.topology`."""
    from difflet_tpu.tools import deviceless

    try:
        devices, chip, calibration = deviceless.compile_target(args.topology)
    except ValueError as e:
        raise BenchError(str(e)) from None
    from difflet_tpu.bench import cases, compile_only
    from difflet_tpu.parallel.mesh import format_mesh, make_mesh
    from difflet_tpu.pipeline import placement

    pipeline = args.pipeline
    spec, preset, parts = resolve(pipeline, args.model[0] if args.model else None)
    default = parts["shape"]
    height, width, frames = args.height or default[0], args.width or default[1], args.frames or default[2]
    ft, fs = parts["scale"]
    for name, v in (("height", height), ("width", width)):
        if v % fs:
            raise BenchError(f"--{name} {v}: must be a multiple of {fs} for {pipeline} (the VAE's {fs}x)")
    if (frames - 1) % ft:
        raise BenchError(f"--frames {frames}: must be 1 + {ft}k (the VAE's {ft}x temporal compression)")
    steps = args.steps or parts["steps"]
    guidance = parts["guidance"] if args.guidance is None else args.guidance
    cfg_rows = pipeline == "ltx2" and guidance > 1.0  # HunyuanVideo: embedded guidance (true_cfg_scale 1)
    prompts = 2 if cfg_rows else 1
    mesh = make_mesh(len(devices), devices)
    plans = []
    from difflet_tpu.bench.video_plan import reused_stages

    earlier = (reused_stages(args.reuse_stages, f"{pipeline}:{preset}", args.topology, height, width, frames, pipeline)
               if args.reuse_stages else {})

    def report(done: bool) -> dict:
        r = dict(kind="pipeline-plan", pipeline=pipeline, model=f"{pipeline}:{preset}", topology=args.topology,
                 chip=chip.to_dict(), height=height, width=width, frames=frames, steps=steps, guidance=guidance,
                 batch=1, calibration=dict(calibration.as_dict(), band=list(calibration.band),
                                           source=calibration.source),
                 note="estimates from deviceless compiles, not measurements", stages=stages, plans=plans)
        chosen = [t for t in plans if t.get("chosen")]
        if chosen:  # the request's estimate: the plan the runtime runs, in the fastest mode planned
            best = min(chosen, key=lambda t: t["total_ms"])
            r.update(total_ms=best["total_ms"], total_mode=best["mode"])
        if pipeline == "ltx2":
            r["call"] = (dict(guidance_scale=guidance, stg_scale=0.0, modality_scale=3.0) if cfg_rows else
                         dict(guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0))
        return r if done else dict(r, incomplete="written after each stage; the plan follows the last one")

    stage = PP.Stages(args.topology, earlier, args.json, report)
    stages = stage.rows

    rows, encoders = {}, []
    for name, config, seq, masked, kwargs in parts["encoders"]:
        r = stage(f"{name} ({seq} tokens) tp", prompts, PP.compile_encoder_tp, config(), seq, masked, mesh, chip,
                  calibration, kwargs)
        r["chosen"] = True
        rows[name] = r
        encoders.append((name, None, seq, masked, prompts))
    if "connectors" in parts:
        r = stage(f"ltx2 connectors (batch {prompts})", 1, compile_connectors, parts["connectors"],
                  parts["encoders"][0][2], prompts, mesh, chip, calibration)
        r["chosen"] = True
        rows["connectors"] = r
        encoders.append(("connectors", None, 0, False, 1))

    cfg = cases.build_config(spec, preset)
    shape = dict(height=height, width=width, frames=frames)
    # (batch, calls a step): LTX-2 with guidance: the CFG pair, then the modality-isolation call
    calls = [(2, 1), (1, 1)] if cfg_rows else [(1, 1)]
    axes = cases.mesh_axes_for(spec, cfg, len(devices), 1, None, False)
    tmesh = make_mesh(devices=devices, **axes)
    steps_rows = []
    for variant in args.modes:
        args.offload = "off"
        got = [stage(f"transformer {variant} batch {b} ({format_mesh(dict(tmesh.shape))})", steps * n, _transformer,
                     compile_only, spec, preset, cfg, shape, variant, tmesh, chip, calibration, args, b)
               for b, n in calls]
        steps_rows.append(got)

    import jax.numpy as jnp

    cls, vconfig = parts["vae"]
    latents = (1, vconfig.latent_channels, (frames - 1) // ft + 1, height // fs, width // fs)
    one = stage("vae decode_video, one chip", 1, compile_vae_method, cls, vconfig, "decode_video_latents", latents,
                jnp.bfloat16, devices, chip, calibration)
    video = one
    from difflet_tpu.config import Config

    # DIFFLET_TPU_VAE_SPREAD=off: the pipeline decodes on one chip, so the plan compiles only that
    if len(devices) > 1 and Config.from_env().vae_spread != "off":
        spread = stage(f"vae decode_video, spread over {len(devices)}", 1, compile_vae_method, cls, vconfig,
                       "decode_video_latents", latents, jnp.bfloat16, devices, chip, calibration, True)
        video = spread if "error" not in spread else one
    decodes = [video]
    if "audio" in parts:
        (acls, aconfig), (vcls, voconfig) = parts["audio"]
        length = round(frames / parts["fps"] * aconfig.sample_rate / aconfig.mel_hop_length / 4)
        packed = (1, length, aconfig.base_channels)  # [B, L, latent_channels x mel_bins / 4], latents_mean's size
        audio = stage("audio vae decode, one chip", 1, compile_vae_method, acls, aconfig, "unpack_and_decode", packed,
                      jnp.float32, devices, chip, calibration)
        decodes.append(audio)
        if "error" not in audio:
            decodes.append(stage("vocoder, one chip", 1, compile_vae_method, vcls, voconfig, "__call__",
                                 tuple(audio["output"]), jnp.float32, devices, chip, calibration))
    if all("error" not in r for r in decodes):
        rows["vae"] = combined(decodes, [1] * len(decodes), "decode") if len(decodes) > 1 else decodes[0]
        for r in decodes:
            r["chosen"] = True
    p = dict(model=f"{pipeline}:{preset}", steps=steps, calls_per_step=1, encoders=encoders)
    if "vae" in rows and all("error" not in rows.get(n, {"error": 1}) for n, *_ in encoders):
        # the decoder-LM text encoder that may stream, and its one streamed program (every transformer variant's)
        lm_entry = next((e for e in parts["encoders"] if _is_decoder_lm(e[1]())), None)
        stream = None
        for got in steps_rows:
            if any("error" in r for r in got):
                continue
            step = combined(got, [n for _, n in calls], "transformer", shared=True) if len(got) > 1 else got[0]
            step["mode"] = got[0]["mode"]
            t = dict(PP.plan_totals(rows, p, step, args.encoder_offload, chip), transformer_staged=False,
                     calls=[dict(batch=b, per_step=n) for b, n in calls])
            mine = [t]
            # the runtime's order: a decoder LM that does not fit with every part streams its layers
            # (decided at load, placement.PlacementMixin._start_stream); the transformer is staged at
            # the first encode only if that does not do
            parts_bytes = (sum(rows[n]["weights_per_chip"] for n, *_ in p["encoders"]) + step["hbm"]["arguments"]
                           + rows["vae"]["weights_per_chip"])
            streams, why = placement.decide_staging(args.encoder_stream, parts_bytes, chip.hbm_bytes, True,
                                                    "encoder stream")
            if lm_entry is not None and streams:
                lm, config, seq, *_ = lm_entry
                if stream is None:
                    stream = stage(f"{lm} streamed ({seq} tokens) tp", prompts, compile_encoder_stream, config(), seq,
                                   mesh, chip, calibration)
                if "error" not in stream:
                    mine.append(streamed_encoder(t, rows, p, step, chip, lm, stream, why))
            if not mine[-1]["fits"] and t["encoder_offload"]["enabled"]:  # the encode beside the transformer is over
                mine.append(staged_transformer(t, rows, p, step, chip))
            plans.extend(mine)
            # the runtime runs the streamed plan whenever it decided to stream; the resident one is for comparison
            fitting = [x for x in (mine[1:] if len(mine) > 1 and "encoder_stream" in mine[1] else mine) if x["fits"]]
            (fitting[0] if fitting else t)["chosen"] = True
    PP.print_plan(dict(report(True), output="video", height=f"{height}x{width}", width=f"{frames} frames"))
    for t in plans:
        if "encoder_stream" in t:
            e = t["encoder_stream"]
            print(f"  {t['mode']} with {e['encoder']}'s layers streamed from host memory ({e['groups']} groups of "
                  f"{e['group']}){' (chosen)' if t.get('chosen') else ''}: fits {'yes' if t['fits'] else 'NO'}, "
                  f"+{e['host_to_device_ms']} ms copying {e['copies']} x {e['layers_bytes_per_chip'] / 2**30:.2f} "
                  f"GiB/chip" + (f"; {' and '.join(t['decode_room']['moved'])} out for the decode, "
                                 f"+{t['decode_room']['host_to_device_ms']} ms back" if t["decode_room"]["moved"]
                                 else ""), file=sys.stdout)
        elif t["transformer_staged"]:
            print(f"  {t['mode']} with the transformer staged through host memory outside the denoise"
                  f"{' (chosen)' if t.get('chosen') else ''}: fits {'yes' if t['fits'] else 'NO'}, "
                  f"+{t['transformer_move_ms']} ms a video", file=sys.stdout)
    if args.json:
        write_json(args.json, report(True))
    return 1 if stage.failed else 0
