"""LTX-2's text connectors (models/ltx2/connectors.py) against diffusers' `LTX2TextConnectors`
(tests/fixtures/encoders/ltx2_connectors: LTX-2.0 flags with registers and split RoPE;
ltx2_3_connectors: LTX-2.3's per-modality projections, gated attention, masked keys,
interleaved RoPE), on one device and with the parameters placed on a 4-device mesh."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from difflet_tpu.models.ltx2 import connectors

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "encoders"


def check(got, ref, *, rel=2e-6, abs=2e-5, what=""):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    max_abs = float(np.abs(got - ref).max())
    rel_l2 = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel_l2 <= rel and max_abs <= abs, f"{what}: max abs {max_abs:.3e}, rel L2 {rel_l2:.3e}"


def run(case, mesh=None):
    model = connectors.from_pretrained(FIXTURES / case, mesh=mesh)
    data = dict(np.load(FIXTURES / case / "io.npz"))
    return model, data, connectors.encode(model, data["in.hidden_states"], data["in.attention_mask"])


@pytest.mark.parametrize("case", ["ltx2_connectors", "ltx2_3_connectors"])
def test_parity(case):
    model, data, (video, audio, mask) = run(case)
    check(video, data["out.video"], what=f"{case} video")
    check(audio, data["out.audio"], what=f"{case} audio")
    np.testing.assert_array_equal(np.asarray(mask), data["out.attention_mask"])


def test_flags_read_from_config():
    a = connectors.from_pretrained(FIXTURES / "ltx2_connectors").config
    b = connectors.from_pretrained(FIXTURES / "ltx2_3_connectors").config
    assert (a.per_modality_projections, a.video_connector_num_learnable_registers, a.rope_type) == (False, 4, "split")
    assert (b.per_modality_projections, b.video_connector_num_learnable_registers, b.rope_type,
            b.video_gated_attn) == (True, None, "interleaved", True)


def test_padding_matters():
    """The padded row's valid tokens decide its output: moving the padding (left -> right) with the
    same tokens changes the LTX-2.0 result (registers then fill other positions)."""
    model, data, (video, _, _) = run("ltx2_connectors")
    hidden, mask = data["in.hidden_states"].copy(), data["in.attention_mask"].copy()
    hidden[1] = np.roll(hidden[1], -3, axis=0)
    mask[1] = np.roll(mask[1], -3)
    moved, _, _ = connectors.encode(model, hidden, mask, padding_side="right")
    # tokens moved to the front in order either way: the same registers sequence, the same output
    check(moved, video, rel=1e-5, abs=1e-4, what="right-padded copy")
    other, _, _ = connectors.encode(model, data["in.hidden_states"], np.ones_like(mask))
    assert np.abs(np.asarray(other[1]) - data["out.video"][1]).max() > 1e-2


@pytest.mark.parametrize("case", ["ltx2_connectors", "ltx2_3_connectors"])
def test_on_a_4_device_mesh(case):
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    model, data, (video, audio, _) = run(case, mesh=mesh)
    assert model.video_connector.transformer_blocks[0].attn1.to_q.kernel[...].sharding.is_fully_replicated
    check(video, data["out.video"], what=f"{case} video on the mesh")
    check(audio, data["out.audio"], what=f"{case} audio on the mesh")


def test_bad_inputs_refused():
    model = connectors.from_pretrained(FIXTURES / "ltx2_connectors")
    with pytest.raises(ValueError, match=r"must be \[batch, seq, 256\]"):
        connectors.encode(model, np.zeros((1, 8, 255), np.float32), np.ones((1, 8), np.int64))
    with pytest.raises(ValueError, match="multiple of the 4 learnable registers"):
        connectors.encode(model, np.zeros((1, 6, 256), np.float32), np.ones((1, 6), np.int64))
    with pytest.raises(ValueError, match="attention_mask must be"):
        connectors.encode(model, np.zeros((1, 8, 256), np.float32), np.ones((1, 7), np.int64))
