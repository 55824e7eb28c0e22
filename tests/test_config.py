import dataclasses
import os

import pytest

from difflet_tpu.parallel import chips
from difflet_tpu.config import ENV_VARS, Config, ConfigError

TILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "kernel_tiles_cpu.json")
GOOD = {
    "DIFFLET_TPU_SP": [("0", False), ("1", True)],
    "DIFFLET_TPU_SP_KERNEL": [("jax", "jax"), ("pallas", "pallas"), ("PALLAS", "pallas")],
    "DIFFLET_TPU_SP_RS_KERNEL": [("jax", "jax"), ("pallas", "pallas"), ("auto", "auto")],
    "DIFFLET_TPU_SP_AG_ASSEMBLE": [("concat", "concat"), ("dus", "dus")],
    "DIFFLET_TPU_SP_SINGLE": [("0", False), ("1", True)],
    "DIFFLET_TPU_SP_CROSS_LOCAL": [("0", False), ("1", True)],
    "DIFFLET_TPU_SP_PAD": [("0", False), ("1", True)],
    "DIFFLET_TPU_CHECK_VMA": [("0", False), ("1", True)],
    "DIFFLET_TPU_SPLIT_ROPE": [("0", False), ("1", True)],
    "DIFFLET_TPU_COMPILE_CACHE": [("/tmp/jax-cache", "/tmp/jax-cache"), (" cache ", "cache")],
    "DIFFLET_TPU_MESH": [("cfg=2,tp=4", "cfg=2,tp=4"), ("tp=4, cfg=2", "cfg=2,tp=4"), ("tp=8", "tp=8"),
                         ("cfg=2,data=2,tp=4", "cfg=2,data=2,tp=4")],
    "DIFFLET_TPU_EXPERT_OFFLOAD": [("auto", "auto"), ("on", "on"), ("off", "off"), ("ON", "on")],
    "DIFFLET_TPU_ENCODER_OFFLOAD": [("auto", "auto"), ("on", "on"), ("off", "off"), ("Off", "off")],
    "DIFFLET_TPU_TRANSFORMER_OFFLOAD": [("auto", "auto"), ("on", "on"), ("OFF", "off")],
    "DIFFLET_TPU_ENCODER_STREAM": [("auto", "auto"), ("On", "on"), ("off", "off")],
    "DIFFLET_TPU_KERNEL_TILES": [(TILES, TILES), (f" {TILES} ", TILES)],
    "DIFFLET_TPU_VAE_SPREAD": [("auto", "auto"), ("on", "on"), ("off", "off"), ("On", "on")],
    "DIFFLET_TPU_TEXT_TRIM": [("0", False), ("1", True)],
    "DIFFLET_TPU_STEP_CACHE": [("off", None), ("", None), ("first-block", "first-block:threshold=0.08,warmup=2,"
                                                            "max_skips=3,first=1,last=0"),
                               (" first-block: threshold=0.1, last=1 ", "first-block:threshold=0.1,warmup=2,"
                                                                         "max_skips=3,first=1,last=1")],
}
BAD = {
    "DIFFLET_TPU_SP": ["2", "yes", "true", ""],
    "DIFFLET_TPU_SP_KERNEL": ["triton", "", "1"],
    "DIFFLET_TPU_SP_RS_KERNEL": ["xla", "0"],
    "DIFFLET_TPU_SP_AG_ASSEMBLE": ["stack", ""],
    "DIFFLET_TPU_SP_SINGLE": ["on"],
    "DIFFLET_TPU_SP_CROSS_LOCAL": ["yes", ""],
    "DIFFLET_TPU_SP_PAD": ["-1"],
    "DIFFLET_TPU_CHECK_VMA": ["yes"],
    "DIFFLET_TPU_SPLIT_ROPE": ["off"],
    "DIFFLET_TPU_COMPILE_CACHE": ["", " ", "gs://bucket/cache"],
    "DIFFLET_TPU_MESH": ["", "cfg=2,tp=0", "dp=2,tp=2", "tp=4,tp=2", "cfg:2,tp:4", "tp=x"],
    "DIFFLET_TPU_EXPERT_OFFLOAD": ["1", "", "host", "cpu"],
    "DIFFLET_TPU_ENCODER_OFFLOAD": ["1", "", "host"],
    "DIFFLET_TPU_TRANSFORMER_OFFLOAD": ["yes", "", "host"],
    "DIFFLET_TPU_ENCODER_STREAM": ["1", "", "stream"],
    "DIFFLET_TPU_KERNEL_TILES": ["", "/nonexistent/tiles.json", os.path.dirname(TILES)],
    "DIFFLET_TPU_VAE_SPREAD": ["1", "", "height"],
    "DIFFLET_TPU_TEXT_TRIM": ["on", "", "true"],
    "DIFFLET_TPU_STEP_CACHE": ["teacache", "first-block:threshold=x", "first-block:warmup=0", "first-block:speed=1"],
}


