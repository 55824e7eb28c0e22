"""Where a pipeline's parts live between stages: text encoders on the chips or in host memory
(`Config.encoder_offload`), the transformer staged through host memory during the encode
(`Config.transformer_offload`).

The text encoders, the transformer and the VAE share the chips. Every part's parameters stay
on the devices unless the plan says they do not fit together; then the text encoders go to
host memory (`runtime.HOST_MEMORY_KIND`, same shardings) after the prompts are encoded and
come back before the next encode. Where the encoders do not fit beside the transformer even for
the encode (LTX-2's Gemma-3-12B on a v5e-4), a decoder-LM encoder keeps its layers in host memory
and streams them through the devices during its encode (`Config.encoder_stream`,
`encoders/streaming.py`; decided at load); where that is not enough, the transformer waits in
host memory while they run (`decide_staging`). A decode that runs out of memory gets room made
(`with_room`). The VAE stays.

The plan is plain arithmetic over bytes per chip (`stage_peaks`, `decide`): a stage's peak
is its compiled program's memory (its own weights, inputs, outputs, temporaries, code) plus
the parameters of every other part resident during it. The bench's `--pipeline` plan
(difflet_tpu.bench.pipeline_plan) feeds it deviceless compiles; a pipeline on a TPU feeds it
its devices' memory limit and its transformer's compiled step (`EncoderHome.decide_auto`).
"""

from __future__ import annotations

import gc
import logging
import time

import jax
from flax import nnx

from difflet_tpu.arguments import ArgumentError as PipelineError

logger = logging.getLogger(__name__)

ENCODE, DENOISE, DECODE = "encode", "denoise", "decode"
ENCODE_MARGIN = 1 << 30  # the encode's activations beside every part's parameters (`decide_staging`)


def stage_peaks(stages: list[dict], weights: dict, encoders: set, offload: bool) -> dict:
    """Peak bytes per chip of each stage.

    stages: [{"name", "component", "kind" (ENCODE / DENOISE / DECODE), "total"}] with `total`
    the stage's compiled memory (its own component's weights included); weights: {component:
    parameter bytes per chip}; encoders: the text encoders' component names. With `offload` the
    encoders are resident only during encode stages (all of them then: they are loaded together)."""
    peaks = {}
    for s in stages:
        resident = [c for c in weights if c != s["component"] and (not offload or c not in encoders
                                                                    or s["kind"] == ENCODE)]
        peaks[s["name"]] = s["total"] + sum(weights[c] for c in resident)
    return peaks


