"""Column tiles per kernel site (difflet_tpu.kernels.tiles, difflet_tpu.tools.sweep_tiles).

The table: validated on load, refused on another device kind, carried by
`Parallel` from `Config.kernel_tiles` into every collective-matmul call. The
dispatch: a listed site runs the streaming kernel at the table's tile (the
tile it asks the plan for, seen through `kernel_tiles.recording`) and gives
the same numbers as the reference. The sweep: every candidate of each site is
timed (interpret mode here: the mechanism, not a measurement) and the fastest
is kept.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from difflet_tpu.parallel import collective_matmul as cm
from difflet_tpu.parallel import site_plan
from difflet_tpu.kernels import tiles as KT
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.parallel.modes import Parallel

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "kernel_tiles_cpu.json")
AG = KT.Site("ag", [(1, 32, 128)], [(128, 256), (128, 256)], "float32", 4, [(3, "float32"), None],
             ["gelu_tanh", None], [False, True])
RS = KT.Site("rs", [(1, 128, 128)], [(128, 256)], "float32", 4)


def write(path, rows, kind="cpu"):
    KT.save(str(path), kind, [dict(site=dataclasses.asdict(s), col_tile=tn) for s, tn in rows])
    return str(path)


def test_site_keys_are_canonical():
    again = KT.Site.from_dict(json.loads(AG.key()))
    assert again == AG and again.key() == AG.key()
    assert KT.Site("rs", [[1, 128, 128]], [[128, 256]], "float32", 4).key() == RS.key()
    assert AG.widths == [256, 256] and RS.widths == [256]
    with pytest.raises(ValueError, match="kind"):
        KT.Site("mm", [(1, 8, 128)], [(128, 128)], "float32", 4)


def test_the_example_table_loads():
    t = KT.load(FIXTURE)
    assert t.device_kind == "cpu" and t.col_tile(RS) == 128 and t.col_tile(AG) is None
    assert t.blocks(RS).col_tile_limit == 128 and t.blocks(AG) is None


def test_bad_tables_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        KT.load(str(tmp_path / "missing.json"))
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="not readable JSON"):
        KT.load(str(tmp_path / "junk.json"))
    (tmp_path / "other.json").write_text(json.dumps(dict(format="something else", device_kind="cpu")))
    with pytest.raises(ValueError, match="format"):
        KT.load(str(tmp_path / "other.json"))
    with pytest.raises(ValueError, match="does not divide|not a multiple"):
        KT.load(write(tmp_path / "t1.json", [(RS, 384)]))  # 384 does not divide 256
    with pytest.raises(ValueError, match="not a multiple"):
        KT.load(write(tmp_path / "t2.json", [(RS, 64)]))
    with pytest.raises(ValueError, match="malformed"):
        KT.save(str(tmp_path / "t3.json"), "cpu", [dict(site=dict(kind="rs"), col_tile=128)])
        KT.load(str(tmp_path / "t3.json"))
    with pytest.raises(ValueError, match="measured on 'TPU v5 lite'"):
        KT.load(write(tmp_path / "t4.json", [(RS, 128)], kind="TPU v5 lite")).for_devices("TPU v6 lite")


def test_parallel_carries_the_table_into_every_collective_matmul(monkeypatch, tmp_path):
    mesh = make_mesh(4)
    par = Parallel.for_mesh(mesh, Config(sp=True, kernel_tiles=FIXTURE))
    assert par.tiles == KT.load(FIXTURE)
    seen, plan = [], site_plan.plan  # every site is planned with the table (the planner owns the tile)
    monkeypatch.setattr(site_plan, "plan", lambda site, impl, **k: seen.append((site.kind, k["tiles"])) or plan(
        site, impl, **k))
    monkeypatch.setattr(cm, "all_gather_matmul", lambda *a, **k: None)
    monkeypatch.setattr(cm, "matmul_reduce_scatter", lambda *a, **k: None)
    x, w = jnp.zeros((8, 128)), jnp.zeros((128, 128))
    par.column(x, [w])
    par.row([(x, w)])
    assert seen == [("ag", par.tiles), ("rs", par.tiles)]
    with pytest.raises(ValueError, match="measured on"):
        Parallel.for_mesh(mesh, Config(sp=True, kernel_tiles=write(tmp_path / "t.json", [(RS, 128)],
                                                                   kind="TPU v5 lite")))


def _rs_call(mesh, table):
    f = jax.shard_map(lambda x, w: cm.matmul_reduce_scatter([(x, w)], impl="pallas", interpret=True, tiles=table),
                      mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None)), out_specs=P(None, "tp", None))
    return jax.jit(f)


@pytest.mark.slow
def test_the_dispatch_runs_the_table_tile_and_the_same_numbers():
    mesh = make_mesh(4)
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (1, 128, 512)).astype(np.float32)  # per rank [1, 128, 128]: the site RS
    w = rng.integers(-3, 4, (512, 256)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, None, "tp")))
    ws = jax.device_put(w, NamedSharding(mesh, P("tp", None)))
    want = x[0].astype(np.float64) @ w.astype(np.float64)
    for table, tile in ((None, None), (KT.load(FIXTURE), 128)):
        with KT.recording() as seen:
            out = np.asarray(_rs_call(mesh, table)(xs, ws))
        assert [s for s, _ in seen] == [RS]
        blocks = seen[0][1]
        assert (None if blocks is None else blocks.col_tile_limit) == tile
        np.testing.assert_array_equal(out[0], want)  # small integers: exact at any tile


@pytest.mark.slow
def test_the_sweep_times_every_candidate_and_keeps_the_fastest(tmp_path):
    from difflet_tpu.tools import sweep_tiles as SW

    mesh = make_mesh(4)
    rows = SW.sweep([(AG, 1), (RS, 2)], mesh, repeats=1, max_col_tile=2048, compile_only=False, interpret=True,
                    log=lambda s: None)
    assert [r["calls"] for r in rows] == [1, 2]
    for r in rows:
        assert [c["col_tile"] for c in r["candidates"]] == [256, 128]  # every tile dividing 256
        assert all(c["seconds"] > 0 for c in r["candidates"])
        assert r["col_tile"] == min(r["candidates"], key=lambda c: c["seconds"])["col_tile"]
        assert r["default_col_tile"] == 256
    path = str(tmp_path / "tiles.json")
    KT.save(path, jax.devices()[0].device_kind, rows)
    # a site the dispatch does not see as the table's (a drifted key) is an error, not the default timed
    drifted = dataclasses.replace(RS, dtype="bfloat16")
    fn, shapes = SW.site_call(RS, 128, mesh, True)
    with pytest.raises(RuntimeError, match="did not run"):
        SW.traced_at(fn, shapes, drifted, 128)
    t = KT.load(path)
    assert (t.col_tile(AG), t.col_tile(RS)) == (rows[0]["col_tile"], rows[1]["col_tile"])


@pytest.mark.parametrize("argv,words", [
    (["--model", "flux", "--out", "/nonexistent-dir/t.json"], "not a writable directory"),
    (["--model", "flux", "--out", "t.json", "--compile-only"], "go together"),
    (["--model", "flux", "--out", "t.json", "--repeats", "0"], "--repeats"),
])
def test_sweep_refuses_bad_flags_before_any_work(argv, words, capsys):
    from difflet_tpu.tools import sweep_tiles as SW

    with pytest.raises(SystemExit) as e:
        SW.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err
