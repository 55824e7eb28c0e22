import json

import jax
import pytest

from difflet_tpu import deviceless
from difflet_tpu.mesh import TP, make_mesh, ring_order, use_cpu_devices


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
from difflet_tpu import deviceless
from difflet_tpu.mesh import make_mesh, ring_order
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