def decide(setting: str, peaks_resident: dict, capacity: int | None, host_memory: bool,
           what: str = "encoder offload") -> tuple[bool, str]:
    """(offload the text encoders?, why). "on" / "off" as given ("on" needs host memory); "auto":
    offload when some stage's peak with every part resident exceeds `capacity` (None: no limit
    known, nothing is moved)."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"{what} {setting!r}: use one of auto, on, off")
    if setting == "on" and not host_memory:
        raise ValueError(f"{what} 'on': these devices have no host memory kind to offload to "
                         "(use auto or off)")
    if setting != "auto":
        return setting == "on", setting
    if capacity is None or not host_memory:
        return False, "auto: no device memory limit or host memory kind known"
    worst = max(peaks_resident, key=peaks_resident.get)
    need = peaks_resident[worst]
    fits = need <= capacity
    return not fits, (f"auto: with every part resident the {worst} stage needs {need / 2**30:.2f} GiB per chip, "
                      f"{'within' if fits else 'over'} the {capacity / 2**30:.2f} GiB limit")


def decide_staging(setting: str, parts_bytes: int, capacity: int | None, host_memory: bool,
                   what: str = "transformer offload") -> tuple[bool, str]:
    """(stage the transformer through host memory during the text encode?, why): `decide` for
    the encode stage, whose peak is taken as every part's parameters per chip (`parts_bytes`:
    encoders, resident transformer, VAEs) plus `ENCODE_MARGIN` (the text encoders' activations
    are small beside their weights; the bench's plan compiles them, `bench/av_plan.py`). The
    same test decides whether a decoder-LM text encoder streams its layers (`what` "encoder
    stream", `Config.encoder_stream`), which is asked first."""
    return decide(setting, {ENCODE: parts_bytes + ENCODE_MARGIN}, capacity, host_memory, what)


def lm_load_kind(setting: str, mesh) -> str | None:
    """Where a pipeline loads a decoder-LM text encoder that may stream (`Config.encoder_stream`):
    host memory when it could stream on these devices ("on", or "auto" where the devices report a
    memory limit: TPU), so it never needs its whole size on the chips while the other parts load
    (LTX-2's Gemma-3-12B beside its transformer on a v5e-4); None (the devices) otherwise. The
    decision itself follows at load's end (`PlacementMixin.init_encoder_home`)."""
    from difflet_tpu import runtime

    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    kind = runtime.host_memory_kind(devices)
    if setting == "off" or kind is None or (setting == "auto" and runtime.device_memory_limit(devices) is None):
        return None
    return kind


def _params(model):
    return nnx.state(model, nnx.Param)


def bytes_per_chip(model) -> int:
    """Parameter bytes of `model` on one chip (each leaf's shard)."""
    from difflet_tpu import runtime

    return runtime.tree_bytes_per_device(_params(model))


class EncoderHome:
    """Moves the text encoders' parameters between the devices and host memory.

    `offload()` copies them to host memory once (kept: the weights never change) and drops the
    device arrays; `load()` puts them back with the shardings the encode was compiled for (no
    recompilation). The pipeline holds the only references to the encoders, so dropping the
    device arrays frees their memory."""

    def __init__(self, encoders: list, devices: list | None = None):
        self.encoders = list(encoders)
        self._devices = list(devices or [])  # where the pipeline's encoders were (a home left empty by a stream)
        self._host = None
        self._shardings = None
        self.offloaded = False

    def devices(self) -> list:
        return sorted({d for m in self.encoders for x in jax.tree.leaves(_params(m)) for d in x.sharding.device_set},
                      key=lambda d: d.id) or self._devices

    def bytes_per_chip(self) -> int:
        return sum(bytes_per_chip(m) for m in self.encoders)

    def offload(self) -> None:
        from difflet_tpu import runtime

        if self.offloaded:
            return
        if self._host is None:
            kind = runtime.host_memory_kind(self.devices())
            if kind is None:
                raise ValueError(f"the {self.devices()[0].platform} devices have no {runtime.HOST_MEMORY_KIND} "
                                 f"memory to offload the text encoders to (set DIFFLET_TPU_ENCODER_OFFLOAD=off)")
            states = [_params(m) for m in self.encoders]
            self._shardings = [jax.tree.map(lambda x: x.sharding, s) for s in states]
            self._host = jax.block_until_ready(
                [jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), s) for s in states])
        for m, host in zip(self.encoders, self._host):
            nnx.update(m, host)
        self.offloaded = True
        gc.collect()  # nnx graphs hold reference cycles: free the dropped device arrays now

    def load(self) -> None:
        if not self.offloaded:
            return
        for m, host, shardings in zip(self.encoders, self._host, self._shardings):
            nnx.update(m, jax.block_until_ready(jax.tree.map(jax.device_put, host, shardings)))
        self.offloaded = False

    def memory_kinds(self) -> set:
        return {x.sharding.memory_kind for m in self.encoders for x in jax.tree.leaves(_params(m))}

    def decide_auto(self, setting: str, transformer, step_kwargs: dict, vae) -> tuple[bool, str]:
        """`decide` for a pipeline on its devices: the denoise stage's peak with every part
        resident = the transformer's compiled step (`Runner.memory`) + the encoders' and the
        VAE's parameters per chip, against the devices' memory limit (none on CPU: "auto"
        keeps everything where it is)."""
        from difflet_tpu import runtime

        devices = self.devices()
        host = runtime.host_memory_kind(devices) is not None
        limit = runtime.device_memory_limit(devices)
        if setting != "auto" or limit is None or not host:
            return decide(setting, {DENOISE: 0}, limit, host)
        step = transformer.memory(**step_kwargs)["total"]
        peak = step + self.bytes_per_chip() + bytes_per_chip(vae)
        return decide(setting, {DENOISE: peak}, limit, host)


