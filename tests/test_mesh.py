
import jax
import pytest

from difflet_tpu.tools import deviceless
from difflet_tpu.parallel.mesh import (CFG, DATA, TP, batch_axes, batch_ways, make_mesh, parse_mesh, tp_groups, use_cpu_devices)


def test_make_mesh_cpu():
    m = make_mesh()
    assert m.axis_names == (TP,) and m.shape[TP] == 4
    assert make_mesh(2).shape[TP] == 2
    with pytest.raises(ValueError, match="tp=8"):
        make_mesh(8)


def test_use_cpu_devices_after_init_errors_when_too_few():
    jax.devices()
    use_cpu_devices(4)  # enough: fine
    with pytest.raises(RuntimeError, match="before"):
        use_cpu_devices(16)


@pytest.mark.slow
def test_v5e_2x2_ring_is_all_direct_links():
    out = deviceless.run_python("""
import json, numpy as np
from difflet_tpu.tools import deviceless
from difflet_tpu.parallel.mesh import make_mesh, ring_order
devs = deviceless.topology_devices('v5e:2x2')
m = make_mesh(devices=devs)
coords = {d.id: list(d.coords) for d in devs}
print(json.dumps(dict(ring=ring_order(m), naive=[d.id for d in devs], coords=coords)))
""")
    coords = {int(k): v for k, v in out["coords"].items()}

    def hops(order):
        return [sum(abs(a - b) for a, b in zip(coords[x], coords[y]))
                for x, y in zip(order, order[1:] + order[:1])]

    assert out["ring"] == [0, 1, 3, 2]
    assert hops(out["ring"]) == [1, 1, 1, 1]
    assert max(hops(out["naive"])) == 2  # the naive order has diagonal hops


def test_accelerator_type_names():
    assert deviceless.accelerator_type("v5e:2x2") == "v5litepod-4"
    assert deviceless.accelerator_type("v5e:2x4") == "v5litepod-8"
    assert deviceless.accelerator_type("v6e:2x2") == "v6e-4"
    with pytest.raises(ValueError):
        deviceless.accelerator_type("v5e-4")


def test_make_mesh_with_batch_axes_cpu():
    ids = [d.id for d in jax.devices()]
    m = make_mesh(cfg=2)
    assert m.axis_names == (CFG, TP) and dict(m.shape) == {CFG: 2, TP: 2}
    assert tp_groups(m) == [ids[:2], ids[2:]]  # CPU: the devices' order, one tp group after the other
    assert batch_axes(m) == (CFG,) and batch_ways(m) == 2
    m = make_mesh(tp=1, cfg=2, data=2)
    assert m.axis_names == (CFG, DATA, TP) and batch_ways(m) == 4
    assert make_mesh(2, data=2).axis_names == (DATA, TP)
    assert make_mesh(4).axis_names == (TP,) and batch_axes(make_mesh(4)) == ()
    with pytest.raises(ValueError, match="does not divide"):
        make_mesh(cfg=3)
    with pytest.raises(ValueError, match="8 devices"):
        make_mesh(4, cfg=2)


def test_parse_mesh():
    assert parse_mesh("cfg=2,tp=4") == {"cfg": 2, "tp": 4}
    assert parse_mesh(" tp = 8 ") == {"tp": 8}
    for bad, msg in (("", "AXIS=SIZE"), ("pp=2", "unknown axis"), ("tp=2,tp=2", "twice"),
                     ("tp=0", ">= 1"), ("cfg:2", "not AXIS=SIZE")):
        with pytest.raises(ValueError, match=msg):
            parse_mesh(bad)


@pytest.mark.slow
def test_v5e_2x4_and_4x4_rings_are_all_direct_links():
    """Every tp group of every mesh is a closed ring of unit ICI hops (chip coordinates),
    where jax.make_mesh's groups for the same shapes have diagonal or longer hops."""
    out = deviceless.run_python("""
import json, jax
from difflet_tpu.tools import deviceless
from difflet_tpu.parallel.mesh import _coords, make_mesh, ring_hops, tp_groups
res = {}
for topo, meshes in (("v5e:2x4", [dict(), dict(cfg=2), dict(cfg=2, data=2), dict(tp=4)]),
                     ("v5e:4x4", [dict(), dict(cfg=2), dict(cfg=2, data=2), dict(tp=8), dict(tp=4, cfg=4)])):
    devs = deviceless.topology_devices(topo)
    coords = {d.id: _coords(d)[:3] for d in devs}
    for kw in meshes:
        m = make_mesh(devices=devs, **kw)
        res[f"{topo} {sorted(kw.items())}"] = dict(shape=dict(m.shape), hops=[ring_hops(g, coords) for g in tp_groups(m)],
                                                  ids=sorted(i for g in tp_groups(m) for i in g))
    n = len(devs)
    for shape in ((2, n // 2), (n // 8, 8)):
        j = jax.make_mesh(shape, ("a", "tp"), devices=devs)
        res[f"{topo} jax {shape}"] = [ring_hops([d.id for d in g], coords) for g in j.devices]
print(json.dumps(res))
""", topology="v5e:2x4")
    for name, r in out.items():
        if " jax " in name:
            continue
        assert all(h == [1] * len(h) or len(h) == 1 for h in r["hops"]), (name, r)
        assert len(set(r["ids"])) == len(r["ids"]), name  # no device twice
    assert out["v5e:2x4 []"]["shape"] == {"tp": 8}
    assert out["v5e:2x4 [('cfg', 2)]"]["shape"] == {"cfg": 2, "tp": 4}
    assert out["v5e:4x4 [('cfg', 2)]"]["shape"] == {"cfg": 2, "tp": 8}
    assert out["v5e:4x4 [('cfg', 2), ('data', 2)]"]["shape"] == {"cfg": 2, "data": 2, "tp": 4}
    assert out["v5e:4x4 []"]["shape"] == {"tp": 16}
    # jax.make_mesh's groups: v5e:2x4 4-groups with diagonal hops, v5e:4x4 8-rings with a hop of 4
    assert max(max(h) for h in out["v5e:2x4 jax (2, 4)"]) == 2
    assert max(max(h) for h in out["v5e:4x4 jax (2, 8)"]) == 4
