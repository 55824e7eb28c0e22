"""UniPCMultistepScheduler (difflet_tpu.pipeline.unipc) against diffusers 0.42.1's whole runs, the
sampler interface (difflet_tpu.pipeline.samplers), config checks, and the compile-once rule.

tests/fixtures/schedulers/unipc.{json,npz} (generate.py there): per case diffusers' timesteps,
sigmas and the sample after every step of a run whose model output is `e (1 + 0.1 i) + 0.5 x`.
"""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.models.wan import schedule as wan
from difflet_tpu.pipeline import samplers, schedules as S, unipc

HERE = pathlib.Path(__file__).parent / "fixtures" / "schedulers"
CASES = json.loads((HERE / "unipc.json").read_text())["cases"]
Z = np.load(HERE / "unipc.npz")


def _sampler(case):
    raw = dict(case["config"], _class_name="UniPCMultistepScheduler")
    return samplers.sampler_from_config(raw, case["steps"], mu=case["mu"], sigmas=case["sigmas"])


def _run(sampler, x, e, dtype=jnp.float32):
    x, out = jnp.asarray(x, dtype), []
    for i in range(len(sampler)):
        x = sampler.step(i, (e * np.float32(1 + 0.1 * i)).astype(dtype) + 0.5 * x, x)
        out.append(np.asarray(x, np.float32))
    return np.stack(out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_timesteps_and_sigmas_match_diffusers(case):
    s = _sampler(case)
    name = case["name"]
    assert len(s) == case["steps"] and s.timesteps.dtype == np.float32 and s.sigmas.dtype == np.float32
    np.testing.assert_array_equal(s.timesteps, Z[f"{name}.timesteps"].astype(np.float32))  # diffusers' int64
    np.testing.assert_allclose(s.sigmas, Z[f"{name}.sigmas"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_whole_run_matches_diffusers(case):
    want = Z[f"{case['name']}.samples"]
    got = _run(_sampler(case), Z["x"], Z["e"])
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_corrector_and_the_second_order_matter():
    """The fixture's runs tell the solver's parts apart (so the comparison above can fail):
    without the corrector, or at first order, a 10-step Wan run ends 1e-3 from diffusers' (the
    tolerance is 1e-5)."""
    case = next(c for c in CASES if c["name"] == "wan_5.0_10")
    want = Z["wan_5.0_10.samples"]
    for cfg in (dict(disable_corrector=list(range(10))), dict(solver_order=1)):
        raw = dict(case["config"], _class_name="UniPCMultistepScheduler", **cfg)
        got = _run(samplers.sampler_from_config(raw, 10), Z["x"], Z["e"])
        assert np.abs(got - want).max() > 5e-4


def test_wan_schedule_is_its_folders_unipc():
    s = wan.schedule(50, 5.0)
    assert isinstance(s, unipc.UniPCSampler)
    np.testing.assert_array_equal(s.timesteps, Z["wan_5.0_50.timesteps"].astype(np.float32))
    np.testing.assert_allclose(_run(s, Z["x"], Z["e"]), Z["wan_5.0_50.samples"], rtol=1e-5, atol=1e-5)


def test_every_step_runs_one_compiled_program():
    """The coefficients are runtime arrays: the update compiles once per sample shape and dtype,
    for every step (first, corrector-less, second order, last) of every schedule."""
    update, fresh = unipc._jitted()
    x = jnp.asarray(Z["x"])
    _run(wan.schedule(3, 3.0), x, Z["e"])  # compiles (or has compiled) the update for this shape
    n = update._cache_size()
    for steps, shift in ((50, 3.0), (7, 12.0), (1, 5.0)):
        _run(wan.schedule(steps, shift), x, Z["e"])
    assert update._cache_size() == n
    before = update._cache_size()
    _run(wan.schedule(2, 3.0), jnp.zeros((2, 4, 1, 2, 2)), np.ones((2, 4, 1, 2, 2), np.float32))
    assert update._cache_size() == before + 1  # a new shape is a new program (the counter counts)


def test_bfloat16_samples_stay_bfloat16():
    s = wan.schedule(7, 5.0)
    got = _run(s, Z["x"], Z["e"], dtype=jnp.bfloat16)
    want = Z["wan_5.0_7.samples"]
    x = s.step(0, jnp.zeros((1, 4, 2, 3, 3), jnp.bfloat16), jnp.zeros((1, 4, 2, 3, 3), jnp.bfloat16))
    assert x.dtype == jnp.bfloat16
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)


def test_steps_run_in_order():
    s = wan.schedule(5)
    x = jnp.asarray(Z["x"])
    x1 = s.step(0, x, x)
    with pytest.raises(ValueError, match="next step is 1, got 2"):
        s.step(2, x1, x1)
    a = s.step(1, x1, x1)
    assert s.state.step_index == 2 and s.state.lower_order_nums == 2 and len(s.state.history) == 2
    s.step(0, x, x)  # step 0 starts over: the same run again
    np.testing.assert_array_equal(np.asarray(s.step(1, x1, x1)), np.asarray(a))
    s.begin(3)  # diffusers' set_begin_index: first order, no corrector
    assert s.state.last_sample is None
    s.step(3, x, x)
    with pytest.raises(ValueError, match="outside"):
        s.begin(5)
    with pytest.raises(ValueError, match="differ in shape"):
        s.step(0, x[:, :2], x)


# --------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------

WAN = dict(wan.SCHEDULER)


@pytest.mark.parametrize("field,value,match", [
    ("prediction_type", "epsilon", "prediction_type='epsilon' is not implemented"),
    ("use_flow_sigmas", False, "use_flow_sigmas=False is not implemented"),
    ("use_karras_sigmas", True, "use_karras_sigmas=True"),
    ("use_exponential_sigmas", True, "use_exponential_sigmas=True"),
    ("use_beta_sigmas", True, "use_beta_sigmas=True"),
    ("thresholding", True, "thresholding=True"),
    ("predict_x0", False, "predict_x0=False"),
    ("solver_p", {"a": 1}, "solver_p="),
    ("num_train_timesteps", 0, "num_train_timesteps must be an int >= 1"),
    ("num_train_timesteps", "1000", "num_train_timesteps must be an int"),
    ("num_train_timesteps", 1000.0, "num_train_timesteps must be an int"),
    ("flow_shift", -3.0, "flow_shift must be a positive finite number"),
    ("flow_shift", float("nan"), "flow_shift must be a positive finite number"),
    ("flow_shift", "3", "flow_shift must be a positive finite number"),
    ("flow_shift", True, "flow_shift must be a positive finite number"),
    ("solver_order", 0, "solver_order must be an int >= 1"),
    ("solver_type", "bh3", "solver_type must be one of"),
    ("final_sigmas_type", "min", "final_sigmas_type must be one of"),
    ("timestep_spacing", "even", "timestep_spacing must be one of"),
    ("disable_corrector", [0.5], "disable_corrector must be a list of ints"),
    ("lower_order_final", "yes", "lower_order_final must be true or false"),
    ("lower_order_final", False, "lower_order_final=False with solver_order 2"),
    ("solver_type", "bh1", "bh1' with final_sigmas_type='zero'"),
    ("shift_terminal", 1.5, "shift_terminal must be in"),
    ("use_exotic_sigmas", True, r"unknown UniPCMultistepScheduler fields \['use_exotic_sigmas'\]"),
])
def test_config_refuses_what_it_does_not_implement(field, value, match):
    with pytest.raises(ValueError, match=r"^wan/scheduler_config.json: .*" + match):
        samplers.scheduler_from_config(dict(WAN, **{field: value}), "wan/scheduler_config.json")


def test_config_accepts_what_has_no_effect_with_flow_sigmas():
    cfg = samplers.scheduler_from_config(dict(WAN, beta_schedule="scaled_linear", timestep_spacing="trailing",
                                              steps_offset=1, rescale_betas_zero_snr=True, sigma_min=0.1,
                                              solver_type="midpoint", _diffusers_version="0.33.0"))
    assert cfg == wan.scheduler(3.0)  # midpoint is diffusers' alias of bh2


def test_scheduler_from_folder_and_the_pipeline_loader(tmp_path):
    from difflet_tpu.pipeline.diffusion import PipelineError, scheduler_config

    folder = tmp_path / "scheduler"
    folder.mkdir()
    (folder / "scheduler_config.json").write_text(json.dumps(dict(WAN, flow_shift=5.0)))
    cfg = samplers.scheduler_from_folder(folder)
    assert cfg == wan.scheduler(5.0) and scheduler_config(folder) == cfg
    s = samplers.make_sampler(cfg, 10)
    np.testing.assert_array_equal(s.timesteps, Z["wan_5.0_10.timesteps"].astype(np.float32))
    (folder / "scheduler_config.json").write_text(json.dumps(dict(WAN, flow_shift=0)))
    with pytest.raises(PipelineError, match=r"scheduler_config.json: flow_shift must be a positive"):
        scheduler_config(folder)
    (folder / "scheduler_config.json").write_text(json.dumps(dict(WAN, _class_name="DDIMScheduler")))
    with pytest.raises(ValueError, match="DDIMScheduler' is not supported"):
        samplers.scheduler_from_folder(folder)
    (folder / "scheduler_config.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read it"):
        samplers.scheduler_from_folder(folder)


def test_euler_configs_are_checked_and_step_as_before():
    euler = dict(_class_name="FlowMatchEulerDiscreteScheduler", shift=3.0, use_dynamic_shifting=True,
                 base_shift=0.5, max_shift=1.15, shift_terminal=None)
    for bad, match in ((dict(num_train_timesteps=-1), "num_train_timesteps must be an int >= 1"),
                       (dict(shift=float("inf")), "shift must be a positive finite number"),
                       (dict(max_image_seq_len=256), "calculate_shift divides"),
                       (dict(stochastic_sampling=True), "stochastic_sampling"),
                       (dict(time_shift_type="cubic"), "time_shift_type must be one of"),
                       (dict(shift_magic=1), "unknown FlowMatchEulerDiscreteScheduler fields")):
        with pytest.raises(ValueError, match="f.json: .*" + match):
            samplers.scheduler_from_config(dict(euler, **bad), "f.json")
    cfg = samplers.scheduler_from_config(euler)
    assert cfg == S.SchedulerConfig(shift=3.0, use_dynamic_shifting=True)
    s = samplers.sampler_from_config(euler, 4, sigmas=np.linspace(1.0, 0.25, 4), mu=0.7)
    want = S.flow_match_euler(cfg, 4, sigmas=np.linspace(1.0, 0.25, 4), mu=0.7)
    np.testing.assert_array_equal(s.timesteps, want.timesteps)
    x, v = np.float32([[1.0, -2.0]]), np.float32([[0.5, 4.0]])
    got = np.asarray(s.step(1, jnp.asarray(v), jnp.asarray(x)))
    np.testing.assert_allclose(got, x + (want.sigmas[2] - want.sigmas[1]) * v, rtol=1e-6)


# --------------------------------------------------------------------------
# The bench's loop (difflet_tpu.pipeline.denoise) with UniPC
# --------------------------------------------------------------------------


def _toy(pipeline, runners=None, steps=5, guidance=1.0, mesh=True):
    from flax import nnx

    from difflet_tpu.config import Config
    from difflet_tpu.parallel.mesh import make_mesh
    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.runner import Runner
    from difflet_tpu.testing import register_toy_port

    port = register_toy_port()
    cfg = port.config_from_diffusers(port.presets["tiny"])
    inputs = port.example_inputs(cfg, batch=1, seed=0)
    cfg_inputs = None
    if pipeline.guidance_mode == "cfg":
        cfg_inputs = port.example_inputs(cfg, batch=2, seed=1)
        cfg_inputs["hidden_states"] = np.concatenate([inputs["hidden_states"]] * 2)
    if runners is None:
        runners = [Runner(port.build(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), make_mesh(4) if mesh else None,
                          Config(), mode="tp" if mesh else None)]
    return PL.Denoiser(pipeline, runners, inputs, pipeline.schedule(steps, inputs, "tiny"), guidance=guidance,
                       cfg_inputs=cfg_inputs, dtype=jnp.float32)


def _unipc_pipeline(**kw):
    from difflet_tpu.testing import register_toy_port

    return dataclasses.replace(register_toy_port().pipeline, schedule=lambda steps, inputs, preset:
                               wan.schedule(steps, 5.0), **kw)


def test_the_denoiser_steps_with_unipc_and_cfg():
    """CFG's guided velocity u + g (c - u), then UniPC: the loop's latents are the sampler's run
    on that velocity (a fake transformer whose halves are 0.5 x and 2 x + e)."""
    e = np.random.default_rng(0).standard_normal((1, 4, 3)).astype(np.float32)

    class Fake:
        def __call__(self, hidden_states, timestep, return_dict=True):
            h = np.asarray(hidden_states)
            b = h.shape[0] // 2
            return (np.concatenate([0.5 * h[:b], 2.0 * h[b:] + e]),)

    den = _toy(_unipc_pipeline(guidance_mode="cfg"), runners=[Fake()], steps=6, guidance=3.0)
    den.latents0["hidden_states"] = np.random.default_rng(1).standard_normal((1, 4, 3)).astype(np.float32)
    final, _ = den.run()
    ref, x = wan.schedule(6, 5.0), jnp.asarray(den.latents0["hidden_states"])
    for i in range(6):
        u, c = 0.5 * x, 2.0 * x + e
        x = ref.step(i, u + 3.0 * (c - u), x)
    np.testing.assert_allclose(final["hidden_states"], np.asarray(x), rtol=1e-6, atol=1e-6)
    # and that is not what Euler gives
    euler = S.flow_match_euler(S.SchedulerConfig(shift=5.0), 6)
    y = den.latents0["hidden_states"]
    for i in range(6):
        y = y + euler.dt(i) * (0.5 * y + 3.0 * (1.5 * y + e))
    assert np.abs(y - final["hidden_states"]).max() > 1e-2


@pytest.mark.parametrize("mesh", [True, False], ids=["mesh4", "one_device"])
def test_the_unipc_denoiser_compiles_once(mesh):
    from difflet_tpu.pipeline import denoise as PL

    den = _toy(_unipc_pipeline(), steps=5, mesh=mesh)
    den.warmup(2)
    before = PL.CompileCounter.count()
    final, times = den.run()
    assert PL.CompileCounter.count() == before, "a UniPC denoise step recompiled"
    assert len(times) == 5 and np.isfinite(final["hidden_states"]).all()
    assert final["hidden_states"].dtype == np.float32
