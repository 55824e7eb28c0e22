"""Bad inputs, one table: each row is a case a demanding user tries and the clear message
(or the clean one-line recovery) it must give, on the bench CLI, the loader, the port
configs, the orbax cache and the Runners.

`CASES` is the table; `test_bad_input` runs every row (`pytest -v` lists them by id,
`test_table` prints the count per surface). Rules the rows check beyond the message:

* CLI rows: exit status 2 for input refused before any work, 1 for a run that failed
  (non-finite latents), and never 0 for anything wrong;
* loader rows: the error comes before any tensor is read (`Checkpoint.read` fails the
  test if it is called);
* cache rows: a damaged entry is one warning line and a re-conversion with the right
  values, never a wrong load and never a traceback.

docs/loading.md ("What is validated") and docs/benchmarks.md list what is checked and
what is not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import pathlib
import re
import shutil
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from difflet_tpu.bench import cases, report, run as bench_run
from difflet_tpu.bench import cli as bench_cli
from difflet_tpu.loading import cache as checkpoint
from difflet_tpu import loading
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.testing import read_fixture_io
from difflet_tpu.loading.checkpoint import WeightsError

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
WAN_T2V = FIXTURES / "wan_t2v" / "transformer"
WAN_I2V = FIXTURES / "wan_i2v" / "transformer"

# The toy port and checkpoint writer of test_weights.py (tests are not a package).
_spec = importlib.util.spec_from_file_location("_difflet_toy_port",
                                               pathlib.Path(__file__).with_name("test_weights.py"))
tw = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(tw)


@dataclasses.dataclass
class Ctx:
    tmp: pathlib.Path
    monkeypatch: pytest.MonkeyPatch
    capsys: pytest.CaptureFixture
    caplog: pytest.LogCaptureFixture


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    surface: str                # cli, loader, config, cache, runner, parallel, generate, check, pipeline
    run: Callable[[Ctx], str]   # performs the case, returns the text the user sees
    expect: str                 # a regex the text must match


@pytest.fixture
def ctx(tmp_path, monkeypatch, capsys, caplog):
    tw.register(monkeypatch, tw.TOY_PORT)
    return Ctx(tmp_path, monkeypatch, capsys, caplog)


# --------------------------------------------------------------------------
# Row builders
# --------------------------------------------------------------------------

def cli(*argv, code=2, setup=None):
    """`python -m difflet_tpu.bench ARGV` exits with `code`; returns its stderr.
    `{tmp}` in an argument is the test's tmp directory; `setup(ctx)` prepares files."""

    def run(c: Ctx):
        if setup is not None:
            setup(c)
        args = [a.format(tmp=c.tmp) for a in argv]
        try:
            rc = bench_cli.main(args)
        except SystemExit as e:
            rc = e.code
        out = c.capsys.readouterr()
        assert rc == code, (rc, out.err[-2000:])
        return out.err

    return run


def loads(setup, **kwargs):
    """`load_transformer(setup(ctx), **kwargs)` raises WeightsError before reading any tensor."""

    def run(c: Ctx):
        path = setup(c)

        def no_read(*a, **k):
            raise AssertionError("a tensor was read before the error")

        c.monkeypatch.setattr(loading.Checkpoint, "read", no_read)
        kw = {k: (v(c) if callable(v) and k == "cache_dir" else v) for k, v in kwargs.items()}
        kw.setdefault("config", Config())
        with pytest.raises(WeightsError) as e:
            loading.load_transformer(path, **kw)
        return str(e.value)

    return run


def port_config(module, change):
    """`config_from_diffusers(PRESETS["tiny"] | change)` raises ValueError."""

    def run(c: Ctx):
        port = importlib.import_module(f"difflet_tpu.models.{module}")
        with pytest.raises(ValueError) as e:
            port.config_from_diffusers({**port.PRESETS["tiny"], **change})
        return str(e.value)

    return run


# --------------------------------------------------------------------------
# Files the rows use
# --------------------------------------------------------------------------

def toy(c: Ctx, tensors=None, **kw) -> pathlib.Path:
    return tw.write_checkpoint(c.tmp / "toy", tensors if tensors is not None else tw.torch_weights(), **kw)


def toy_with(key, array):
    def setup(c):
        t = tw.torch_weights()
        t[key] = array(t[key])
        return toy(c, t)

    return setup


def toy_index(names):
    """A sharded toy checkpoint whose index names `names` (shard file -> new name)."""

    def setup(c):
        path = toy(c, sharded=True)
        index = json.loads((path / loading.INDEX_FILE).read_text())
        wm = {k: names.get(f, f).format(tmp=c.tmp) for k, f in index["weight_map"].items()}
        (path / loading.INDEX_FILE).write_text(json.dumps({**index, "weight_map": wm}))
        return path

    return setup


def toy_config(cfg):
    def setup(c):
        path = toy(c)
        (path / "config.json").write_text(json.dumps(cfg))
        return path

    return setup


def wan_config(**change):
    def setup(c):
        path = c.tmp / "wan"
        shutil.copytree(WAN_T2V, path)
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **change}))
        return path

    return setup


def toy_heads(c):
    cfg = {**tw.DIFFUSERS_CONFIG, "num_attention_heads": 6, "attention_head_dim": 8}  # dim 48 divides by 4
    return tw.write_checkpoint(c.tmp / "t6", tw.torch_weights(cfg=cfg), cfg=cfg)


def embeddings(name, arrays):
    def setup(c):
        path = c.tmp / name
        if name.endswith(".npz"):
            np.savez(path, **arrays)
        else:
            save_file(arrays, str(path))

    return setup


def garbage(name):
    def setup(c):
        (c.tmp / name).write_bytes(b"\x00not a file of that kind" * 10)

    return setup


def a_file(name):
    def setup(c):
        (c.tmp / name).write_text("a file, not a directory")

    return setup


WAN_TEXT = np.zeros((1, 512, 24), np.float32)  # wan:tiny's prompt_embeds
NAN_TEXT = WAN_TEXT.copy()
NAN_TEXT[0, 3, 4] = np.nan
INF_TEXT = WAN_TEXT.copy()
INF_TEXT[0, 0, 0] = np.inf


def two_experts(c):
    (c.tmp / "pipe" / "transformer").mkdir(parents=True)
    (c.tmp / "pipe" / "transformer_2").mkdir()


def sd3_dir(c):
    (c.tmp / "sd3").mkdir()
    (c.tmp / "sd3" / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))


def small_host(c):
    c.monkeypatch.setattr(bench_run, "host_memory_bytes", lambda: 16 * 2**30)


def two_expert_toy_without_host_memory(c):
    from difflet_tpu import runtime
    from difflet_tpu.testing import register_toy_port

    c.monkeypatch.setitem(register_toy_port().experts, "tiny", 0.5)
    c.monkeypatch.setattr(runtime, "host_memory_kind", lambda devices: None)


def offload_env(value):
    return lambda c: c.monkeypatch.setenv("DIFFLET_TPU_EXPERT_OFFLOAD", value)


# --------------------------------------------------------------------------
# Custom rows (each returns what the user sees)
# --------------------------------------------------------------------------

def nan_latents_fail_the_row(c: Ctx) -> str:
    """A model whose latents end non-finite: a failed row, exit 1, the JSON still valid JSON."""
    import dataclasses

    from difflet_tpu import models
    from difflet_tpu.testing import register_toy_port

    toy_spec = register_toy_port()

    def nan_inputs(*a, **k):
        out = toy_spec.example_inputs(*a, **k)
        out["hidden_states"][0, 0, 0] = np.nan
        return out

    c.monkeypatch.setattr(models, "_EXTRA", [dataclasses.replace(toy_spec, example_inputs=nan_inputs)])
    out = c.tmp / "r.json"
    rc = bench_cli.main(["--model", "toy:tiny", "--mode", "tp,sp", "--steps", "2", "--json", str(out)])
    text = c.capsys.readouterr().out
    assert rc == 1
    data = json.loads(out.read_text(), parse_constant=lambda s: pytest.fail(f"bare {s} in the JSON"))
    rows = data["results"]
    assert [r["mode"] for r in rows] == ["tp", "sp"]
    assert all(r["sha256"] is None and r["error"].startswith("NonFiniteError") for r in rows)
    assert all("vs_tp" not in r for r in rows)
    return text


