"""The idle expert of a two-expert model in host memory (Config.expert_offload).

A tiny two-expert Wan (the tiny preset's shapes, Wan2.2 T2V A14B's schedule
and boundary) on 1, 2 and 4 CPU devices: with offload the final latents are
bit-identical to both experts resident, the idle expert's device arrays are
gone (not live) while it is offloaded, and nothing recompiles. Then the
Runner's offload/load contract, "auto", bad input, and the bench's report.
"""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from difflet_tpu import models, runtime
from difflet_tpu.bench import cases, cli, compile_only, report
from difflet_tpu.pipeline import denoise as PL
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.parallel.modes import Parallel
from difflet_tpu.runner import Runner

PRESET = "Wan2.2-T2V-A14B"  # its schedule and boundary; the experts have the tiny preset's shapes
STEPS = 6                   # timesteps 1000 .. 126: experts [0, 0, 0, 0, 1, 1] at boundary 875


def _wan_denoiser(n_devices, mode, offload, placed=False):
    spec = models.spec("wan")
    cfg = cases.build_config(spec, "tiny")
    pipe = spec.pipeline
    inputs = spec.example_inputs(cfg, **spec.tiny_shape, batch=1, seed=0, dtype=np.float32)
    cfg_inputs = spec.example_inputs(cfg, **spec.tiny_shape, batch=2, seed=1, dtype=np.float32)
    cfg_inputs["hidden_states"] = np.concatenate([inputs["hidden_states"]] * 2)
    mesh = None if n_devices == 1 else make_mesh(n_devices)
    # models built inline and not kept: the Runners hold the only references to their arrays
    # (`placed`: on the mesh first, as `load_transformer(mesh=)` does, so the Runners share them)
    build = lambda e: spec.build(cfg, dtype=jnp.float32, rngs=nnx.Rngs(e))
    make = (lambda e: runtime.place(build(e), mesh, spec.plan)) if placed else build
    runners = [Runner(make(e), mesh, Config(expert_offload=offload), mode=mode) for e in (0, 1)]
    return PL.Denoiser(pipe, runners, inputs, pipe.schedule(STEPS, inputs, PRESET), guidance=pipe.guidance,
                       boundary=spec.experts[PRESET], cfg_inputs=cfg_inputs, dtype=jnp.float32)


def _leaves(runner):
    return jax.tree_util.tree_leaves(runner._state)


@pytest.mark.parametrize("n_devices,mode,placed", [(1, None, False), (2, "sp", True), (4, "tp", False)])
def test_offload_frees_the_idle_expert_and_the_latents_are_bit_identical(n_devices, mode, placed):
    ref = _wan_denoiser(n_devices, mode, "off", placed)
    assert [ref.expert(float(t)) for t in ref.schedule.timesteps] == [0, 0, 0, 0, 1, 1]  # one switch
    want, _ = ref.run()
    del ref
    gc.collect()

    den = _wan_denoiser(n_devices, mode, "on", placed)
    idle = den.runners[1]
    idle_bytes = idle.param_bytes() * n_devices
    device_arrays = [weakref.ref(x) for x in _leaves(idle)]
    assert all(x.sharding.memory_kind == "device" for x in _leaves(idle))
    gc.collect()
    before = runtime.live_bytes("device")
    gc.disable()  # what frees the arrays is offload() itself, not a collection that happens to run
    try:
        lat = den.step(den.initial(), 0)  # the first step moves the idle expert to host memory
        alive = sum(r() is not None for r in device_arrays)
        after = runtime.live_bytes("device")
    finally:
        gc.enable()
    assert den.offload and den.active == 0 and idle.resident == "host"
    assert all(x.sharding.memory_kind == runtime.HOST_MEMORY_KIND for x in _leaves(idle))
    assert alive == 0, "an offloaded expert's device array is still alive"
    # the step added latents, outputs and tables, far less than the expert it freed
    assert after <= before - idle_bytes + idle_bytes // 4
    assert runtime.live_bytes(runtime.HOST_MEMORY_KIND) >= idle_bytes
    del lat

    den.warmup(1)
    compiles = PL.CompileCounter.count()
    got, times = den.run()
    assert PL.CompileCounter.count() == compiles, "a step recompiled after an expert came back from host memory"
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    # warm-up ended on expert 1: the timed run switches back at step 0 and forward at the boundary
    assert [(s["step"], s["src"], s["dst"]) for s in den.swaps] == [(0, 1, 0), (4, 0, 1)]
    assert [r.resident for r in den.runners] == ["host", "device"] and len(times) == STEPS


