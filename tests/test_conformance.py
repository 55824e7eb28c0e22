"""One conformance suite for every port (difflet_tpu.models.PORTS), on the one Runner.

Every diffusers fixture case (tests/fixtures/<case>/: `transformer/` whose
config.json `_class_name` names the port, `io.npz` with the forward kwargs and
diffusers' float32 outputs) is loaded by `loading.load_transformer` and run by
`difflet_tpu.runner.Runner` with `Config(check_vma=True)` (so an output declared
replicated that differs by rank fails to trace), and must match diffusers at
relative L2 <= 1e-5 in float32:

* on one device; under TP and under SP on 2 and on 4 CPU devices (a head count
  the ranks cannot divide is skipped, with the reason);
* under "sp-xla" (plain collectives) on 4 devices, one padded case per port;
* SP equals TP on 4 devices where SP pads the token streams (reusing those runs);
* wrong inputs raise ValueError before anything compiles (XLA compile events
  counted), as do head counts and unsplittable streams the mesh cannot take;
* an output spec that lies (SP rows declared replicated) fails under check_vma;
* slow: the released config of each port compiles deviceless for a v5e 2x2 at
  its benchmark shape (`PortSpec.bench_shape`), bf16, TP and SP, and fits the
  chip's 16 GiB of HBM.

Model-specific mechanisms (float64 ablations, kernels, caches) stay in
tests/models/test_<port>.py. Compiles use XLA's CPU optimisation level 0 to keep
the suite fast; the numbers do not depend on it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from difflet_tpu import models
from difflet_tpu.tools import deviceless
from difflet_tpu import loading
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.pipeline.denoise import CompileCounter
from difflet_tpu.runner import Runner
from difflet_tpu.testing import read_fixture_io, rel_l2

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
TOL = 1e-5
FAST = {"xla_backend_optimization_level": 0}
VMA = Config(check_vma=True)
OUTPUTS = ("sample", "audio_sample")  # diffusers' output fields, in the order the Runner returns them


def _fixture_cases() -> dict:
    """case -> port name, for every fixture directory holding a transformer."""
    out = {}
    for d in sorted(FIXTURES.iterdir()):
        config = d / "transformer" / "config.json"
        if config.is_file():
            out[d.name] = models.spec_for_class(json.loads(config.read_text())["_class_name"]).name
    return out


CASES = _fixture_cases()
# One case per port whose token streams SP pads on 4 devices (not a multiple of 2P = 8).
PADDED = {"flux": "flux_pad", "wan": "wan_t2v_pad", "hunyuan_video": "hunyuan_video_masks", "ltx2": "ltx2_pad",
          "qwen_image": "qwen_image_pad"}


# --------------------------------------------------------------------------
# Shared helpers (module-level caches: one load and one compile per combination)
# --------------------------------------------------------------------------

def spec_of(case):
    return models.spec(CASES[case])


@functools.lru_cache(maxsize=None)
def fixture(case):
    """(diffusers forward kwargs, expected outputs as a tuple)."""
    kwargs, out = read_fixture_io(FIXTURES / case)
    return kwargs, tuple(out[k] for k in OUTPUTS if k in out)


@functools.lru_cache(maxsize=None)
def diffusers_config(case) -> dict:
    return json.loads((FIXTURES / case / "transformer" / "config.json").read_text())


@functools.lru_cache(maxsize=None)
def mesh(tp):
    return None if tp is None else make_mesh(tp)


def _model_key(case):
    """Cases with the same config and weights file share one loaded model."""
    weights_file = (FIXTURES / case / "transformer" / "diffusion_pytorch_model.safetensors").resolve()
    return json.dumps(diffusers_config(case), sort_keys=True), str(weights_file)


@functools.lru_cache(maxsize=None)
def _load(key, case, tp):
    return loading.load_transformer(FIXTURES / case / "transformer", dtype=jnp.float32, mesh=mesh(tp))


def model(case, tp=None):
    return _load(_model_key(case), case, tp)


@functools.lru_cache(maxsize=None)
def _runner(key, case, tp, mode):
    return Runner(_load(key, case, tp), mesh(tp), VMA, mode, compiler_options=FAST)


def runner(case, tp=None, mode=None):
    """A float32 check_vma Runner (cached with its compiled steps)."""
    return _runner(_model_key(case), case, tp, mode)


@functools.lru_cache(maxsize=None)
def outputs(case, tp=None, mode=None):
    """The Runner's outputs on the fixture kwargs, as a tuple of numpy arrays (diffusers'
    output object with `return_dict=True`, its fields in order)."""
    out = runner(case, tp, mode)(**fixture(case)[0])
    assert hasattr(out, "sample") and not isinstance(out, tuple), type(out)
    return tuple(np.asarray(o) for o in out.to_tuple())


def assert_close(got, want, tol=TOL):
    assert len(got) == len(want)
    for name, g, w in zip(OUTPUTS, got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert g.dtype == np.float32, (name, g.dtype)
        err = rel_l2(g, w)
        assert err <= tol, f"{name}: rel L2 {err:.3e} > {tol}"


def skip_unless_divisible(case, tp):
    """Skips a combination whose head counts the `tp` ranks cannot divide."""
    spec = spec_of(case)
    heads = spec.heads(spec.config_from_diffusers(diffusers_config(case)))
    bad = {name: n for name, n in heads.items() if n % tp}
    if bad:
        pytest.skip(f"{case}: {bad} heads do not divide over tp={tp} (TP and SP split attention heads)")


@pytest.fixture(scope="module", autouse=True)
def _free_caches():
    """The loaded models and compiled steps live for this module only."""
    yield
    for f in (fixture, diffusers_config, mesh, _load, _runner, outputs):
        f.cache_clear()


def test_every_port_has_fixtures_and_a_padded_case():
    assert set(CASES.values()) == set(models.PORTS)
    assert set(PADDED) == set(models.PORTS) and all(CASES[c] == p for p, c in PADDED.items())


# --------------------------------------------------------------------------
# Parity with diffusers (float32, check_vma on)
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_parity_one_device(case):
    assert_close(outputs(case), fixture(case)[1])


@pytest.mark.parametrize("mode", ["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_parity_tp_sp(case, tp, mode):
    skip_unless_divisible(case, tp)
    assert_close(outputs(case, tp, mode), fixture(case)[1])


@pytest.mark.parametrize("port", models.PORTS)
def test_parity_sp_xla(port):
    case = PADDED[port]
    skip_unless_divisible(case, 4)
    assert_close(outputs(case, 4, "sp-xla"), fixture(case)[1])


def _row_counts(prep):
    return {k: np.shape(v)[1] for k, v in prep.inputs.items() if np.ndim(v) >= 2}


@pytest.mark.parametrize("port", models.PORTS)
def test_sp_matches_tp_at_padded_counts(port):
    """On 4 devices SP pads a stream of the case (so the compiled shapes differ from
    TP's) and still equals TP; the pad rows are cut off again."""
    case = PADDED[port]
    skip_unless_divisible(case, 4)
    kwargs, ref = fixture(case)
    sp, tp = runner(case, 4, "sp"), runner(case, 4, "tp")
    assert sp.row_multiple() == 8 and tp.row_multiple() == 1
    sp_rows, tp_rows = _row_counts(sp.prepare(kwargs)), _row_counts(tp.prepare(kwargs))
    padded = {k: (tp_rows[k], sp_rows[k]) for k in sp_rows if k in tp_rows and sp_rows[k] != tp_rows[k]}
    assert padded, f"{case}: SP pads nothing ({sp_rows})"
    assert all(n_sp % 8 == 0 and n_sp > n_tp for n_tp, n_sp in padded.values()), padded
    got, want = outputs(case, 4, "sp"), outputs(case, 4, "tp")
    assert [g.shape for g in got] == [r.shape for r in ref]
    assert_close(got, want)


# --------------------------------------------------------------------------
# Errors before compilation; check_vma catches an output spec that lies
# --------------------------------------------------------------------------

def _bad_hidden_states(hs):
    """Shapes no port accepts: an extra axis, no batch axis, the last axis one short."""
    return {"an extra axis": hs[None], "no batch axis": hs[0], "the last axis one short": hs[..., :-1]}


@pytest.mark.parametrize("port", models.PORTS)
def test_errors_before_compilation(port):
    case = PADDED[port]
    kwargs, _ = fixture(case)
    m4 = model(case, 4)
    before = CompileCounter.count()
    for tp, mode in ((None, None), (4, "sp")):
        r = Runner(model(case, tp), mesh(tp), VMA, mode, compiler_options=FAST)
        for what, hs in _bad_hidden_states(kwargs["hidden_states"]).items():
            with pytest.raises(ValueError, match="hidden_states"):
                r(**{**kwargs, "hidden_states": hs}).sample
        assert not r._steps, f"{port} {mode}: a step was built for a bad input"
    with pytest.raises(ValueError, match=r"cannot split \d+ .* over tp=4"):
        Runner(m4, mesh(4), VMA, "sp", pad=False, compiler_options=FAST)(**kwargs).sample
    with pytest.raises(ValueError, match="heads do not divide over tp=3"):
        Runner(model(case), make_mesh(3), VMA, "tp")
    assert CompileCounter.count() == before, "an XLA compile ran before the error"


@pytest.mark.parametrize("port", models.PORTS)
def test_check_vma_refuses_sp_rows_declared_replicated(port):
    """SP outputs are this rank's rows; declared replicated (`P()`), check_vma refuses
    to trace the step. Without the check the lie would return rank 0's rows."""
    case = PADDED[port]
    kwargs, _ = fixture(case)
    r = Runner(model(case, 2), mesh(2), VMA, "sp", compiler_options=FAST)
    prepare = r.prepare

    def lying(kw):
        prep = prepare(kw)
        return dataclasses.replace(prep, out_specs=jax.tree.map(lambda _: P(), prep.out_specs,
                                                                is_leaf=lambda x: isinstance(x, P)))

    r.prepare = lying
    with pytest.raises(ValueError, match=r"out_specs.*replicated"):
        r(**kwargs).sample


# --------------------------------------------------------------------------
# Deviceless v5e 2x2 compile of each released config at its benchmark shape
# --------------------------------------------------------------------------

DEVICELESS = """
import json, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from difflet_tpu import models, runtime
from difflet_tpu.tools import deviceless
from difflet_tpu.config import Config
from difflet_tpu.runner import Runner

spec = models.spec(PORT)
cfg = spec.config_from_diffusers(spec.presets[spec.released])
mesh = deviceless.topology_mesh("v5e:2x2")
model = runtime.abstract_model(lambda: spec.build(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), mesh, spec.plan)
params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
shape = SHAPE or spec.bench_shape

def abstract(name, v):  # activations in bf16; timesteps, ids, masks and scalars as made
    if not isinstance(v, np.ndarray):
        return v
    bf16 = np.issubdtype(v.dtype, np.floating) and ("hidden_states" in name or name == "pooled_projections")
    return jax.ShapeDtypeStruct(v.shape, jnp.bfloat16 if bf16 else v.dtype)

inputs = {k: abstract(k, v) for k, v in spec.example_inputs(cfg, **shape).items()}
out = dict(params=params, shape=shape, preset=spec.released)
for mode in MODES:
    t = time.time()
    r = Runner(model, mesh, Config(check_vma=True, sp_kernel=SP_KERNEL), mode)
    compiled = r.trace(**inputs).lower().compile()
    out[mode] = dict(deviceless.memory_report(compiled), seconds=round(time.time() - t, 1),
                     kernels=compiled.as_text().count("tpu_custom_call"),
                     attn_impl=r.par.attn_impl, ag_impl=r.par.ag_impl,
                     # the weights the Runner's plan replicates beyond the port's PLAN (its
                     # sp_local_plan under SP with Config.sp_cross_local: Wan's cross-attention,
                     # LTX-2's audio-to-video attention)
                     extra_replicated=runtime.tree_bytes_per_device(r._state) - runtime.bytes_per_device(model))
print(json.dumps(out))
"""


def deviceless_report(port, shape=None, modes=("tp", "sp"), sp_kernel="jax"):
    """HBM per chip (bytes, `deviceless.memory_report`) of the released config's step,
    bf16, compiled deviceless for a v5e 2x2 with check_vma on, per mode; `shape` is
    example_inputs' (height, width, frames) dict (default: the port's bench_shape).
    Also for measuring other shapes by hand, e.g. HunyuanVideo at 720x1280x129."""
    code = (DEVICELESS.replace("PORT", repr(port)).replace("SHAPE", repr(shape))
            .replace("MODES", repr(tuple(modes))).replace("SP_KERNEL", repr(sp_kernel)))
    return deviceless.run_python(code, "v5e:2x2", timeout=2400)


@pytest.mark.slow
@pytest.mark.parametrize("port", ["hunyuan_video", "ltx2", "qwen_image"])
def test_deviceless_v5e_2x2_compile_fits(port, monkeypatch):
    """The released config at its benchmark shape under SP (the JAX rings: a port's
    Pallas all-gather default adds minutes of Mosaic compile at these sizes;
    tests/kernels compiles the kernels at the ports' shapes): compiles with splash
    attention inside, the big weights sharded, and arguments + temporaries fit in
    a v5e chip's 16 GiB. One real-size compile per mechanism, to keep the suite within
    its time budget: HunyuanVideo's dual- and single-stream blocks (FLUX.1's too), LTX-2's
    audio-video streams, Qwen-Image's 20B of weights; Wan's step compiles at real size in
    tests/test_check.py (tp, sp and sp-pallas), and every port's HBM is in the compile-only
    table (benchmark/results/*.json). SP only: TP's
    HBM per chip at the same shapes is in the compile-only table
    (benchmark/results/*.json, docs/benchmarks.md), and TP's plan is checked on
    CPU devices by the parity cases above; `deviceless_report(port, modes=("tp",))`
    compiles it by hand."""
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other engineers' deviceless compiles
    out = deviceless_report(port, modes=("sp",))
    gib = 2 ** 30
    weight_bytes = 2 * out["params"]
    for mode in ("sp",):
        rep = out[mode]
        hbm = rep["arguments"] + rep["temporaries"]
        print(f"\n{out['preset']} {out['shape']} bf16 v5e:2x2 {mode}: arguments {rep['arguments'] / gib:.2f} GiB"
              f" + temporaries {rep['temporaries'] / gib:.2f} GiB = {hbm / gib:.2f} GiB per chip "
              f"({out['params'] / 1e9:.2f} B params; attention {rep['attn_impl']}, {rep['kernels']} Pallas calls, "
              f"AG {rep['ag_impl']}; {rep['seconds']} s)")
        assert hbm < 16 * gib
        # the big linears (adaLN too) are sharded over the 4 chips: a quarter of the weights
        # per chip plus small replicated ones (0.25-0.27 of them measured; FLUX's adaLN,
        # 27% of its weights, left replicated would make it 0.46)
        # (plus what the Runner's plan replicates beyond PLAN under SP with Config.sp_cross_local:
        # Wan's attn2 to_q / to_out, 15% of its weights; LTX-2's audio_to_video_attn q / out)
        assert weight_bytes / 4 <= rep["arguments"] < 0.29 * weight_bytes + rep["extra_replicated"]
        assert rep["extra_replicated"] < 0.12 * weight_bytes
        assert rep["attn_impl"] == "splash" and rep["kernels"] >= 1