def weights_without_model(c: Ctx) -> str:
    """`--weights DIR` without `--model` runs the checkpoint's model, not every port's."""
    args = bench_cli.parser().parse_args(["--weights", str(WAN_T2V)])
    args.cpu = True
    assert [(spec.name, preset) for spec, preset in cases.resolve_models(args)] == [("wan", "tiny")]
    return c.capsys.readouterr().err


def int8_is_refused_not_loaded(c: Ctx) -> str:
    t = tw.torch_weights()
    t["proj_out.weight"] = np.round(t["proj_out.weight"] * 40).astype(np.int8)
    path = toy(c, t)
    with pytest.raises(WeightsError) as e:
        loading.load_transformer(path, dtype=jnp.float32, config=Config())
    return str(e.value)


def float16_converts(c: Ctx) -> str:
    """Float kinds convert: an F16 tensor loads as the float32 of its values."""
    t = tw.torch_weights()
    t["proj_out.weight"] = t["proj_out.weight"].astype(np.float16)
    model = loading.load_transformer(toy(c, t), dtype=jnp.float32, config=Config())
    got = np.asarray(tw.flat_params(model)["proj_out.kernel"])
    np.testing.assert_array_equal(got, t["proj_out.weight"].astype(np.float32).T)
    return "F16 converted"


