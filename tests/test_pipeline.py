"""Schedules against diffusers' arrays, the Euler loop, CFG and the compile-once rule."""

import json
import pathlib

import numpy as np
import pytest

from difflet_tpu import schedulers as S

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "schedulers" / "schedules.json"


def _ours(case):
    name, steps = case["name"], case["steps"]
    kind, arg = name.split("_")[0], name.split("_")[-1]
    if kind == "flux":
        return S.flux_schedule(steps, int(arg))
    if kind == "wan":
        return S.wan_schedule(steps, float(arg))
    if kind == "hunyuan":
        return S.hunyuan_video_schedule(steps)
    if kind == "ltx2":
        return S.ltx2_schedule(steps, int(arg))
    return S.flow_match_euler(S.SchedulerConfig(**case["config"]), steps,
                              sigmas=np.linspace(1.0, 1 / steps, steps), mu=case["mu"])


@pytest.mark.parametrize("case", json.loads(FIXTURE.read_text())["cases"], ids=lambda c: c["name"])
def test_schedules_match_diffusers(case):
    ours = _ours(case)
    np.testing.assert_allclose(ours.timesteps, case["timesteps"], rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(ours.sigmas, case["sigmas"], rtol=1e-6, atol=1e-7)
    assert len(ours) == case["steps"] and ours.sigmas[-1] == 0


def test_wan22_expert_switch_at_the_boundary():
    sch = S.wan_schedule(40, 12.0)
    experts = [S.wan22_expert(t, 0.875) for t in sch.timesteps]
    k = experts.index(1)
    assert experts == [0] * k + [1] * (40 - k)  # one switch, high noise first
    assert sch.timesteps[k - 1] >= 875 > sch.timesteps[k]
    assert all(S.wan22_expert(t, None) == 0 for t in sch.timesteps)