def test_every_variable_is_covered():
    assert set(GOOD) == set(ENV_VARS) == set(BAD)


def test_defaults():
    c = Config.from_env({})
    assert (c.sp, c.sp_kernel, c.sp_rs_kernel, c.sp_ag_assemble, c.sp_single, c.sp_pad, c.check_vma, c.split_rope) == (
        False, None, "auto", "concat", True, True, False, True)
    assert c.expert_offload == "auto" and c.sp_cross_local is True
    assert c.text_trim is False  # diffusers' padded Gemma-3 encode unless asked
    with pytest.raises(ConfigError, match="text_trim"):
        Config(text_trim=1)
    with pytest.raises(ConfigError, match="expert_offload"):
        Config(expert_offload=True)


def test_rs_kernel_auto_is_the_ring_off_tpu():
    c = Config()
    v5e = chips.CHIPS["v5e"]
    assert (c.rs_kernel("tpu", v5e), c.rs_kernel("cpu", None), c.rs_kernel("tpu", None)) == ("auto", "jax", "jax")
    assert Config(sp_rs_kernel="pallas").rs_kernel("cpu", None) == "pallas"  # explicit: interpreted off TPU


@pytest.mark.parametrize("var", sorted(GOOD))
def test_good_values(var):
    field = ENV_VARS[var][0]
    for raw, parsed in GOOD[var]:
        assert getattr(Config.from_env({var: raw}), field) == parsed


@pytest.mark.parametrize("var", sorted(BAD))
def test_bad_values_name_variable_value_and_choices(var):
    for raw in BAD[var]:
        with pytest.raises(ConfigError) as e:
            Config.from_env({var: raw})
        msg = str(e.value)
        assert var in msg and repr(raw) in msg and "use one of" in msg


def test_unknown_variable_is_an_error():
    with pytest.raises(ConfigError, match="DIFFLET_TPU_SPP"):
        Config.from_env({"DIFFLET_TPU_SPP": "1"})


def test_other_variables_ignored_and_overrides_win():
    c = Config.from_env({"DIFFLET_TPU_SP": "1", "PATH": "/x"}, sp=False, sp_kernel="pallas")
    assert c.sp is False and c.sp_kernel == "pallas"
    with pytest.raises(ConfigError):
        Config.from_env({}, sp_kernel="cuda")
    with pytest.raises(ConfigError):
        Config.from_env({}, nonsense=1)


def test_frozen_and_kernel_choice():
    c = Config.from_env({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.sp = True
    assert c.ag_kernel("pallas", "tpu") == "pallas"
    assert c.ag_kernel("pallas", "cpu") == "jax"
    assert Config(sp_kernel="pallas").ag_kernel("jax", "cpu") == "pallas"


def test_mesh_setting():
    c = Config.from_env({"DIFFLET_TPU_MESH": "tp=4,cfg=2"})
    assert c.mesh == "cfg=2,tp=4" and c.mesh_axes() == {"cfg": 2, "tp": 4}
    assert Config().mesh is None and Config().mesh_axes() is None
    assert Config(mesh="data=2, tp=2").mesh == "data=2,tp=2"
    with pytest.raises(ConfigError, match="unknown axis 'pp'"):
        Config(mesh="pp=2,tp=2")