def _cached_toy(c: Ctx, damage):
    """Loads a toy checkpoint through the cache, damages the entry's largest data file,
    loads again: returns (warnings logged, reads of the second load, the second model)."""
    tensors = tw.torch_weights()
    path = toy(c, tensors)
    cache = c.tmp / "cache"
    loading.load_transformer(path, dtype=jnp.float32, config=Config(), cache_dir=cache)
    (entry,) = [d for d in cache.iterdir() if not d.name.startswith(".")]
    data = max((f for f in (entry / checkpoint.PARAMS_DIR).rglob("*") if f.is_file() and "/d/" in str(f)),
               key=lambda f: f.stat().st_size)
    data.write_bytes(damage(bytearray(data.read_bytes())))
    reads = []
    orig = loading.Checkpoint.read
    c.monkeypatch.setattr(loading.Checkpoint, "read", lambda self, *a, **k: reads.append(1) or orig(self, *a, **k))
    c.caplog.clear()
    with c.caplog.at_level(logging.WARNING):
        model = loading.load_transformer(path, dtype=jnp.float32, config=Config(), cache_dir=cache)
    tw.assert_loaded(model, tw.expected_params(tensors))  # right values, whatever the damage
    warnings = [r.getMessage() for r in c.caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert reads, "the damaged entry was restored instead of converted again"
    return warnings[0]


def flip(bit_at=0.5, n=1):
    def damage(b: bytearray) -> bytes:
        i = int(len(b) * bit_at)
        for j in range(n):
            b[i + j] ^= 0x10
        return bytes(b)

    return damage


def restore_error_is_one_line(c: Ctx) -> str:
    """A restore that fails although the digest matched (e.g. a store error): one line, no traceback."""
    import gc

    c.monkeypatch.setattr(checkpoint, "_data_problem", lambda d, meta: None)  # the digest is not consulted
    unraisable = []  # what Python would print as "Exception ignored in <coroutine ...>" tracebacks
    c.monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    text = _cached_toy(c, lambda b: bytes(b[: len(b) // 2]))
    gc.collect()
    assert not unraisable, [str(u.exc_value)[:200] for u in unraisable]
    err = c.capsys.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err and "Event loop is closed" not in err, err
    assert "'driver'" not in text  # no TensorStore spec
    return text


def restore_noise_dropped(c: Ctx) -> str:
    """What a failed orbax restore leaves behind (found with deleted data files, ~1 run in 5):
    orphaned asyncio futures logging 'exception was never retrieved', and TensorStore callbacks
    printing 'Event loop is closed' through sys.excepthook. Both are dropped; an unrelated
    orphan is still logged."""
    import asyncio
    import gc

    printed = []
    c.monkeypatch.setattr(sys, "excepthook", lambda *exc: printed.append(exc))

    def orphan(message):
        loop = asyncio.new_event_loop()
        fut = loop.create_future()
        fut.set_exception(ValueError(message))
        loop.close()
        return fut

    c.caplog.clear()
    with c.caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(ValueError, match="restore failed"):
            with checkpoint._quiet_restore_noise():
                try:
                    raise RuntimeError("Event loop is closed")
                except RuntimeError:
                    sys.excepthook(*sys.exc_info())  # what a TensorStore callback thread does
                fut = orphan('NOT_FOUND: Error opening "cast" driver: Error opening "zarr" driver')
                del fut
                raise ValueError("restore failed")
        late = orphan('DATA_LOSS: Error opening "zarr" driver: ...')  # collected after the failure
        del late
        gc.collect()
        other = orphan("somebody else's error")
        del other
        gc.collect()
    logged = [r.getMessage() + str(r.exc_info[1] if r.exc_info else "") for r in c.caplog.records]
    assert not printed, printed
    assert len(logged) == 1 and "somebody else's error" in logged[0], logged
    return logged[0]


def interrupted_save_never_restores(c: Ctx) -> str:
    """A save interrupted after orbax wrote its files leaves no entry; the next load converts."""
    path = toy(c)
    cache = c.tmp / "cache"

    def interrupt(directory):
        raise KeyboardInterrupt

    with c.monkeypatch.context() as m:
        m.setattr(checkpoint, "data_digest", interrupt)
        with pytest.raises(KeyboardInterrupt):
            loading.load_transformer(path, dtype=jnp.float32, config=Config(), cache_dir=cache)
    left = sorted(p.name for p in cache.iterdir())
    assert left and all(".partial-" in n for n in left), left
    opened = []
    orig = loading.Checkpoint.__init__
    c.monkeypatch.setattr(loading.Checkpoint, "__init__",
                          lambda self, *a, **k: opened.append(1) or orig(self, *a, **k))
    tw.assert_loaded(loading.load_transformer(path, dtype=jnp.float32, config=Config(), cache_dir=cache),
                     tw.expected_params(tw.torch_weights()))
    assert opened == [1]
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / checkpoint.META_FILE).exists()
    return f"partial entries {left} never restored"


def outside_shard_never_opened(c: Ctx) -> str:
    """An index naming ../x.safetensors (which exists) is refused, and with a cache_dir its
    header is not even read to fingerprint the checkpoint."""
    path = toy_index({"diffusion_pytorch_model-00002-of-00002.safetensors": "../outside.safetensors"})(c)
    shutil.copy(path / "diffusion_pytorch_model-00002-of-00002.safetensors", c.tmp / "outside.safetensors")
    opened = []
    orig = checkpoint._file_fingerprint
    c.monkeypatch.setattr(checkpoint, "_file_fingerprint", lambda p: opened.append(p) or orig(p))
    with pytest.raises(WeightsError) as e:
        loading.load_transformer(path, dtype=jnp.float32, config=Config(), cache_dir=c.tmp / "cache")
    assert not [p for p in opened if "outside" in str(p)], opened
    return str(e.value)


def explicit_restore_refuses_damage(c: Ctx) -> str:
    path = toy(c)
    model = loading.load_transformer(path, dtype=jnp.float32, config=Config())
    out = checkpoint.save_params(c.tmp / "saved", model)
    data = max((f for f in pathlib.Path(out).rglob("*") if f.is_file() and "/d/" in str(f)),
               key=lambda f: f.stat().st_size)
    data.write_bytes(flip()(bytearray(data.read_bytes())))
    abstract = loading.abstract_port_model(tw.TOY_PORT, tw._config_from_diffusers(tw.DIFFUSERS_CONFIG),
                                           dtype=jnp.float32)
    with pytest.raises(WeightsError) as e:
        checkpoint.restore_params(out, abstract, None, tw.testing.PLAN)
    return str(e.value)


def unwritable_cache_before_conversion(c: Ctx) -> str:
    path = toy(c)
    (c.tmp / "file").write_text("x")
    opened = []
    c.monkeypatch.setattr(loading.Checkpoint, "__init__", lambda self, *a, **k: opened.append(1))
    with pytest.raises(WeightsError) as e:
        loading.load_transformer(path, dtype=jnp.float32, config=Config(), cache_dir=c.tmp / "file" / "cache")
    assert not opened, "the checkpoint was opened before the cache_dir was refused"
    return str(e.value)


def wan_i2v_norm_added_q(c: Ctx) -> str:
    """The published Wan2.1 I2V checkpoints carry attn2.norm_added_q weights diffusers ignores:
    they load, with one notice, into the same parameters as without them."""
    path = c.tmp / "wan_i2v"
    shutil.copytree(WAN_I2V, path)
    tensors = load_file(str(path / loading.SINGLE_FILE))
    cfg = json.loads((path / "config.json").read_text())
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    for i in range(cfg["num_layers"]):
        tensors[f"blocks.{i}.attn2.norm_added_q.weight"] = np.full((dim,), 1.5, np.float32)
    save_file(tensors, str(path / loading.SINGLE_FILE))
    c.caplog.clear()
    with c.caplog.at_level(logging.WARNING, logger="difflet_tpu.loading"):
        model = loading.load_transformer(path, dtype=jnp.float32, config=Config())
    notices = [r.getMessage() for r in c.caplog.records if r.name.startswith("difflet_tpu.loading")]
    assert len(notices) == 1, notices
    ref = loading.load_transformer(WAN_I2V, dtype=jnp.float32, config=Config())
    got, want = tw.flat_params(model), tw.flat_params(ref)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    return notices[0]


def runner_finite_check(c: Ctx) -> str:
    """The opt-in finite check a serving loop runs on each Runner output."""
    from difflet_tpu import checks
    from difflet_tpu.models import wan

    kwargs, _ = read_fixture_io(FIXTURES / "wan_t2v")
    model = loading.load_transformer(WAN_T2V, dtype=jnp.float32, config=Config())
    out = wan.Runner(model, None, Config())(**kwargs).sample
    checks.check_finite(out, "step output")  # finite: passes through
    with pytest.raises(checks.NonFiniteError) as e:
        checks.check_finite(out.at[0, 0, 0, 0, :3].set(jnp.nan), "step output")
    return str(e.value)


def sharded_inf(c: Ctx) -> str:
    from difflet_tpu import checks
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = make_mesh(4)
    x = jax.device_put(jnp.zeros((8, 4)).at[5, 1].set(jnp.inf), NamedSharding(mesh, P("tp")))
    with pytest.raises(checks.NonFiniteError) as e:
        checks.check_finite({"hidden_states": x}, "latents")
    return str(e.value)


def wan_runner(change):
    def run(c: Ctx):
        from difflet_tpu.models import wan

        kwargs, _ = read_fixture_io(FIXTURES / "wan_t2v")
        model = loading.load_transformer(WAN_T2V, dtype=jnp.float32, config=Config())
        with pytest.raises(ValueError) as e:
            wan.Runner(model, None, Config())(**{**kwargs, **change})
        return str(e.value)

    return run


def runner_call(case, change, **runner_kw):
    """`Runner(fixture model, **runner_kw)(**fixture kwargs | change)` raises ValueError / TypeError
    (before anything compiles: the step cache stays empty)."""

    def run(c: Ctx):
        from difflet_tpu.runner import Runner

        kwargs, _ = read_fixture_io(FIXTURES / case)
        model = loading.load_transformer(FIXTURES / case / "transformer", dtype=jnp.float32, config=Config())
        r = Runner(model, None, Config(), **runner_kw)
        new = change(kwargs) if callable(change) else {**kwargs, **change}
        with pytest.raises((ValueError, TypeError)) as e:
            r(**new)
        assert not r._steps, "a step was compiled before the refusal"
        return str(e.value)

    return run


def runner_made(mesh=None, config=None, mode=None):
    """`Runner(wan fixture model, mesh, config, mode)` is refused."""

    def run(c: Ctx):
        from difflet_tpu.runner import Runner

        model = loading.load_transformer(WAN_T2V, dtype=jnp.float32, config=Config())
        m = mesh() if callable(mesh) else mesh
        with pytest.raises((ValueError, TypeError)) as e:
            Runner(model, m, config, mode)
        return str(e.value)

    return run


def raises(fn, exc=ValueError):
    def run(c: Ctx):
        with pytest.raises(exc) as e:
            fn(c)
        return str(e.value)

    return run


def hunyuan_mask(values):
    def change(kw):
        m = np.asarray(kw["encoder_attention_mask"]).copy()
        m[0, :len(values)] = values
        return {**kw, "encoder_attention_mask": m}

    return change


def _cached_toy_meta(c: Ctx, rehash: bool) -> str:
    """Edits one parameter's dtype in a cache entry's difflet_meta.json (still valid JSON), then
    loads again: one warning and a re-conversion, the parameter in its right dtype and values."""
    tensors = tw.torch_weights()
    path = toy(c, tensors)
    cache = c.tmp / "cache"
    first = tw.flat_params(loading.load_transformer(path, dtype=jnp.float32, config=Config(), cache_dir=cache))
    (entry,) = [d for d in cache.iterdir() if not d.name.startswith(".")]
    meta = json.loads((entry / checkpoint.META_FILE).read_text())
    name = sorted(meta["params"])[0]
    meta["params"][name]["dtype"] = "bfloat16"
    if rehash:  # an edit that recomputes the metadata digest too: the restored dtypes are still checked
        meta["meta_sha256"] = checkpoint.meta_digest(meta)
    (entry / checkpoint.META_FILE).write_text(json.dumps(meta))
    c.caplog.clear()
    with c.caplog.at_level(logging.WARNING, logger="difflet_tpu.loading"):
        model = loading.load_transformer(path, dtype=jnp.float32, config=Config(), cache_dir=cache)
    got = tw.flat_params(model)
    for k, v in first.items():
        assert got[k].dtype == jnp.float32, k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v), err_msg=k)
    warnings = [r.getMessage() for r in c.caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    return warnings[0]


def explicit_restore_refuses_meta_edit(c: Ctx) -> str:
    path = toy(c)
    model = loading.load_transformer(path, dtype=jnp.float32, config=Config())
    out = checkpoint.save_params(c.tmp / "saved", model)
    meta = json.loads((pathlib.Path(out) / checkpoint.META_FILE).read_text())
    meta["params"][sorted(meta["params"])[0]]["dtype"] = "float16"
    (pathlib.Path(out) / checkpoint.META_FILE).write_text(json.dumps(meta))
    abstract = loading.abstract_port_model(tw.TOY_PORT, tw._config_from_diffusers(tw.DIFFUSERS_CONFIG),
                                           dtype=jnp.float32)
    with pytest.raises(WeightsError) as e:
        checkpoint.restore_params(out, abstract, None, tw.testing.PLAN, verify=False)
    return str(e.value)


def key_in_two_shards(c: Ctx) -> pathlib.Path:
    path = toy(c, sharded=True)
    index = json.loads((path / loading.INDEX_FILE).read_text())
    first, second = sorted(set(index["weight_map"].values()))
    key = next(k for k, f in index["weight_map"].items() if f == first)
    t = load_file(str(path / second))
    t[key] = np.zeros_like(load_file(str(path / first))[key])  # another copy, other values
    save_file(t, str(path / second))
    return path


def shard_link(target):
    """A sharded toy checkpoint whose second shard is a symlink to `target` (its own name: a loop)."""

    def setup(c):
        path = toy(c, sharded=True)
        shard = path / "diffusion_pytorch_model-00002-of-00002.safetensors"
        shard.unlink()
        shard.symlink_to(target or shard.name)
        return path

    return setup


def config_dir(c: Ctx) -> pathlib.Path:
    path = toy(c)
    (path / "config.json").unlink()
    (path / "config.json").mkdir()
    return path


def embeddings_one_prompt_for_a_batch(c: Ctx) -> str:
    """--batch 2 with a one-prompt embeddings file: both prompts get the file's rows (and the
    unconditional half its negative rows); FLUX's txt_ids (no batch axis) are taken as they are."""
    from difflet_tpu.pipeline import denoise as PL

    text = np.random.default_rng(0).standard_normal((1, 7, 5)).astype(np.float32)
    neg = -text
    inputs = {"hidden_states": np.zeros((4, 3, 2), np.float32), "encoder_hidden_states": np.zeros((4, 7, 5)),
              "txt_ids": np.ones((7, 3), np.float32)}
    out = PL.apply_embeddings(inputs, {"encoder_hidden_states": text, "negative_encoder_hidden_states": neg,
                                       "txt_ids": np.zeros((1, 7, 3))}, True)
    np.testing.assert_array_equal(out["encoder_hidden_states"], np.concatenate([neg, neg, text, text]))
    np.testing.assert_array_equal(out["txt_ids"], np.zeros((7, 3)))
    with pytest.raises(ValueError) as e:
        PL.apply_embeddings(inputs, {"encoder_hidden_states": np.zeros((3, 7, 5), np.float32)}, True)
    return str(e.value)


def json_write_fails_after_the_run(c: Ctx) -> str:
    """A full disk when the report is written: exit 1, a message, no report and no temporary file."""
    from difflet_tpu import checks

    def full(fd):
        raise OSError(28, "No space left on device")

    c.monkeypatch.setattr(checks.os, "fsync", full)
    out = c.tmp / "out"
    out.mkdir()
    rc = bench_cli.main(["--model", "toy:tiny", "--mode", "tp", "--steps", "1", "--json", str(out / "r.json")])
    err = c.capsys.readouterr().err
    assert rc == 1, err
    assert list(out.iterdir()) == [], list(out.iterdir())
    return err


def json_write_keeps_the_old_report(c: Ctx) -> str:
    """The same failure over an earlier report leaves that report whole."""
    from difflet_tpu import checks

    old = c.tmp / "r.json"
    old.write_text('{"old": true}')
    c.monkeypatch.setattr(checks.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    with pytest.raises(checks.WriteError) as e:
        report.write_json(old, {"new": 1})
    assert json.loads(old.read_text()) == {"old": True}
    assert [p.name for p in c.tmp.iterdir()] == ["r.json"]
    return str(e.value)


# --------------------------------------------------------------------------
# The pipeline surfaces: generate, check, DiffusionPipeline.from_pretrained
# --------------------------------------------------------------------------

PIPELINES = FIXTURES / "pipelines"


def _files(root: pathlib.Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def generate_cli(*argv, code=1, setup=None, loads=False):
    """`python -m difflet_tpu.generate ARGV` exits with `code` and leaves every file in the tmp
    directory as it was (no image, no report, no change to an input); unless `loads`, nothing
    is loaded. `{tmp}`, `{schnell}` and `{qwen}` (the fixture folders) in an argument."""

    def run(c: Ctx):
        from difflet_tpu import generate
        from difflet_tpu.pipeline import diffusion as D

        if setup is not None:
            setup(c)
        if not loads:
            c.monkeypatch.setattr(D.DiffusionPipeline, "from_pretrained",
                                  classmethod(lambda *a, **k: pytest.fail("loaded before the refusal")))
        args = [a.format(tmp=c.tmp, schnell=PIPELINES / "flux_schnell", qwen=PIPELINES / "qwen_image") for a in argv]
        before = _files(c.tmp)
        try:
            rc = generate.main(args)
        except SystemExit as e:
            rc = e.code
        err = c.capsys.readouterr().err
        assert rc == code, (rc, err[-2000:])
        assert _files(c.tmp) == before, "a file was written or changed"
        return err

    return run


def check_cli(*argv, env=None):
    """`python -m difflet_tpu.check ARGV` exits 2 (bad input) before any work; returns stderr."""

    def run(c: Ctx):
        from difflet_tpu.check import __main__ as check_main

        for k, v in (env or {}).items():
            c.monkeypatch.setenv(k, v)
        c.monkeypatch.setattr(check_main, "setup", lambda args: pytest.fail("the check started"))
        with pytest.raises(SystemExit) as e:
            check_main.main([a.format(tmp=c.tmp) for a in argv])
        err = c.capsys.readouterr().err
        assert e.value.code == 2, (e.value.code, err)
        return err

    return run


def pipe_copy(name="flux_schnell", change=None):
    """A setup: the fixture pipeline `name` copied to tmp/pipe, then `change(folder)`."""

    def setup(c: Ctx):
        d = c.tmp / "pipe"
        shutil.copytree(PIPELINES / name, d)
        if change is not None:
            change(d)
        return d

    return setup


def edit_json(sub, **values):
    def change(d):
        f = d / sub
        f.write_text(json.dumps(dict(json.loads(f.read_text()), **values)))

    return change


def truncate(sub):
    def change(d):
        f = d / sub
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    return change


def flux_vae_in_qwen(d):
    shutil.rmtree(d / "vae")
    shutil.copytree(PIPELINES / "flux_schnell" / "vae", d / "vae")


def from_pretrained(setup, mesh=None, **kwargs):
    """`DiffusionPipeline.from_pretrained` on `setup(ctx)`'s folder raises a ValueError before
    any weight (transformer or text encoder) is read."""

    def run(c: Ctx):
        from difflet_tpu.encoders import loading as encoder_loading
        from difflet_tpu.pipeline.diffusion import DiffusionPipeline

        path = setup(c)

        def no_read(*a, **k):
            raise AssertionError("a weight was read before the error")

        c.monkeypatch.setattr(loading.Checkpoint, "read", no_read)
        c.monkeypatch.setattr(encoder_loading.Checkpoint, "read", no_read)
        kwargs.setdefault("config", Config())
        kw = {k: (v(c) if callable(v) else v) for k, v in kwargs.items()}
        with pytest.raises(ValueError) as e:
            DiffusionPipeline.from_pretrained(path, mesh=mesh() if mesh else None, dtype=jnp.float32, **kw)
        return str(e.value)

    return run


def generate_report_fails_after_the_run(c: Ctx) -> str:
    """The report cannot be written after the run (a full disk at its fsync): exit 1, and the
    image is not left behind without it (both are written, or neither)."""
    from difflet_tpu import checks, generate

    real, calls = checks.os.fsync, []

    def full_on_the_report(fd):
        calls.append(fd)
        if len(calls) == 2:  # the image's temporary file is written first, then the report's
            raise OSError(28, "No space left on device")
        return real(fd)

    c.monkeypatch.setattr(checks.os, "fsync", full_on_the_report)
    out = c.tmp / "out"
    out.mkdir()
    rc = generate.main([str(PIPELINES / "flux_schnell"), "--prompt", "a cat", "--height", "32", "--width", "32",
                        "--steps", "1", "--out", str(out / "x.png"), "--json", str(out / "t.json")])
    err = c.capsys.readouterr().err
    assert rc == 1, err
    assert list(out.iterdir()) == [], list(out.iterdir())
    return err


# --------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------

CASES = [
    # ---- the bench CLI: exit 2 before any work, or 1 for a failed run; never 0 ----
    Case("guidance-nan", "cli", cli("--model", "toy:tiny", "--guidance", "nan"),
         r"--guidance nan: must be a finite number >= 0"),
    Case("guidance-inf", "cli", cli("--model", "toy:tiny", "--guidance", "inf"), r"--guidance inf: must be a finite"),
    Case("guidance-negative", "cli", cli("--model", "toy:tiny", "--guidance", "-1"), r"--guidance -1.0: must be"),
    Case("seed-negative", "cli", cli("--model", "toy:tiny", "--seed", "-1"), r"--seed -1: must be >= 0"),
    Case("embeddings-nan", "cli", cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.npz",
                                      setup=embeddings("e.npz", {"prompt_embeds": NAN_TEXT})),
         r"--embeddings \S+e\.npz: prompt_embeds: 1 NaN and 0 inf of 12288 values"),
    Case("embeddings-inf", "cli", cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.safetensors",
                                      setup=embeddings("e.safetensors", {"prompt_embeds": INF_TEXT})),
         r"--embeddings \S+e\.safetensors: prompt_embeds: 0 NaN and 1 inf"),
    Case("embeddings-corrupt-npz", "cli", cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.npz",
                                              setup=garbage("e.npz")),
         r"--embeddings \S+/e\.npz: cannot read it \(\w+"),
    Case("embeddings-corrupt-safetensors", "cli",
         cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.safetensors", setup=garbage("e.safetensors")),
         r"--embeddings \S+/e\.safetensors: cannot read it \(\w+"),
    Case("embeddings-only-negative", "cli",
         cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.npz",
             setup=embeddings("e.npz", {"negative_prompt_embeds": WAN_TEXT})),
         r"\['negative_encoder_hidden_states'\] without \['encoder_hidden_states'\]"),
    Case("embeddings-wrong-shape", "cli",
         cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.npz",
             setup=embeddings("e.npz", {"prompt_embeds": np.zeros((1, 512, 23), np.float32)})),
         r"encoder_hidden_states has shape \(1, 512, 23\), this model needs \(1, 512, 24\)"),
    Case("json-in-missing-dir", "cli", cli("--model", "toy:tiny", "--json", "{tmp}/no/such/r.json"),
         r"--json \S+r\.json: directory \S+/no/such does not exist"),
    Case("json-is-a-directory", "cli", cli("--model", "toy:tiny", "--json", "{tmp}"), r"--json \S+: is a directory"),
    Case("dump-hlo-under-a-file", "cli", cli("--model", "toy:tiny", "--dump-hlo", "{tmp}/f/hlo", setup=a_file("f")),
         r"--dump-hlo \S+/f/hlo: cannot write there \(Not a directory\)"),
    Case("profile-is-a-file", "cli", cli("--model", "toy:tiny", "--profile", "{tmp}/f", setup=a_file("f")),
         r"--profile \S+/f: exists and is not a directory"),
    Case("flux-full-size-on-cpu", "cli", cli("--model", "flux", setup=small_host),
         r"flux:flux.1-dev on CPU: 11.90 B parameters need 44.3 GiB as float32, more than half of this "
         r"machine's 16.0 GiB. It needs a TPU; here, plan it with --compile-only --topology v5e:2x2"),
    Case("wan22-experts-on-cpu", "cli", cli("--model", "wan:Wan2.2-T2V-A14B", setup=small_host),
         r"per expert, 2 experts, need 106.5 GiB .* It needs a TPU"),
    Case("expert-offload-without-host-memory", "cli",
         cli("--model", "toy:tiny", "--expert-offload", "on", setup=two_expert_toy_without_host_memory),
         r"--expert-offload on: the cpu devices have no pinned_host memory to keep toy:tiny's idle expert in; "
         r"use --expert-offload off or auto"),
    Case("expert-offload-unknown-value", "cli", cli("--model", "toy:tiny", "--expert-offload", "host"),
         r"argument --expert-offload: invalid choice: 'host'"),
    Case("expert-offload-env-unknown-value", "cli", cli("--model", "toy:tiny", setup=offload_env("1")),
         r"DIFFLET_TPU_EXPERT_OFFLOAD='1' is not allowed; use one of auto, on, off"),
    Case("shape-the-port-refuses", "cli", cli("--model", "wan:tiny", "--height", "60"),
         r"error: height 60 is not a positive multiple of 16 \(e.g. 64\)"),
    Case("frames-and-width-named", "cli", cli("--model", "wan:tiny", "--frames", "4", "--width", "70"),
         r"error: frames 4 is not 1 \+ 4k \(e.g. 5\); width 70 is not a positive multiple of 16"),
    Case("embeddings-int32", "cli", cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.npz",
                                        setup=embeddings("e.npz", {"prompt_embeds": WAN_TEXT.astype(np.int32)})),
         r"--embeddings \S+e\.npz: prompt_embeds: dtype int32; expected a floating-point array"),
    Case("embeddings-bool", "cli", cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.safetensors",
                                       setup=embeddings("e.safetensors", {"prompt_embeds": WAN_TEXT > 0})),
         r"prompt_embeds: dtype bool; expected a floating-point array"),
    Case("embeddings-complex", "cli", cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.npz",
                                          setup=embeddings("e.npz", {"prompt_embeds": WAN_TEXT + 1j})),
         r"prompt_embeds: dtype complex(64|128); expected a floating-point array"),
    Case("embeddings-no-tokens", "cli", cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.npz",
                                            setup=embeddings("e.npz", {"prompt_embeds": WAN_TEXT[:, :0]})),
         r"prompt_embeds: shape \(1, 0, 24\) is empty \(axis 1 has length 0"),
    Case("embeddings-mask-half", "cli",
         cli("--model", "hunyuan_video:tiny", "--embeddings", "{tmp}/e.npz",
             setup=embeddings("e.npz", {"prompt_attention_mask": np.array([[1, 1, 0.5, 0]])})),
         r"prompt_attention_mask: 1 value\(s\) other than 0 and 1 \(e.g. 0.5\)"),
    Case("embeddings-rows-not-batch", "cli",
         cli("--model", "wan:tiny", "--batch", "2", "--embeddings", "{tmp}/e.npz",
             setup=embeddings("e.npz", {"prompt_embeds": np.zeros((3, 512, 24), np.float32)})),
         r"encoder_hidden_states has shape \(3, 512, 24\), this model needs \(1 or 2, 512, 24\)"),
    Case("embeddings-one-prompt-for-a-batch", "cli", embeddings_one_prompt_for_a_batch,
         r"needs \(1 or 2, 7, 5\) \(one prompt for the batch, or one per prompt of --batch 2\)"),
    Case("json-is-the-embeddings", "cli",
         cli("--model", "wan:tiny", "--embeddings", "{tmp}/e.npz", "--json", "{tmp}/e.npz",
             setup=embeddings("e.npz", {"prompt_embeds": WAN_TEXT})),
         r"--json \S+e\.npz: is also an input \(--embeddings"),
    Case("json-inside-the-weights", "cli", cli("--model", "toy:tiny", "--weights", str(WAN_T2V), "--json",
                                               str(WAN_T2V / "config.json")), r"is also an input \(--weights"),
    Case("json-dev-full", "cli", cli("--model", "toy:tiny", "--json", "/dev/full"),
         r"--json /dev/full: not a regular file"),
    Case("json-write-fails-after-the-run", "cli", json_write_fails_after_the_run,
         r"error: --json \S+r\.json: cannot write it \(No space left on device\); nothing was written"),
    Case("json-write-keeps-the-old-report", "cli", json_write_keeps_the_old_report,
         r"cannot write it \(Input/output error\)"),
    Case("cpu-devices-huge", "cli", cli("--cpu-devices", "100000"), r"--cpu-devices 100000: must be <= 64"),
    Case("steps-huge", "cli", cli("--model", "toy:tiny", "--steps", "1000000000"), r"--steps 1000000000: must be <= 10000"),
    Case("inputs-larger-than-any-host", "cli",
         cli("--model", "wan:tiny", "--batch", "1024", "--frames", "4097", "--height", "16384", "--width", "16384"),
         r"wan:tiny at --height 16384 --width 16384 --frames 4097, --batch 1024: its inputs do not fit this "
         r"host's memory"),
    Case("calibrated-without-compile-only", "cli", cli("--model", "toy:tiny", "--calibrated", "no"),
         r"--calibrated only applies to --compile-only"),
    Case("i2v-weights-under-t2v-preset", "cli", cli("--model", "wan:tiny", "--weights", str(WAN_I2V)),
         r"in_channels=12 and out_channels=4 .*image-to-video.*text-to-video latents only"),
    Case("weights-of-two-experts-without-model", "cli", cli("--weights", "{tmp}/pipe", setup=two_experts),
         r"holds two experts .* name the pipeline with --model"),
    Case("weights-of-an-unported-class", "cli", cli("--weights", "{tmp}/sd3", setup=sd3_dir),
         r"holds a SD3Transformer2DModel, which no port supports"),
    Case("weights-of-another-family", "cli",
         cli("--model", "toy:tiny", "--weights", str(WAN_T2V)),
         r"--weights \S+ holds a WanTransformer3DModel, not a toy transformer"),
    Case("weights-without-model-picks-the-checkpoint", "cli", weights_without_model,
         r"--weights \S+wan_t2v/transformer: a WanTransformer3DModel; running wan:tiny"),
    Case("non-finite-latents-fail-the-row", "cli", nan_latents_fail_the_row,
         r"toy:tiny\s+tp\s+ERROR: NonFiniteError: final latents hidden_states: \d+ NaN"),

    # ---- load_transformer: WeightsError before any tensor is read ----
    Case("int8-tensor", "loader", loads(toy_with("proj_out.weight", lambda a: (a * 40).astype(np.int8))),
         r"wrong dtype for proj_out.weight in diffusion_pytorch_model.safetensors: checkpoint I8, expected a "
         r"float tensor \(F16, BF16, F32, F64\) for proj_out.kernel"),
    Case("bool-tensor", "loader", loads(toy_with("blocks.1.attn.norm_q.weight", lambda a: a > 0)),
         r"wrong dtype for blocks.1.attn.norm_q.weight .*checkpoint BOOL"),
    Case("float8-tensor", "loader",
         loads(toy_with("proj_in.bias", lambda a: a.astype(jnp.float8_e4m3fn))),
         r"checkpoint F8_E4M3, expected a float tensor .*quantised tensors are not converted"),
    Case("int8-not-loaded-as-float", "loader", int8_is_refused_not_loaded, r"checkpoint I8"),
    Case("float16-converts", "loader", float16_converts, r"F16 converted"),
    Case("unknown-keyword", "loader", loads(toy, frobnicate=3),
         r"load_transformer: unknown keyword argument\(s\) \['frobnicate'\]"),
    Case("unknown-keyword-real-port", "loader", loads(lambda c: WAN_T2V, num_layer=3),
         r"unknown keyword argument\(s\) \['num_layer'\] .*unknown option\(s\) 'num_layer': not "
         r"WanTransformer3DModel config keys"),
    Case("split-rope-keyword", "loader", loads(toy, split_rope=False), r"pass config=difflet_tpu.Config\(split_rope"),
    Case("mesh-is-a-string", "loader", loads(toy, mesh="tp"),
         r"mesh: 'tp' is not a jax.sharding.Mesh with a 'tp' axis"),
    Case("dtype-int8", "loader", loads(toy, dtype=jnp.int8), r"dtype: int8 is not a floating-point dtype"),
    Case("config-not-a-Config", "loader", loads(toy, config="sp"), r"config: 'sp' is not a difflet_tpu.Config"),
    Case("cache-dir-url-scheme", "loader", loads(toy, cache_dir="foo://bucket/cache"),
         r"cache_dir 'foo://bucket/cache': unsupported URL scheme 'foo://'; use a local path or gs:// / s3://"),
    Case("cache-dir-is-a-file", "loader", loads(toy, cache_dir=lambda c: (c.tmp / "f").write_text("x") and c.tmp / "f"),
         r"cache_dir \S+/f: exists and is not a directory"),
    Case("cache-dir-unwritable-before-conversion", "loader", unwritable_cache_before_conversion,
         r"cache_dir \S+/file/cache: cannot write there \(Not a directory\); .*cache_dir=None"),
    Case("index-absolute-shard", "loader",
         loads(toy_index({"diffusion_pytorch_model-00002-of-00002.safetensors": "/etc/passwd"})),
         r"refusing shard name\(s\) that do not name a file in \S+: '/etc/passwd' is an absolute path"),
    Case("index-dotdot-shard", "loader",
         loads(toy_index({"diffusion_pytorch_model-00002-of-00002.safetensors": "../x.safetensors"})),
         r"'../x.safetensors' leaves the directory"),
    Case("index-dotdot-shard-not-fingerprinted", "loader", outside_shard_never_opened,
         r"'../outside.safetensors' leaves the directory"),
    Case("index-weight-map-not-object", "loader",
         loads(lambda c: (toy(c, sharded=True) / loading.INDEX_FILE).write_text('{"weight_map": [1]}')
               and c.tmp / "toy"),
         r"not a safetensors index \(weight_map is a list"),
    Case("heads-do-not-divide-tp", "loader", loads(toy_heads, mesh=make_mesh(4)),
         r"heads or parameters do not divide over the tp axis \(tp=4\):\n  heads: 6 heads over tp=4"),
    Case("config-json-not-an-object", "loader", loads(toy_config([1, 2])), r"config.json: not a JSON object"),
    Case("config-json-is-a-directory", "loader", loads(config_dir), r"config.json: is a directory, not a file"),
    Case("shard-dangling-symlink", "loader", loads(shard_link("gone.safetensors")),
         r"names shard\(s\) that cannot be read: diffusion_pytorch_model-00002-of-00002.safetensors is a "
         r"symlink to gone.safetensors, which does not exist"),
    Case("shard-symlink-loop", "loader", loads(shard_link(None)), r"00002-of-00002.safetensors is a symlink loop"),
    Case("key-in-two-shards", "loader", loads(key_in_two_shards),
         r"1 key\(s\) are in more than one file, e.g. \S+ in diffusion_pytorch_model-00001-of-00002.safetensors "
         r"and diffusion_pytorch_model-00002-of-00002.safetensors"),
    Case("wan-config-num-layers-negative", "loader", loads(wan_config(num_layers=-1)),
         r"config.json: not supported by wan: num_layers: -1 is not a positive integer"),

    # ---- the ports' config_from_diffusers: one shared validator, the key named ----
    Case("wan-num-layers-negative", "config", port_config("wan", {"num_layers": -1}),
         r"^num_layers: -1 is not a positive integer$"),
    Case("wan-num-layers-string", "config", port_config("wan", {"num_layers": "2"}),
         r"^num_layers: '2' is not a positive integer$"),
    Case("wan-num-layers-float", "config", port_config("wan", {"num_layers": 2.5}),
         r"^num_layers: 2.5 is not a positive integer$"),
    Case("wan-patch-size-negative", "config", port_config("wan", {"patch_size": [1, -2, 2]}),
         r"^patch_size: \[1, -2, 2\] is not a list of 3 positive integers \(-2\)$"),
    Case("wan-patch-size-2d", "config", port_config("wan", {"patch_size": [2, 2]}),
         r"^patch_size: \[2, 2\] is not a list of 3 positive integers$"),
    Case("wan-eps-zero", "config", port_config("wan", {"eps": 0}), r"^eps: 0 is not a finite positive number$"),
    Case("wan-unknown-key", "config", port_config("wan", {"window_size": [-1, -1]}),
         r"^'window_size': not a WanTransformer3DModel config key this port knows"),
    Case("wan-flf2v-without-image-branch", "config", port_config("wan", {"pos_embed_seq_len": 514}),
         r"pos_embed_seq_len: 514 needs the image branch \(image_dim\) and an even length"),
    Case("flux-single-layers-negative", "config", port_config("flux", {"num_single_layers": -1}),
         r"^num_single_layers: -1 is not a positive integer$"),
    Case("flux-guidance-embeds-string", "config", port_config("flux", {"guidance_embeds": "yes"}),
         r"^guidance_embeds: 'yes' is not a bool"),
    Case("hunyuan-num-layers-float", "config", port_config("hunyuan_video", {"num_layers": 2.5}),
         r"^num_layers: 2.5 is not a positive integer$"),
    Case("hunyuan-mlp-ratio-negative", "config", port_config("hunyuan_video", {"mlp_ratio": -4.0}),
         r"^mlp_ratio: -4.0 is not a finite positive number$"),
    Case("ltx2-num-layers-string", "config", port_config("ltx2", {"num_layers": "48"}),
         r"^num_layers: '48' is not a positive integer$"),
    Case("ltx2-vae-scale-factors-2d", "config", port_config("ltx2", {"vae_scale_factors": [8, 32]}),
         r"^vae_scale_factors: \[8, 32\] is not a list of 3 positive integers$"),
    Case("ltx2-gated-attn-int", "config", port_config("ltx2", {"gated_attn": 1}), r"^gated_attn: 1 is not a bool"),

    # ---- the orbax cache: a damaged entry is one warning line and a re-conversion ----
    Case("cache-one-bit-flipped", "cache", lambda c: _cached_toy(c, flip()),
         r"^cache entry \S+: data digest mismatch \(the saved files changed: damaged or edited\); converting "
         r"\S+ again$"),
    Case("cache-64-bytes-flipped", "cache", lambda c: _cached_toy(c, flip(0.3, 64)), r"data digest mismatch"),
    Case("cache-truncated", "cache", lambda c: _cached_toy(c, lambda b: bytes(b[: len(b) // 2])),
         r"data digest mismatch"),
    Case("cache-restore-error-one-line", "cache", restore_error_is_one_line,
         r"^cache entry \S+ cannot be restored \(\w+: .{0,200}\); converting \S+ again$"),
    Case("cache-restore-noise-dropped", "cache", restore_noise_dropped,
         r"^Future exception was never retrieved.*somebody else's error"),
    Case("cache-interrupted-save", "cache", interrupted_save_never_restores, r"never restored"),
    Case("explicit-restore-damaged", "cache", explicit_restore_refuses_damage,
         r"saved: data digest mismatch .*; save it again"),
    Case("cache-meta-dtype-edited", "cache", lambda c: _cached_toy_meta(c, rehash=False),
         r"^cache entry \S+: metadata digest mismatch \(difflet_meta.json changed: damaged or edited\); "
         r"converting \S+ again$"),
    Case("cache-meta-edited-and-rehashed", "cache", lambda c: _cached_toy_meta(c, rehash=True),
         r"^cache entry \S+ restores other parameters than asked \(\S+: dtype bfloat16, asked float32\); "
         r"converting \S+ again$"),
    Case("explicit-restore-meta-edited", "cache", explicit_restore_refuses_meta_edit,
         r"saved: metadata digest mismatch \(difflet_meta.json changed: damaged or edited\); save it again"),

    # ---- the Runners ----
    Case("wan-i2v-norm-added-q-ignored", "runner", wan_i2v_norm_added_q,
         r"ignoring 2 checkpoint key\(s\) that the reference ignores too \(diffusers "
         r"_keys_to_ignore_on_load_unexpected \['norm_added_q'\]\): blocks.\{0..1\}.attn2.norm_added_q.weight$"),
    Case("runner-output-nan-opt-in-check", "runner", runner_finite_check,
         r"^step output: 3 NaN and 0 inf of \d+ values \(shape \(1, 4, 3, 8, 12\), float32\)$"),
    Case("sharded-latents-inf", "runner", sharded_inf,
         r"^latents hidden_states: 0 NaN and 1 inf of 32 values \(shape \(8, 4\), float32\)$"),
    Case("wan-runner-wrong-channels", "runner",
         wan_runner({"hidden_states": np.zeros((1, 5, 3, 8, 12), np.float32)}), r"in_channels=4"),
    Case("wan-runner-text-dim", "runner",
         wan_runner({"encoder_hidden_states": np.zeros((1, 10, 23), np.float32)}), r"text_dim=24"),
    Case("runner-int32-latents", "runner", runner_call("wan_t2v", lambda kw: {
        **kw, "hidden_states": np.asarray(kw["hidden_states"]).astype(np.int32)}),
         r"^wan: hidden_states: dtype int32; expected a floating-point array"),
    Case("runner-bool-text", "runner", runner_call("wan_t2v", lambda kw: {
        **kw, "encoder_hidden_states": np.asarray(kw["encoder_hidden_states"]) > 0}),
         r"^wan: encoder_hidden_states: dtype bool; expected a floating-point array"),
    Case("runner-complex-latents", "runner", runner_call("wan_t2v", lambda kw: {
        **kw, "hidden_states": np.asarray(kw["hidden_states"]) + 0j}), r"hidden_states: dtype complex(64|128)"),
    Case("runner-string-timestep", "runner", runner_call("wan_t2v", {"timestep": "500"}),
         r"^wan: timestep: '500' is a string; expected integers or floating-point numbers"),
    Case("runner-bool-timestep", "runner", runner_call("wan_t2v", {"timestep": np.array([True])}),
         r"^wan: timestep: dtype bool"),
    Case("runner-empty-text", "runner", runner_call("wan_t2v", lambda kw: {
        **kw, "encoder_hidden_states": np.asarray(kw["encoder_hidden_states"])[:, :0]}),
         r"^wan: encoder_hidden_states: shape \(1, 0, 24\) is empty \(axis 1 has length 0: no text tokens\)"),
    Case("runner-batch-0", "runner", runner_call("wan_t2v", lambda kw: {
        **kw, "hidden_states": np.asarray(kw["hidden_states"])[:0]}),
         r"^wan: hidden_states: shape \(0, 4, 3, 8, 12\) is empty \(axis 0 has length 0\)"),
    Case("runner-frames-0", "runner", runner_call("wan_t2v", lambda kw: {
        **kw, "hidden_states": np.asarray(kw["hidden_states"])[:, :, :0]}), r"is empty \(axis 2 has length 0\)"),
    Case("hunyuan-mask-half", "runner", runner_call("hunyuan_video", hunyuan_mask([1, 0.5])),
         r"^hunyuan_video: encoder_attention_mask: 1 value\(s\) other than 0 and 1 \(e.g. 0.5\)"),
    Case("hunyuan-mask-negative", "runner", runner_call("hunyuan_video", hunyuan_mask([-1])),
         r"encoder_attention_mask: 1 value\(s\) other than 0 and 1 \(e.g. -1.0\)"),
    Case("hunyuan-mask-holes", "runner", runner_call("hunyuan_video", hunyuan_mask([1, 0, 1])),
         r"^encoder_attention_mask row 0: token 2 is valid after a padding token; HunyuanVideo needs the valid "
         r"tokens first"),
    Case("hunyuan-mask-empty", "runner", runner_call("hunyuan_video", lambda kw: {
        **kw, "encoder_attention_mask": np.zeros_like(np.asarray(kw["encoder_attention_mask"]))}),
         r"^encoder_attention_mask row 0: no valid text token \(all zeros; 1 such row\(s\)\); every sample needs"),
    Case("runner-sp-without-mesh", "runner", runner_made(mode="sp"),
         r"^mode 'sp' needs a mesh \(difflet_tpu.make_mesh\(n\)\)"),
    Case("runner-config-is-a-string", "runner", runner_made(config="sp"),
         r"^config: 'sp' is not a difflet_tpu.Config"),
    Case("runner-mesh-without-tp", "runner",
         runner_made(mesh=lambda: jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))),
         r"^mesh: a mesh with axes \('x',\), no 'tp'"),

    # ---- meshes, the tile table, multi-process addresses ----
    Case("make-mesh-0", "parallel", raises(lambda c: make_mesh(0)), r"^make_mesh: tp=0 must be an int >= 1"),
    Case("make-mesh-float", "parallel", raises(lambda c: make_mesh(2.0)), r"^make_mesh: tp=2.0 must be an int"),
    Case("kernel-tiles-is-a-directory", "parallel", raises(lambda c: Config(kernel_tiles=str(c.tmp))),
         r"kernel tile table \S+ is a directory"),
    # ---- python -m difflet_tpu.generate: exit 1, the reason, nothing written or loaded ----
    Case("generate-seed-2**32", "generate", generate_cli("{schnell}", "--prompt", "a cat", "--seed", "4294967296",
                                                         "--out", "{tmp}/x.png"),
         r"^error: --seed 4294967296: must be <= 4294967295"),
    Case("generate-seed-negative", "generate", generate_cli("{schnell}", "--prompt", "a cat", "--seed", "-1",
                                                            "--out", "{tmp}/x.png"), r"--seed -1: must be >= 0"),
    Case("generate-batch-huge", "generate", generate_cli("{schnell}", "--prompt", "a cat", "--batch", "1000000000",
                                                         "--out", "{tmp}/x.png"),
         r"--batch 1000000000: must be <= 1024"),
    Case("generate-steps-huge", "generate", generate_cli("{schnell}", "--prompt", "a cat", "--steps", "1000000000",
                                                         "--out", "{tmp}/x.png"),
         r"--steps 1000000000: must be <= 10000"),
    Case("generate-height-huge", "generate", generate_cli("{schnell}", "--prompt", "a cat", "--height", "1048576",
                                                          "--out", "{tmp}/x.png"),
         r"--height 1048576: must be a positive multiple of 16 up to 16384"),
    Case("generate-guidance-nan", "generate", generate_cli("{schnell}", "--prompt", "a cat", "--guidance", "nan",
                                                           "--out", "{tmp}/x.png"),
         r"--guidance nan: must be a finite real number"),
    Case("generate-max-sequence-length-above-t5", "generate",
         generate_cli("{schnell}", "--prompt", "a cat", "--max-sequence-length", "513", "--out", "{tmp}/x.png"),
         r"--max-sequence-length 513: cannot be greater than 512"),
    Case("generate-json-is-the-image", "generate", generate_cli("{schnell}", "--prompt", "a cat", "--out",
                                                                "{tmp}/x.png", "--json", "{tmp}/x.png"),
         r"--json \S+x.png: is also the --out output"),
    Case("generate-json-empty", "generate", generate_cli("{schnell}", "--prompt", "a cat", "--out", "{tmp}/x.png",
                                                         "--json", ""),
         r"--json '': an empty path; give a file name, or leave --json out"),
    Case("generate-json-in-the-input", "generate",
         generate_cli("{tmp}/pipe", "--prompt", "a cat", "--out", "{tmp}/x.png", "--json", "{tmp}/pipe/model_index.json",
                      setup=pipe_copy()),
         r"--json \S+model_index.json: is also an input \(PATH"),
    Case("generate-out-in-the-input", "generate",
         generate_cli("{tmp}/pipe", "--prompt", "a cat", "--out", "{tmp}/pipe/vae/x.png", setup=pipe_copy()),
         r"--out \S+x.png: is also an input \(PATH"),
    Case("generate-json-a-device", "generate", generate_cli("{schnell}", "--prompt", "a cat", "--out", "{tmp}/x.png",
                                                            "--json", "/dev/null"),
         r"--json /dev/null: not a regular file"),
    Case("generate-out-under-proc", "generate", generate_cli("{schnell}", "--prompt", "a cat", "--out",
                                                             "/proc/x.png"),
         r"--out /proc/x.png: under /proc"),
    Case("generate-truncated-t5", "generate",
         generate_cli("{tmp}/pipe", "--prompt", "a cat", "--out", "{tmp}/x.png",
                      setup=pipe_copy(change=truncate("text_encoder_2/model.safetensors"))),
         r"text_encoder_2/model.safetensors: cannot read safetensors file \(truncated or corrupt\?\)"),
    Case("generate-flux-vae-in-qwen", "generate",
         generate_cli("{tmp}/pipe", "--prompt", "a cat", "--out", "{tmp}/x.png",
                      setup=pipe_copy("qwen_image", flux_vae_in_qwen)),
         r"vae/config.json names AutoencoderKL, but model_index.json lists AutoencoderKLQwenImage"),
    Case("generate-scheduler-timesteps-0", "generate",
         generate_cli("{tmp}/pipe", "--prompt", "a cat", "--out", "{tmp}/x.png",
                      setup=pipe_copy(change=edit_json("scheduler/scheduler_config.json", num_train_timesteps=0))),
         r"scheduler_config.json: num_train_timesteps must be an int >= 1, got 0"),
    Case("generate-scheduler-shift-string", "generate",
         generate_cli("{tmp}/pipe", "--prompt", "a cat", "--out", "{tmp}/x.png",
                      setup=pipe_copy(change=edit_json("scheduler/scheduler_config.json", base_shift="0.5"))),
         r"scheduler_config.json: base_shift must be a finite number, got '0.5'"),
    Case("generate-report-fails-after-the-run", "generate", generate_report_fails_after_the_run,
         r"^error: --json \S+t.json: cannot write it \(No space left on device\); nothing was written"),

    # ---- python -m difflet_tpu.check: exit 2 before any work ----
    Case("check-topology-unknown", "check", check_cli("--compile-only", "--topology", "v9x:2x2"),
         r"--topology v9x:2x2: unknown TPU generation 'v9x'"),
    Case("check-topology-malformed", "check", check_cli("--compile-only", "--topology", "2x2"),
         r"--topology 2x2: .*not of the form v5e:2x2"),
    Case("check-sp-maybe", "check", check_cli("--quick", env={"DIFFLET_TPU_SP": "maybe"}),
         r"DIFFLET_TPU_SP='maybe' is not allowed; use one of 0, 1"),
    Case("check-mesh-toggle-malformed", "check", check_cli("--quick", env={"DIFFLET_TPU_MESH": "tp4"}),
         r"DIFFLET_TPU_MESH='tp4' is not allowed"),
    Case("check-md-is-the-json", "check", check_cli("--json", "{tmp}/r.json", "--md", "{tmp}/r.json"),
         r"--md \S+r.json: is also the --json output"),
    Case("check-json-empty", "check", check_cli("--json", ""), r"--json '': an empty path"),
    Case("check-json-under-sys", "check", check_cli("--json", "/sys/r.json"), r"--json /sys/r.json: under /sys"),
    Case("check-iters-0", "check", check_cli("--iters", "0"), r"--iters 0: must be >= 1"),

    # ---- DiffusionPipeline.from_pretrained: what the configs say, before any weight is read ----
    Case("pipeline-heads-over-the-mesh", "pipeline", from_pretrained(pipe_copy(), mesh=lambda: make_mesh(3)),
         r"num_attention_heads: 4 heads over tp=3"),
    Case("pipeline-transformer-class-disagrees", "pipeline",
         from_pretrained(pipe_copy(change=edit_json("transformer/config.json",
                                                    _class_name="QwenImageTransformer2DModel"))),
         r"transformer/config.json names QwenImageTransformer2DModel, but model_index.json lists "
         r"FluxTransformer2DModel"),
    Case("pipeline-truncated-clip", "pipeline",
         from_pretrained(pipe_copy(change=truncate("text_encoder/model.safetensors"))),
         r"text_encoder/model.safetensors: cannot read safetensors file"),
    Case("pipeline-compile-cache-is-a-file", "pipeline",
         from_pretrained(pipe_copy(), config=lambda c: (c.tmp / "cc").write_text("x") and Config(
             compile_cache=str(c.tmp / "cc"))),
         r"compile cache \(DIFFLET_TPU_COMPILE_CACHE\) \S+cc: exists and is not a directory"),
    Case("pipeline-scheduler-equal-seq-lens", "pipeline",
         from_pretrained(pipe_copy("flux_dev", edit_json("scheduler/scheduler_config.json", max_image_seq_len=256))),
         r"max_image_seq_len == base_image_seq_len \(256\): calculate_shift divides by their difference"),
    Case("coordinator-port-out-of-range", "parallel",
         raises(lambda c: __import__("difflet_tpu.parallel.distributed").parallel.distributed.wait_for_coordinator(
             "127.0.0.1:70000", 1), RuntimeError), r"port 70000 is outside 1..65535"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, ctx):
    text = case.run(ctx)
    assert re.search(case.expect, text, re.S | re.M), f"{case.id}: expected /{case.expect}/ in:\n{text}"


def test_table():
    """The table's size per surface (printed with `pytest -s`), every surface covered, ids unique."""
    counts = {}
    for c in CASES:
        counts[c.surface] = counts.get(c.surface, 0) + 1
    print(f"\nbad-input table: {len(CASES)} rows: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    assert set(counts) == {"cli", "loader", "config", "cache", "runner", "parallel", "generate", "check", "pipeline"}
    assert len({c.id for c in CASES}) == len(CASES)


def test_every_port_config_key_is_checked():
    """Each port's SCHEMA (difflet_tpu.port_config) types every field of its config dataclass."""
    from difflet_tpu.models import flux, hunyuan_video, ltx2, qwen_image, wan

    for port, cls in ((flux, flux.FluxConfig), (wan, wan.WanConfig), (hunyuan_video, hunyuan_video.HunyuanVideoConfig),
                      (ltx2, ltx2.LTX2Config), (qwen_image, qwen_image.QwenImageConfig)):
        fields = {f.name for f in dataclasses.fields(cls)} - {"split_rope"}
        assert fields <= set(port.config.SCHEMA), (port.__name__, sorted(fields - set(port.config.SCHEMA)))
        assert isinstance(port.IGNORED_KEYS, tuple)
    assert wan.IGNORED_KEYS == ("norm_added_q",)  # diffusers WanTransformer3DModel._keys_to_ignore_on_load_unexpected


def test_json_report_is_strict_json(tmp_path):
    """NaN -> null and inf -> "inf" in the bench's JSON (json.dump writes bare NaN / Infinity)."""
    out = tmp_path / "r.json"
    report.write_json(out, {"results": [{"psnr_db": float("inf"), "rel_l2": float("nan"), "x": np.float32("-inf"),
                                        "ok": np.float64(1.5), "n": np.int64(3), "t": (1.0, float("nan"))}]})
    data = json.loads(out.read_text(), parse_constant=lambda s: pytest.fail(f"bare {s}"))
    assert data["results"][0] == {"psnr_db": "inf", "rel_l2": None, "x": "-inf", "ok": 1.5, "n": 3,
                                  "t": [1.0, None]}