def test_runner_offload_contract():
    """offload/load move the Runner's own copy and never change the model given; the
    device memory is freed once the Runner holds the last reference."""
    spec = models.spec("wan")
    cfg = cases.build_config(spec, "tiny")
    mesh = make_mesh(2)
    kw = spec.example_inputs(cfg, **spec.tiny_shape, batch=1, seed=0, dtype=np.float32)
    # a model already on the mesh (with the plan of the Runner's mode): the Runner shares its arrays
    plan = spec.plan_for(Parallel.for_mesh(mesh, Config(), mode="sp"))
    model = runtime.place(spec.build(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), mesh, plan)
    run = Runner(model, mesh, Config(), mode="sp", cache_text=True)
    out = np.asarray(run(**kw).sample)
    assert "text_kv" in run.state  # a cache derived from the parameters: dropped with them
    held = [weakref.ref(x) for x in _leaves(run)]
    assert all(a is b for a, b in zip(_leaves(run), jax.tree_util.tree_leaves(nnx.state(model))))
    with pytest.warns(UserWarning, match="still referenced elsewhere"):
        run.offload()
    assert run.resident == "host" and "text_kv" not in run.state
    with pytest.raises(ValueError, match="host memory .*load\\(\\)"):
        run(**kw).sample
    gc.collect()
    assert all(r() is not None for r in held)  # the caller's model still holds them: nothing changed
    params = jax.tree_util.tree_leaves(nnx.state(model))
    assert all(x.sharding.memory_kind == "device" and not x.is_deleted() for x in params)
    del model, params
    gc.collect()
    assert all(r() is None for r in held)  # now the host copy is the only one
    run.load()
    assert run.resident == "device"
    np.testing.assert_array_equal(np.asarray(run(**kw).sample), out)
    run.offload(), run.offload(), run.load(), run.load()  # idempotent
    np.testing.assert_array_equal(np.asarray(run(**kw).sample), out)
    # a model on the default device: the Runner's own sharded copy is freed at offload
    model = spec.build(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    run = Runner(model, mesh, Config(), mode="sp")
    own = [weakref.ref(x) for x in _leaves(run)]
    run.offload()
    gc.collect()
    assert all(r() is None for r in own)
    abstract = Runner(runtime.abstract_model(lambda: spec.build(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)),
                                             mesh, spec.plan), mesh, Config(), mode="sp")
    with pytest.raises(ValueError, match="abstract"):
        abstract.offload()


def test_auto_offloads_only_when_every_expert_does_not_fit(monkeypatch):
    """"auto": the first expert's compiled step + the other expert's parameters per device
    against the devices' memory limit (CPU reports none: stubbed here); deciding compiles
    nothing the first call does not."""
    den = _wan_denoiser(2, "sp", "auto")
    kw = den.kwargs(den.initial(), float(den.schedule.timesteps[0]))
    need = den.runners[0].memory(**kw)["total"] + den.runners[1].param_bytes()
    for limit, offloads in ((need, False), (need - 1, True)):
        den = _wan_denoiser(2, "sp", "auto")
        monkeypatch.setattr(runtime, "device_memory_limit", lambda devices: limit)
        den.step(den.initial(), 0)
        assert den.offload is offloads and den.runners[1].resident == ("host" if offloads else "device")
        assert ("exceeds" if offloads else "fits") in den.offload_reason
    monkeypatch.setattr(runtime, "device_memory_limit", lambda devices: None)
    den = _wan_denoiser(2, "sp", "auto")
    den.step(den.initial(), 0)
    assert den.offload is False and "no device memory limit" in den.offload_reason
    # the decision's compile is the one the step reuses: as many compiles as with "off"
    counts = {}
    for setting in ("off", "auto"):
        monkeypatch.setattr(runtime, "device_memory_limit", lambda devices: need - 1)
        den = _wan_denoiser(2, "sp", setting)
        lat = den.initial()
        c0 = PL.CompileCounter.count()
        den.step(lat, 0)
        counts[setting] = PL.CompileCounter.count() - c0
    assert counts["auto"] == counts["off"] > 0


