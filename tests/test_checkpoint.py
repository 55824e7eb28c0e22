"""Orbax save / restore of converted parameters and the load_transformer cache, on the toy port."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu import testing
from difflet_tpu.loading import cache as checkpoint
from difflet_tpu import loading
from difflet_tpu.config import Config
from difflet_tpu.parallel.mesh import make_mesh
from difflet_tpu.loading.checkpoint import WeightsError

# The toy port and checkpoint writer live in test_weights.py (tests are not a package).
_spec = importlib.util.spec_from_file_location("_difflet_toy_port",
                                               pathlib.Path(__file__).with_name("test_weights.py"))
tw = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(tw)


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch):
    tw.register(monkeypatch, tw.TOY_PORT)


@pytest.fixture
def counts(monkeypatch):
    """How often the safetensors are opened (Checkpoint built) and read."""
    n = {"open": 0, "read": 0}
    orig_init, orig_read = loading.Checkpoint.__init__, loading.Checkpoint.read

    def init(self, *a, **k):
        n["open"] += 1
        orig_init(self, *a, **k)

    def read(self, *a, **k):
        n["read"] += 1
        return orig_read(self, *a, **k)

    monkeypatch.setattr(loading.Checkpoint, "__init__", init)
    monkeypatch.setattr(loading.Checkpoint, "read", read)
    return n


def load(path, cache, *, mesh=None, dtype=jnp.float32, split_rope=True):
    return loading.load_transformer(path, dtype=dtype, mesh=mesh, config=Config(split_rope=split_rope),
                                    cache_dir=cache)


def test_cache_round_trip_bit_identical_onto_meshes(tmp_path, counts):
    tensors = tw.torch_weights()
    path = tw.write_checkpoint(tmp_path / "transformer", tensors, sharded=True)
    cache = tmp_path / "cache"
    first = load(path, cache, mesh=make_mesh(4), dtype=jnp.bfloat16)
    assert counts["open"] == 1 and counts["read"] > 0
    (entry,) = [d for d in cache.iterdir()]
    meta = json.loads((entry / checkpoint.META_FILE).read_text())
    assert meta["cache_key"]["port_config"]["split_rope"] is True
    assert meta["cache_key"]["dtype"] == "bfloat16"

    reads = counts["read"]
    want = tw.expected_params(tensors)  # permuted once
    for tp in (4, 2, None):  # restore onto any mesh, no conversion, no re-permutation
        mesh = None if tp is None else make_mesh(tp)
        again = load(path, cache, mesh=mesh, dtype=jnp.bfloat16)
        assert counts["open"] == 1 and counts["read"] == reads, tp
        assert isinstance(again, testing.ToyModel) and again.config.split_rope
        tw.assert_loaded(again, want, mesh=mesh, dtype=jnp.bfloat16, kept=tw.KEPT_FP32)
        for k, v in tw.flat_params(first).items():
            assert np.asarray(tw.flat_params(again)[k]).tobytes() == np.asarray(v).tobytes(), k
    assert len(list(cache.iterdir())) == 1


def test_cache_misses_when_anything_differs(tmp_path, counts):
    tensors = tw.torch_weights()
    path = tw.write_checkpoint(tmp_path / "transformer", tensors)
    cache = tmp_path / "cache"
    load(path, cache)
    load(path, cache)
    assert counts["open"] == 1

    # Another dtype, another split_rope: converted again, cached separately.
    assert tw.flat_params(load(path, cache, dtype=jnp.bfloat16))["proj_in.bias"].dtype == jnp.bfloat16
    assert counts["open"] == 2
    plain = load(path, cache, split_rope=False)
    assert counts["open"] == 3
    tw.assert_loaded(plain, tw.expected_params(tensors, split_rope=False))
    assert not plain.config.split_rope
    tw.assert_loaded(load(path, cache, split_rope=False), tw.expected_params(tensors, split_rope=False))
    tw.assert_loaded(load(path, cache), tw.expected_params(tensors))
    assert counts["open"] == 3
    assert len(list(cache.iterdir())) == 3

    # New weights with the same header (same names, shapes, offsets): the mtime differs.
    st = os.stat(path / loading.SINGLE_FILE)
    tensors2 = tw.torch_weights(seed=1)
    tw.write_checkpoint(path, tensors2)
    os.utime(path / loading.SINGLE_FILE, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    tw.assert_loaded(load(path, cache), tw.expected_params(tensors2))
    assert counts["open"] == 4

    # A config.json change (even one the port ignores) is a miss too.
    (path / "config.json").write_text(json.dumps({**tw.DIFFUSERS_CONFIG, "_diffusers_version": "0.43"}))
    load(path, cache)
    assert counts["open"] == 5

    # A copy of the checkpoint elsewhere is another source.
    copy = tw.write_checkpoint(tmp_path / "copy", tensors2)
    load(copy, cache)
    assert counts["open"] == 6


def test_cache_key_covers_source_config_dtype_and_format(tmp_path):
    path = tw.write_checkpoint(tmp_path / "transformer", sharded=True)
    cfg = tw._config_from_diffusers(tw.DIFFUSERS_CONFIG)
    abstract = loading.abstract_port_model(tw.TOY_PORT, cfg, dtype=jnp.float32)
    km = tw._key_map(cfg, abstract)
    key = checkpoint.cache_key(path, tw.TOY_PORT, cfg, dtype=jnp.bfloat16, key_map=km)
    assert key["format"] == checkpoint.FORMAT_VERSION and key["dtype"] == "bfloat16"
    assert key["port"] == "toy_weights" and key["port_config"]["split_rope"] is True
    assert [f["name"] for f in key["source"]["files"]] == [
        "diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors"]
    assert key["source"]["index_sha256"] and key["source"]["config_sha256"]
    assert all(f["size"] and f["mtime_ns"] and f["header_sha256"] for f in key["source"]["files"])
    other = checkpoint.cache_key(path, tw.TOY_PORT, cfg, dtype=jnp.bfloat16,
                                 key_map=tw._key_map(tw.ToyPortConfig(split_rope=False), abstract))
    assert other["key_map_sha256"] != key["key_map_sha256"]
    assert checkpoint.entry_dir("c", other) != checkpoint.entry_dir("c", key)
    (path / "diffusion_pytorch_model-00001-of-00002.safetensors").unlink()
    assert checkpoint.cache_key(path, tw.TOY_PORT, cfg, dtype=None, key_map=km) is None


def test_damaged_cache_entry_is_converted_again(tmp_path, counts):
    tensors = tw.torch_weights()
    path = tw.write_checkpoint(tmp_path / "transformer", tensors)
    cache = tmp_path / "cache"
    load(path, cache, mesh=make_mesh(2))
    (entry,) = list(cache.iterdir())
    for f in (entry / checkpoint.PARAMS_DIR).rglob("*"):
        if f.is_file() and ("manifest" in f.name or f.name == "_METADATA"):
            f.write_bytes(b"garbage")
    tw.assert_loaded(load(path, cache, mesh=make_mesh(2)), tw.expected_params(tensors), mesh=make_mesh(2))
    assert counts["open"] == 2
    load(path, cache, mesh=make_mesh(2))  # the entry was rewritten
    assert counts["open"] == 2


def test_explicit_save_restore_pair(tmp_path):
    tensors = tw.torch_weights()
    path = tw.write_checkpoint(tmp_path / "transformer", tensors)
    model = loading.load_transformer(path, mesh=make_mesh(4), config=Config())  # bf16, fp32 norms
    out = tmp_path / "converted"
    checkpoint.save_params(out, model)
    cfg = tw._config_from_diffusers(tw.DIFFUSERS_CONFIG)
    for tp in (4, 2, None):
        mesh = None if tp is None else make_mesh(tp)
        abstract = loading.abstract_port_model(tw.TOY_PORT, cfg, dtype=jnp.bfloat16)
        restored = checkpoint.restore_params(out, abstract, mesh, testing.PLAN)
        tw.assert_loaded(restored, tw.expected_params(tensors), mesh=mesh, dtype=jnp.bfloat16,
                         kept=tw.KEPT_FP32)

    # A model that expects un-permuted q/k (or other shapes) is refused, not silently loaded.
    plain = loading.abstract_port_model(tw.TOY_PORT, tw.ToyPortConfig(split_rope=False), dtype=jnp.bfloat16)
    with pytest.raises(WeightsError, match=r"config differs .* split_rope \(saved True, model False\)"):
        checkpoint.restore_params(out, plain, make_mesh(4), testing.PLAN)
    wide = loading.abstract_port_model(tw.TOY_PORT, tw.ToyPortConfig(ffn=128), dtype=jnp.bfloat16)
    with pytest.raises(WeightsError, match=r"wrong shape for blocks.ff.net.0.proj.kernel(.|\n)*ffn"):
        checkpoint.restore_params(out, wide, None, testing.PLAN)
    with pytest.raises(WeightsError, match="no difflet_meta.json"):
        checkpoint.restore_params(tmp_path / "nothing", plain, None, testing.PLAN)


def test_multihost_decision_is_broadcast(tmp_path, counts, monkeypatch):
    """With several processes, process 0's digest and hit / miss decision are used by all
    (here: one process, broadcast as the identity, through the encode / decode path)."""
    from jax.experimental import multihost_utils

    sent = []
    monkeypatch.setattr(checkpoint, "_num_processes", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: sent.append(x.copy()) or x)
    tensors = tw.torch_weights()
    path = tw.write_checkpoint(tmp_path / "transformer", tensors)
    cache = tmp_path / "cache"
    load(path, cache)  # miss (flag 1), then save (flag 1)
    tw.assert_loaded(load(path, cache), tw.expected_params(tensors))  # hit (flag 2)
    assert counts["open"] == 1
    assert [int(b[0]) for b in sent] == [1, 1, 2]
    (entry,) = list(cache.iterdir())
    assert all(bytes(b[1:]).hex() == entry.name for b in sent)
