"""Step caching (difflet_tpu.step_cache, `cache=` on the pipeline calls) on the tiny pipeline folders.

- threshold 0 never reuses the cache: the output is bit-identical to the uncached call (FLUX on
  one device and under SP, Wan T2V's CFG rows under TP, on 4 CPU devices);
- a huge threshold caches every call after the warmup, and the output stays finite;
- a forced pattern gives exactly its transformer calls, and the output equals the uncached loop
  run with the reuse rule written plainly here (`Reuse`: each later stack's `out - in` kept at a
  full call and added at a cached one), independent of the compiled `lax.cond` program;
- Qwen-Image (true CFG: a cache per call), Wan 2.2 A14B (the cache starts over at the expert
  switch), HunyuanVideo, LTX-2 under TP (both streams; CFG, STG and modality calls):
  threshold 0 bit-identical, a huge threshold caches;
- the options are checked before any work; a `first` that leaves no middle block is refused.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.arguments import ArgumentError
from difflet_tpu.config import Config, ConfigError, StepCacheOptions, parse_step_cache
from difflet_tpu.layers import nn
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.pipeline.diffusion import DiffusionPipeline
from difflet_tpu.step_cache import StepCacheError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
FAST = {"xla_backend_optimization_level": 0}
CASES = {"flux": ("flux_dev", "batch2"), "wan": ("wan_t2v", "cfg")}  # Wan's call: CFG rows in one batch


@functools.lru_cache(maxsize=None)
def pipeline(name, tp=None, mode=None):
    mesh = None if tp is None else make_mesh(tp)
    options = dict(compiler_options=FAST, **({"mode": mode} if mode else {}))
    return DiffusionPipeline.from_pretrained(FIXTURES / name, mesh=mesh, dtype=jnp.float32,
                                             config=Config(check_vma=True), runner_options=options)


def call_kwargs(name, call):
    calls = json.loads((FIXTURES / name / "calls.json").read_text())
    z = np.load(FIXTURES / name / "io.npz")
    if name == "ltx2":  # a list of calls from the same latents
        return dict(calls[int(call)], latents=z["in.latents"], audio_latents=z["in.audio_latents"], output_type="np")
    return dict(calls["calls"][call]["kwargs"], latents=z[f"{call}.latents"], output_type="np")


def pixels(out):
    return np.asarray(out.images if hasattr(out, "images") else out.frames)


@pytest.mark.parametrize("case,tp,mode", [("flux", None, None), ("flux", 4, "sp"), ("wan", 4, "tp")])
def test_threshold_zero_is_bit_identical_and_huge_threshold_caches(case, tp, mode):
    name, call = CASES[case]
    pipe, kw = pipeline(name, tp, mode), call_kwargs(name, call)
    plain = pipe(**kw)
    steps = kw["num_inference_steps"]
    assert plain.stats["transformer_calls"] == steps and plain.stats["cache"] is None
    zero = pipe(**kw, cache="first-block:threshold=0,warmup=1")
    np.testing.assert_array_equal(pixels(zero), pixels(plain))
    assert zero.stats["transformer_calls"] == steps and zero.stats["cached_calls"] == 0
    assert [d["skipped"] for d in zero.stats["decisions"]] == [False] * steps
    assert all(d["change"] > 0 for d in zero.stats["decisions"][1:])  # measured, not skipped
    huge = pipe(**kw, cache="first-block:threshold=1e9,warmup=1,max_skips=100")
    assert huge.stats["transformer_calls"] == 1 and huge.stats["cached_calls"] == steps - 1
    assert np.isfinite(pixels(huge)).all()
    assert np.abs(pixels(huge) - pixels(plain)).max() > 1e-3  # the cache changed the trajectory


# the other ports: (folder, call, tp, mode, the slots of a step, full passes with a huge threshold)
OTHERS = [("qwen_image", "true_cfg", 4, "sp", ["cond", "uncond"], 2),  # true CFG: two calls, two caches
          ("wan22_a14b", "two_experts", None, None, ["rows"], 2),  # starts over at the expert switch
          ("hunyuan_video", "true_cfg", 4, "sp", ["rows"], 1),
          ("ltx2", "0", 4, "tp", ["rows", "stg", "modality"], 3)]  # CFG rows, STG and modality calls


@pytest.mark.parametrize("name,call,tp,mode,slots,full", OTHERS)
def test_other_ports(name, call, tp, mode, slots, full):
    pipe, kw = pipeline(name, tp, mode), call_kwargs(name, call)
    plain = pipe(**kw)
    zero = pipe(**kw, cache="first-block:threshold=0,warmup=1")
    np.testing.assert_array_equal(pixels(zero), pixels(plain))
    if name == "ltx2":  # its second stream
        np.testing.assert_array_equal(np.asarray(zero.audio), np.asarray(plain.audio))
    assert zero.stats["transformer_calls"] == plain.stats["transformer_calls"] == len(slots) * kw["num_inference_steps"]
    huge = pipe(**kw, cache="first-block:threshold=1e9,warmup=1,max_skips=100")
    assert huge.stats["transformer_calls"] == full and np.isfinite(pixels(huge)).all()
    assert [d["slot"] for d in huge.stats["decisions"][:len(slots)]] == slots
    if name == "wan22_a14b":  # expert 0 at steps 0-1, expert 1 at steps 2-3: warmup again at the switch
        assert [(d["skipped"], d.get("reset", False)) for d in huge.stats["decisions"]] == \
            [(False, False), (True, False), (False, True), (True, False)]


class Reuse:
    """The first-block reuse rule written plainly, traced afresh for every transformer call of
    the uncached loop: block 0 of the first stack always runs; a full call ("F" in `pattern`)
    sends each remaining segment's `out - in` to the host (`jax.debug.callback`), a cached call
    ("S") adds it as a constant (then `derive`)."""

    def __init__(self, pattern: str, stacks: int):
        self.pattern, self.stacks, self.call, self.stack, self.residual = pattern, stacks, -1, 0, {}

    def keep(self, stack):
        def store(residual):
            self.residual[stack] = jax.tree.map(np.asarray, residual)
        return store

    def scan(self, blocks, carry, fn, xs, derive):
        n, start = nn.num_blocks(blocks), 0
        if self.stack == 0:
            self.call += 1
            carry, start = nn.scan_range(blocks, carry, fn, xs, 0, 1), 1
        if start < n:
            if self.pattern[self.call] == "F":
                out = nn.scan_range(blocks, carry, fn, xs, start, n)
                jax.debug.callback(self.keep(self.stack), jax.tree.map(lambda o, i: o - i, out, carry))
            else:
                out = jax.tree.map(lambda i, r: i + r, carry, self.residual[self.stack])
                out = out if derive is None else derive(out)
            carry = out
        self.stack = (self.stack + 1) % self.stacks
        return carry


@pytest.mark.parametrize("case,stacks,pattern", [("flux", 2, "FSS"), ("wan", 1, "FSF")])
def test_forced_pattern_matches_the_reuse_rule(case, stacks, pattern, monkeypatch):
    name, call = CASES[case]
    pipe, kw = pipeline(name), call_kwargs(name, call)
    assert len(pattern) == kw["num_inference_steps"]
    out = pipe(**kw, cache=f"first-block:force={pattern}")
    assert out.stats["transformer_calls"] == pattern.count("F")
    assert out.stats["cached_calls"] == pattern.count("S")
    assert [d["skipped"] for d in out.stats["decisions"]] == [c == "S" for c in pattern]
    compiled = pipe.run_transformer

    def retraced(runner, slot="cond", **kwargs):  # every call traced again: `Reuse` decides per call
        runner._steps.clear()
        out = compiled(runner, slot, **kwargs)
        jax.effects_barrier()
        return out

    monkeypatch.setattr(pipe, "run_transformer", retraced)
    token = nn.BLOCK_CHAIN.set(Reuse(pattern, stacks))
    try:
        want = pipe(**kw, cache="off")
    finally:
        nn.BLOCK_CHAIN.reset(token)
        for runner in pipe.experts if hasattr(pipe, "experts") else [pipe.transformer]:
            runner._steps.clear()  # no step traced with `Reuse` stays
    monkeypatch.undo()
    plain = pipe(**kw, cache="off")
    err = np.abs(pixels(out) - pixels(want)).max()
    assert err <= 1e-5, f"cached loop vs the plain reuse rule: max abs {err:.2e}"
    assert np.abs(pixels(plain) - pixels(want)).max() > 100 * max(err, 1e-6)  # the comparison can fail


@pytest.mark.parametrize("text,match", [
    ("second-block", "unknown caching method"),
    ("first-block:threshold=-1", "threshold=-1.0 must be"),
    ("first-block:threshold=abc", "is not a number"),
    ("first-block:warmup=0", "warmup=0 must be >= 1"),
    ("first-block:max_skips=1.5", "is not an integer"),
    ("first-block:speed=2", "'speed=2' is not KEY=VALUE"),
    ("first-block:warmup=1,warmup=2", "warmup is given twice"),
    ("first-block:force=FXS", "must be letters F"),
])
def test_bad_options_are_refused_by_name(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_step_cache(text)
    with pytest.raises(ConfigError, match=match):
        Config.from_env({"DIFFLET_TPU_STEP_CACHE": text})


def test_options_parse_and_round_trip():
    o = parse_step_cache("first-block:threshold=0.08,warmup=2,max_skips=3")
    assert o == StepCacheOptions(threshold=0.08, warmup=2, max_skips=3)
    assert parse_step_cache(o.spec()) == o and parse_step_cache("off") is None and parse_step_cache(None) is None
    assert parse_step_cache("first-block") == StepCacheOptions()
    assert Config(step_cache="first-block:last=1").step_cache == StepCacheOptions(last=1).spec()


def test_call_refuses_bad_options_before_any_work(monkeypatch):
    pipe = pipeline("flux_dev")
    kw = call_kwargs("flux_dev", "batch2")
    monkeypatch.setattr(type(pipe), "encode_prompt", lambda *a, **k: pytest.fail("encoded before the refusal"))
    with pytest.raises(ArgumentError, match="unknown caching method"):
        pipe(**kw, cache="teacache")
    with pytest.raises(ArgumentError, match="give `cache=`"):
        pipe(**kw, quality_gate=30)
    with pytest.raises(ArgumentError, match="output_type='latent' has none"):
        pipe(**dict(kw, output_type="latent"), cache="first-block", quality_gate=30)


def test_options_that_leave_no_middle_block_are_refused():
    pipe, kw = pipeline("flux_dev"), call_kwargs("flux_dev", "batch2")  # 1 double + 2 single blocks
    with pytest.raises(StepCacheError, match="first block stack has 1 blocks"):
        pipe(**kw, cache="first-block:first=2")
    with pytest.raises(StepCacheError, match="leaves no middle block"):
        pipe(**kw, cache="first-block:last=2")
    with pytest.raises(StepCacheError, match="nothing is cached yet"):
        pipe(**kw, cache="first-block:force=SFF")


# --------------------------------------------------------------------------
# The quality gate
# --------------------------------------------------------------------------

def _brute_ssim(x, y):
    """SSIM of two [H, W] float64 images by its definition, pixel by pixel: Gaussian weights
    (sigma 1.5, radius 5) over the half-sample-symmetric padded neighbourhood, then the mean
    over the pixels at least 5 from the border."""
    r, s = 5, 1.5
    g = np.exp(-np.arange(-r, r + 1) ** 2 / (2 * s * s))
    w = np.outer(g, g) / np.outer(g, g).sum()
    xp, yp = np.pad(x, r, mode="symmetric"), np.pad(y, r, mode="symmetric")
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    h, wd = x.shape
    out = np.zeros_like(x)
    for i in range(h):
        for j in range(wd):
            a, b = xp[i:i + 2 * r + 1, j:j + 2 * r + 1], yp[i:i + 2 * r + 1, j:j + 2 * r + 1]
            ma, mb = (w * a).sum(), (w * b).sum()
            va, vb, cab = (w * a * a).sum() - ma ** 2, (w * b * b).sum() - mb ** 2, (w * a * b).sum() - ma * mb
            out[i, j] = (2 * ma * mb + c1) * (2 * cab + c2) / ((ma ** 2 + mb ** 2 + c1) * (va + vb + c2))
    return out[r:h - r, r:wd - r].mean()


def test_psnr_and_ssim_by_their_definitions():
    from difflet_tpu.pipeline import quality

    rng = np.random.default_rng(0)
    x = rng.random((2, 16, 20, 3))
    y = np.clip(x + rng.normal(0, 0.05, x.shape), 0, 1)
    assert quality.psnr(x, y) == pytest.approx(10 * np.log10(1 / np.mean((x - y) ** 2)), rel=1e-12)
    assert quality.psnr(x, x) == float("inf") and quality.ssim(x, x) == pytest.approx(1.0, abs=1e-12)
    want = np.mean([_brute_ssim(x[n, ..., c], y[n, ..., c]) for n in range(2) for c in range(3)])
    assert quality.ssim(x, y) == pytest.approx(want, abs=1e-12)
    assert quality.ssim(x, y) < 0.99


def test_quality_gate_passes_and_fails():
    from difflet_tpu.pipeline import quality

    pipe, kw = pipeline("flux_dev"), call_kwargs("flux_dev", "batch2")
    same = pipe(**kw, cache="first-block:threshold=0,warmup=1", quality_gate=100.0)
    gate = same.stats["quality_gate"]
    assert gate["identical"] and gate["passed"] and gate["ssim"] == pytest.approx(1.0) and gate["calls_saved"] == 0
    cached = pipe(**kw, cache="first-block:force=FSS", quality_gate=200.0)
    gate = cached.stats["quality_gate"]
    plain = pipe(**kw)
    want = quality.psnr(pixels(cached), pixels(plain))  # the two runs, apart from the gate
    assert gate["psnr_db"] == pytest.approx(want) and not gate["passed"]
    assert gate["transformer_calls"] == 1 and gate["uncached_transformer_calls"] == 3 and gate["calls_saved"] == 2
    assert gate["ssim"] == pytest.approx(quality.ssim(pixels(cached), pixels(plain)))
    assert pipe(**kw, cache="first-block:force=FSS", quality_gate=want - 1).stats["quality_gate"]["passed"]


def test_generate_gate_exit_status_json_and_plot(tmp_path, capsys):
    from difflet_tpu import generate

    out, report, plot = tmp_path / "a.png", tmp_path / "a.json", tmp_path / "plot.png"
    argv = [str(FIXTURES / "flux_schnell"), "--prompt", "a cat", "--height", "32", "--width", "32", "--steps", "3",
            "--out", str(out), "--json", str(report), "--cache", "first-block:threshold=1e9,warmup=1",
            "--quality-gate", "300", "--cache-plot", str(plot)]
    assert generate.main(argv) == generate.EXIT_GATE_FAILED
    assert "the quality gate failed" in capsys.readouterr().err
    stats = json.loads(report.read_text())["stats"]
    assert stats["transformer_calls"] == 1 and [d["skipped"] for d in stats["decisions"]] == [False, True, True]
    assert all(d["change"] > 0 for d in stats["decisions"][1:])
    assert stats["quality_gate"]["calls_saved"] == 2 and not stats["quality_gate"]["passed"]
    assert out.read_bytes()[:8] == plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert generate.main(argv[:3] + ["--out", str(tmp_path / "b.png"), "--quality-gate", "30"]) == 1
    assert "--quality-gate needs --cache" in capsys.readouterr().err


def test_the_bench_loop_caches():
    """`Denoiser(cache=)` (the bench's loop) on the tiny Wan transformer with CFG rows: threshold 0
    is the uncached loop bit for bit; a huge threshold runs one full pass and stays finite."""
    from difflet_tpu import loading
    from difflet_tpu.models import wan
    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.runner import Runner
    from difflet_tpu.testing import read_fixture_io

    case = Path(__file__).resolve().parents[1] / "fixtures" / "wan_t2v_batch2"
    kw, _ = read_fixture_io(case)
    runner = Runner(loading.load_transformer(case / "transformer", dtype=jnp.float32, config=Config()), None,
                    Config(), compiler_options=FAST)
    inputs = {"hidden_states": kw["hidden_states"][:1], "timestep": kw["timestep"][:1],
              "encoder_hidden_states": kw["encoder_hidden_states"][1:]}
    cfg_inputs = dict(inputs, hidden_states=kw["hidden_states"][[0, 0]],
                      encoder_hidden_states=kw["encoder_hidden_states"], timestep=kw["timestep"])
    spec = wan.SPEC.pipeline

    def run(cache):
        den = PL.Denoiser(spec, [runner], inputs, spec.schedule(3, inputs, "tiny"), guidance=5.0,
                          cfg_inputs=cfg_inputs, dtype=jnp.float32, cache=cache)
        final, _ = den.run()
        return final["hidden_states"], den.step_cache

    plain, none = run(None)
    zero, stats = run("first-block:threshold=0,warmup=1")
    assert none is None and stats.full_calls == 3
    np.testing.assert_array_equal(zero, plain)
    huge, stats = run("first-block:threshold=1e9,warmup=1")
    assert stats.stats()["transformer_calls"] == 1 and stats.cached_calls == 2 and np.isfinite(huge).all()
    assert np.abs(huge - plain).max() > 1e-3