class ExpertHome:
    """Where the idle expert of a two-expert pipeline (Wan2.2-A14B) lives: "auto" / "on" /
    "off" (`Config.expert_offload`).

    When on, only the expert the step needs is on the devices: the first step moves the others
    to host memory (`Runner.offload`), and each expert switch drops the outgoing expert's device
    arrays and copies the incoming one's from host memory (`Runner.load`), recorded in `swaps`.
    "auto" offloads when the devices report a memory limit and the step's compiled program plus
    the other experts' parameters per device exceed it. For the device memory to be freed the
    Runners must hold the only references to their parameters. With one expert it is a no-op.
    Used by the bench's `Denoiser` and the Wan pipelines."""

    def __init__(self, runners: list, setting: str):
        from difflet_tpu.config import OFFLOAD_VALUES

        if setting not in OFFLOAD_VALUES:
            raise ValueError(f"offload={setting!r}: use one of {', '.join(OFFLOAD_VALUES)}")
        self.runners = list(runners)
        self.setting = setting
        self.offload = None if len(self.runners) > 1 else False  # decided at the first step
        self.active = None  # the expert on the devices while offloading
        self.swaps = []     # one dict per expert switch: step, src, dst, s (seconds, the waited copy)
        self.placement_s = 0.0  # the first move of the idle experts to host memory
        self.reason = "one expert" if len(self.runners) == 1 else "off" if setting == "off" else None
        if setting == "on" and len(self.runners) > 1:  # refused before any work
            from difflet_tpu import runtime

            if runtime.host_memory_kind(self.devices()) is None:
                raise ValueError(f"offload='on': the {self.devices()[0].platform} devices have no "
                                 f"{runtime.HOST_MEMORY_KIND} memory (use offload='off' or 'auto')")

    def devices(self) -> list:
        mesh = getattr(self.runners[0], "mesh", None)
        return list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]

    def decide(self, e: int, kw: dict) -> bool:
        from difflet_tpu import runtime

        if self.setting != "auto":
            self.reason = self.setting
            return self.setting == "on"
        devices = self.devices()
        limit = runtime.device_memory_limit(devices)
        if limit is None or runtime.host_memory_kind(devices) is None:
            self.reason = "auto: no device memory limit or host memory kind"
            return False
        step = self.runners[e].memory(**kw)["total"]
        others = sum(r.param_bytes() for i, r in enumerate(self.runners) if i != e)
        need = step + others
        fits = need <= limit
        self.reason = (f"auto: {need / 2**30:.2f} GiB per device with every expert resident "
                       f"{'fits' if fits else 'exceeds'} the {limit / 2**30:.2f} GiB limit")
        return not fits

    def activate(self, e: int, kw: dict, step: int | None = None) -> float:
        """Makes expert `e` the one on the devices when offloading (deciding "auto" on the first
        call, from the step's arguments `kw`); returns the seconds spent switching (0 without)."""
        import time

        if len(self.runners) == 1:
            return 0.0
        if self.offload is None:
            self.offload = self.decide(e, kw)
            # the initial placement, not a switch (a runner may come offloaded already)
            t0 = time.perf_counter()
            for i, r in enumerate(self.runners):
                if self.offload and i != e:
                    r.offload()
                elif getattr(r, "resident", "device") == "host":
                    r.load()
            self.active = e
            self.placement_s = time.perf_counter() - t0
            return self.placement_s
        if not self.offload or self.active == e:
            return 0.0
        t0 = time.perf_counter()
        self.runners[self.active].offload()  # drops the device arrays first: one expert's worth at a time
        self.runners[e].load()
        dt = time.perf_counter() - t0
        self.swaps.append(dict(step=step, src=self.active, dst=e, s=dt))
        self.active = e
        return dt