def test_bad_offload_requests(monkeypatch):
    # a platform without host memory: "on" is refused before any step, "auto" stays off
    monkeypatch.setattr(runtime, "host_memory_kind", lambda devices: None)
    with pytest.raises(ValueError, match="no pinned_host memory"):
        _wan_denoiser(2, "sp", "on")
    with pytest.raises(ValueError, match="offload='sometimes'"):
        PL.Denoiser(models.spec("wan").pipeline, [object()], {"hidden_states": np.zeros((1, 2)),
                                                               "timestep": np.zeros(1)},
                    None, guidance=1.0, offload="sometimes")
    spec = models.spec("wan")
    cfg = cases.build_config(spec, "tiny")
    run = Runner(spec.build(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), make_mesh(2), Config(), mode="sp")
    with pytest.raises(ValueError, match="no pinned_host memory"):
        run.offload()
    monkeypatch.undo()
    # a runner handed over offloaded comes back to the devices when the setting keeps experts resident
    den = _wan_denoiser(2, "sp", "off")
    den.runners[1].offload()
    den.run()
    assert den.offload is False and [r.resident for r in den.runners] == ["device", "device"]
    # one expert: nothing to offload, whatever the setting
    inputs = spec.example_inputs(cfg, **spec.tiny_shape, batch=1, seed=0, dtype=np.float32)
    den = PL.Denoiser(spec.pipeline, [run], inputs, spec.pipeline.schedule(2, inputs, "tiny"), guidance=1.0,
                      offload="on")
    den.run()
    assert den.offload is False and den.offload_reason == "one expert" and run.resident == "device"


def test_compile_only_memory_with_and_without_offload():
    from difflet_tpu.tools import estimate as E

    v5e = E.CHIPS["v5e"]
    gib = 2**30
    mem = dict(arguments=8 * gib, outputs=1, temporaries=2 * gib, aliased=0, code=0, total=10 * gib)
    other = 7 * gib
    off, rep = compile_only.expert_memory(mem, other, "off", v5e)
    assert off["total"] == 17 * gib and off["other_experts"] == other and not rep["enabled"]
    on, rep = compile_only.expert_memory(mem, other, "on", v5e)
    rep_on = rep
    assert on["total"] == 10 * gib and on["other_experts"] == 0 and on["host_experts"] == other
    assert rep["enabled"] and rep["idle_expert_bytes_per_chip"] == other and rep["all_resident_bytes"] == 17 * gib
    assert rep["host_bytes_per_chip"] == 2 * other  # each expert's host copy is kept
    assert rep["swap_ms_estimate"] == pytest.approx(1e3 * other / 1.5e10, abs=1e-3)  # ~501 ms
    auto, rep = compile_only.expert_memory(mem, other, "auto", v5e)
    assert auto == on and rep["enabled"]  # 17 GiB > 16 GiB
    small = dict(mem, total=8 * gib)
    auto, rep = compile_only.expert_memory(small, other, "auto", v5e)
    assert auto["total"] == 15 * gib and not rep["enabled"]  # fits: no swaps
    import io

    row = dict(model="wan:Wan2.2-T2V-A14B", mode="sp-pallas", hbm=on, expert_offload=rep_on)
    out = io.StringIO()
    report.print_offload_notes([row], out)
    text = out.getvalue()
    assert "7.00 GiB/chip not in HBM, 14.00 GiB/chip in host memory" in text and "ESTIMATED swap 501 ms" in text and "15 GB/s" in text


def test_bench_two_expert_run_with_offload(tmp_path, monkeypatch, capsys):
    """The bench on CPU with a two-expert toy (the toy port with a boundary): --expert-offload on
    reports the measured swaps and gives the same final latents as off."""
    import json

    from difflet_tpu.testing import register_toy_port

    toy = register_toy_port()
    monkeypatch.setitem(toy.experts, "tiny", 0.5)
    cfg = cases.build_config(toy, "tiny")
    # one expert's parameters per chip on tp=4 (bytes_per_device: tests/test_bench.py checks it)
    expert = runtime.bytes_per_device(runtime.abstract_model(
        lambda: toy.build(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), make_mesh(4), toy.plan))
    rows = {}
    for setting in ("on", "off"):
        out = tmp_path / f"{setting}.json"
        rc = cli.main(["--model", "toy:tiny", "--mode", "tp,sp", "--steps", "4", "--expert-offload", setting,
                         "--json", str(out)])
        assert rc == 0
        rows[setting] = json.loads(out.read_text())["results"]
    for on, off in zip(rows["on"], rows["off"]):
        assert on["sha256"] == off["sha256"] and on["experts"] == 2 and on["compilations_timed"] == 0
        o = on["expert_offload"]
        assert o["enabled"] and len(o["swap_s"]) == 2 and all(s > 0 for s in o["swap_s"])
        assert o["host_bytes_per_chip"] == 2 * expert  # both experts' host copies after the switches
        assert off["expert_offload"] == dict(setting="off", enabled=False, reason="off")
    assert "measured expert swaps ms" in capsys.readouterr().out
    monkeypatch.setattr(runtime, "host_memory_kind", lambda devices: None)
    assert cli.main(["--model", "toy:tiny", "--mode", "tp", "--steps", "2", "--expert-offload", "on"]) == 2
    assert "no pinned_host memory" in capsys.readouterr().err