class PlacementMixin:
    """`DiffusionPipeline`'s homes for its parts: the experts (`ExpertHome`), the text encoders
    between prompts (`EncoderHome`) or streamed (`text_encoder_for`), and the transformer outside
    the denoise (`decide_staging`, `with_room`).
    The pipeline sets `self.transformer` (a Runner; `self.experts` for two), `self.vae` and
    `self.timings` (`diffusion.Timings`) and lists its Runners (`_runners`)."""

    # ---- the experts' home (two-expert pipelines: Config.expert_offload) ----------

    def init_expert_home(self, config) -> None:
        self.expert_home = ExpertHome(self._runners(), config.expert_offload)

    def activate_expert(self, e: int, step_kwargs: dict, step: int) -> None:
        """Expert `e` on the devices for this step (a no-op with one expert or no offload)."""
        start = time.perf_counter()
        if self.expert_home.activate(e, step_kwargs, step):
            self.timings.expert_moves += time.perf_counter() - start

    # ---- the text encoders' home between prompts (Config.encoder_offload) ------

    def init_encoder_home(self, encoders: list, config, stream=None) -> None:
        """The encoders `encoders_out` may move to host memory; `stream`: the one of them (a
        decoder LM) whose layers may instead stream from host memory during its encode
        (`Config.encoder_stream`; the pipeline encodes with `text_encoder_for(model)`). "on"
        without a host memory kind is refused here, at load."""
        from difflet_tpu import runtime

        self.encoder_home = EncoderHome(encoders)
        self._streamable = stream
        self.encoder_stream_setting = config.encoder_stream
        self.encoder_stream = False
        self.encoder_stream_reason = "no decoder-LM text encoder to stream"
        self.text_stream = None  # the LayerStream when streaming
        self.encoder_offload_setting = config.encoder_offload
        self.encoder_offload = None  # decided at the first call
        self.encoder_offload_reason = None
        self.transformer_offload_setting = config.transformer_offload
        self.transformer_offload = None  # decided at the first encode
        self.transformer_offload_reason = None
        self._staged = []  # the transformer Runners waiting in host memory until the next encode is done
        self._room_for = {}  # stage -> the room it needed after running out of device memory (`with_room`)
        devices = self.encoder_home.devices()
        for name, setting in (("encoder_offload", config.encoder_offload),
                              ("transformer_offload", config.transformer_offload),
                              ("encoder_stream", config.encoder_stream if stream is not None else "off")):
            if setting == "on" and runtime.host_memory_kind(devices) is None:
                raise PipelineError(f"{name}='on' (DIFFLET_TPU_{name.upper()}): the {devices[0].platform} "
                                    f"devices have no {runtime.HOST_MEMORY_KIND} memory; use auto or off")
        if stream is not None:
            self._start_stream()

    def stage_parts_bytes(self) -> int:
        """Parameter bytes per device of every part resident at an encode: the text encoders,
        the transformer(s) on the devices and the VAEs (`decide_staging`)."""
        runners = [r for r in self._runners() if r.resident == "device"]
        others = [getattr(self, n, None) for n in ("vae", "audio_vae", "vocoder")]
        return (self.encoder_home.bytes_per_chip() + sum(r.param_bytes() for r in runners)
                + sum(bytes_per_chip(m) for m in others if m is not None))

    def encoders_in(self) -> None:
        """The encoders back on the devices before an encode (a no-op when they are there), the
        transformer first to host memory when it is staged (`Config.transformer_offload`)."""
        from difflet_tpu import runtime

        if self.transformer_offload is None:
            devices = self.encoder_home.devices()
            self.transformer_offload, self.transformer_offload_reason = decide_staging(
                self.transformer_offload_setting, self.stage_parts_bytes(), runtime.device_memory_limit(devices),
                runtime.host_memory_kind(devices) is not None)
            logger.info("transformer %s during the text encode (%s)", "staged through host memory"
                        if self.transformer_offload else "stays on the devices", self.transformer_offload_reason)
        if self.transformer_offload:
            self._stage_transformer()
        if self.encoder_home.offloaded:
            start = time.perf_counter()
            self.encoder_home.load()
            self.timings.encoder_moves += time.perf_counter() - start

    def _start_stream(self) -> None:
        """Decides `Config.encoder_stream` at load's end (the test `decide_staging` makes, before
        the transformer's at the first encode). When on, the LM's layers stay in host memory for
        good (where `lm_load_kind` loaded them, or moved there) and the encoders' home keeps the
        other encoders; when off, an LM loaded into host memory moves to the devices."""
        from difflet_tpu import runtime
        from difflet_tpu.encoders.streaming import LayerStream

        lm = self._streamable
        devices = self.encoder_home.devices()
        self.encoder_stream, self.encoder_stream_reason = decide_staging(
            self.encoder_stream_setting, self.stage_parts_bytes(), runtime.device_memory_limit(devices),
            runtime.host_memory_kind(devices) is not None, "encoder stream")
        logger.info("the %s text encoder %s (%s)", type(lm).__name__, "streams its layers from host memory"
                    if self.encoder_stream else "stays whole", self.encoder_stream_reason)
        if self.encoder_stream:
            self.text_stream = LayerStream(lm)
            self.encoder_home = EncoderHome([m for m in self.encoder_home.encoders if m is not lm], devices)
            return
        state = _params(lm)
        if any(x.sharding.memory_kind == runtime.HOST_MEMORY_KIND for x in jax.tree.leaves(state)):
            kind = devices[0].default_memory().kind
            nnx.update(lm, jax.block_until_ready(
                jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), state)))
            gc.collect()

    def text_encoder_for(self, model):
        """What encodes with `model`: its `LayerStream` when it streams, else itself."""
        return self.text_stream if self.text_stream is not None and model is self._streamable else model

    def encoders_out(self, step_kwargs: dict) -> None:
        """After the prompts are encoded: the encoders to host memory when the plan says so
        (decided at the first call, `EncoderHome.decide_auto`, from the transformer's
        step for `step_kwargs`)."""
        if self.text_stream is not None:  # the encodes' copies, already inside `timings.encode`
            self.timings.encoder_stream += self.text_stream.copy_s
            self.text_stream.copy_s = 0.0
        if self.encoder_offload is None and self._staged and self.encoder_offload_setting == "auto":
            # they did not fit beside the transformer's parameters alone, so not beside its step either
            self.encoder_offload, self.encoder_offload_reason = True, "auto: the transformer was staged for the encode"
        if self.encoder_offload is None:
            self.encoder_offload, self.encoder_offload_reason = self.encoder_home.decide_auto(
                self.encoder_offload_setting, self.transformer, step_kwargs, self.vae)
            logger.info("text encoders %s (%s)", "offloaded between prompts" if self.encoder_offload else
                        "stay on the devices", self.encoder_offload_reason)
        if self.encoder_offload:
            start = time.perf_counter()
            self.encoder_home.offload()
            self.timings.encoder_moves += time.perf_counter() - start
        # (only runners that were on the devices are staged: an offloading expert home's idle expert stays out)
        moved, self._staged = [r for r in self._staged if r.resident == "host"], []
        if moved:  # after the encoders left: the transformer back, as its steps were compiled
            start = time.perf_counter()
            for runner in moved:
                runner.load()
            self.timings.transformer_moves += time.perf_counter() - start

    def with_room(self, run, stage: str):
        """`run()` (a stage after the denoise: the VAE decode) with room made on the devices:
        `Config.transformer_offload` "on" sends the text encoders (unless `encoder_offload` is
        "off") and the transformer(s) to host memory first; "auto" makes only the room XLA asks
        for: when it reports the devices out of memory (RESOURCE_EXHAUSTED, at compile or
        allocation: every process of a mesh sees the same) it moves the text encoders out and
        runs the stage again, and if that is still too little, the transformer too; later calls
        make the room that was needed first. "off" lets the error through. The encoders come
        back at the next encode and the transformer after it (`encoders_out`), as when it is
        staged for the encode."""
        if self.transformer_offload_setting == "on":
            self._make_room(2)
            return run()
        level = self._room_for.get(stage, 0)  # 1: the encoders out; 2: the transformer too
        if level:
            self._make_room(level)
        while True:
            try:
                return run()
            except jax.errors.JaxRuntimeError as e:
                if self.transformer_offload_setting != "auto" or "RESOURCE_EXHAUSTED" not in str(e) or level == 2:
                    raise
                level = 2 if level or not self._encoders_can_leave() else 1
                logger.warning("the %s ran out of device memory (%s); moving %s to host memory and running it "
                               "again", stage, str(e).splitlines()[0][:200],
                               "the text encoders" if level == 1 else "the transformer")
            self._room_for[stage] = level
            self._make_room(level)

    def _encoders_can_leave(self) -> bool:
        return (self.encoder_offload_setting != "off" and not self.encoder_home.offloaded
                and self.encoder_home.bytes_per_chip() > 0)

    def _make_room(self, level: int) -> None:
        if self._encoders_can_leave():
            start = time.perf_counter()
            self.encoder_home.offload()
            self.timings.encoder_moves += time.perf_counter() - start
        if level >= 2:
            self._stage_transformer()

    def _stage_transformer(self) -> None:
        """The transformer Runners on the devices to host memory, listed in `_staged` until
        `encoders_out` brings them back (a call that failed mid-encode leaves its runners
        listed, so the next one brings them back too)."""
        runners = [r for r in self._runners() if r.resident == "device"]
        for runner in runners:
            runner.offload()  # the host copy is made once and kept: later calls only drop
        self._staged += [r for r in runners if r not in self._staged]
