"""Loading transformers folders: layouts (prefixes, shards, bf16), bad weights, bad inputs, bad meshes."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from safetensors.numpy import load_file, save_file

from difflet_tpu.encoders import clip, decoder_lm, loading, t5
from difflet_tpu.encoders.runtime import encode

MODULES = {"clip": clip, "t5": t5, "umt5": t5, "qwen2_5_vl": decoder_lm}


def edited_copy(src, dst, edit):
    """A copy of fixture folder `src` whose tensors are `edit(tensors)`."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    save_file(tensors, dst / "model.safetensors")
    return dst


def outputs(module, folder, data, **kw):
    model = module.from_pretrained(folder, dtype=jnp.float32, **kw)
    return jax.tree.leaves(encode(model, data["in.input_ids"], data.get("in.attention_mask")))


# --------------------------------------------------------------------------
# Layouts that must load (and give the same model)
# --------------------------------------------------------------------------

def test_clip_transformers4_layout(fixture_dir, io, tmp_path, compare):
    """transformers 4.x CLIPTextModel checkpoints: every key under `text_model.`, plus the
    `position_ids` buffer (a documented skip)."""
    def edit(t):
        out = {f"text_model.{k}": v for k, v in t.items()}
        out["text_model.embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]
        return out

    folder = edited_copy(fixture_dir("clip"), tmp_path / "clip4", edit)
    data = io("clip")
    for got, name in zip(outputs(clip, folder, data), ("last_hidden_state", "pooler_output")):
        compare(got, data["out." + name], what=name)


def test_t5_embedding_aliases(fixture_dir, io, tmp_path, compare):
    """`encoder.embed_tokens.weight` alone stands for `shared.weight`; beside it (and beside a
    decoder) it is a documented skip."""
    data = io("t5")
    only = edited_copy(fixture_dir("t5"), tmp_path / "only",
                       lambda t: {("encoder.embed_tokens.weight" if k == "shared.weight" else k): v
                                  for k, v in t.items()})
    compare(outputs(t5, only, data)[0], data["out.last_hidden_state"], what="embed_tokens only")
    both = edited_copy(fixture_dir("t5"), tmp_path / "both",
                       lambda t: {**t, "encoder.embed_tokens.weight": t["shared.weight"],
                                  "decoder.final_layer_norm.weight": t["encoder.final_layer_norm.weight"]})
    compare(outputs(t5, both, data)[0], data["out.last_hidden_state"], what="shared + embed_tokens + decoder")


def test_qwen_new_layout(fixture_dir, io, tmp_path, compare):
    """transformers >= 4.52 layout: `model.language_model.*`, `model.visual.*`, `lm_head.*`."""
    def edit(t):
        return {("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)): v
                for k, v in t.items()}

    folder = edited_copy(fixture_dir("qwen2_5_vl"), tmp_path / "new", edit)
    assert any(k.startswith("model.visual.") for k in load_file(folder / "model.safetensors"))
    data = io("qwen2_5_vl")
    compare(outputs(decoder_lm, folder, data)[0], data["out.hidden_states_last"], what="new layout")


def test_sharded_index(fixture_dir, io, tmp_path, compare):
    """`model.safetensors.index.json` + shards, as the published 7B checkpoint."""
    src = fixture_dir("qwen2_5_vl")
    folder = tmp_path / "sharded"
    shutil.copytree(src, folder)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, folder / name)
    weight_map = {k: name for name, ks in shards.items() for k in ks}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    data = io("qwen2_5_vl")
    compare(outputs(decoder_lm, folder, data)[0], data["out.hidden_states_last"], what="sharded index")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        decoder_lm.from_pretrained(folder)


def test_bfloat16_checkpoint(fixture_dir, tmp_path):
    """bf16 tensors (as published) read exactly, by safetensors and by the raw-layout fallback."""
    folder = edited_copy(fixture_dir("t5"), tmp_path / "bf16",
                         lambda t: {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})
    key = "encoder.block.0.layer.0.SelfAttention.q.weight"
    want = load_file(fixture_dir("t5") / "model.safetensors")[key].astype(ml_dtypes.bfloat16)
    raw = loading._read_raw(folder / "model.safetensors", key)
    assert raw.dtype == ml_dtypes.bfloat16 and np.array_equal(raw.view(np.uint16), want.view(np.uint16))
    model = t5.from_pretrained(folder, dtype=jnp.float32)
    q = np.asarray(model.encoder.block[0].layer[0].SelfAttention.q.kernel[...])
    np.testing.assert_array_equal(q, want.astype(np.float32).T)


# --------------------------------------------------------------------------
# Bad weights: refused before the work, naming the key
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case,key", [("clip", "encoder.layers.1.mlp.fc2.weight"),
                                      ("t5", "encoder.block.1.layer.0.SelfAttention.o.weight"),
                                      ("umt5", "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"),
                                      ("qwen2_5_vl", "model.layers.1.self_attn.k_proj.bias")])
def test_missing_key(case, key, fixture_dir, tmp_path):
    folder = edited_copy(fixture_dir(case), tmp_path / case, lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(ValueError, match=f"missing key .*{key.replace('.', '[.]')}"):
        MODULES[case].from_pretrained(folder)


@pytest.mark.parametrize("case,key", [("clip", "encoder.layers.0.self_attn.q_proj.weight"),
                                      ("t5", "encoder.block.0.layer.1.DenseReluDense.wi_1.weight"),
                                      ("qwen2_5_vl", "model.layers.0.mlp.down_proj.weight")])
def test_wrong_shape(case, key, fixture_dir, tmp_path):
    def edit(t):
        t[key] = np.concatenate([t[key], t[key]], axis=0)
        return t

    folder = edited_copy(fixture_dir(case), tmp_path / case, edit)
    with pytest.raises(ValueError, match=f"{key.replace('.', '[.]')}: shape"):
        MODULES[case].from_pretrained(folder)


@pytest.mark.parametrize("case,key", [("clip", "final_layer_norm.bias"), ("t5", "shared.weight"),
                                      ("qwen2_5_vl", "model.norm.weight")])
def test_integer_dtype(case, key, fixture_dir, tmp_path):
    def edit(t):
        t[key] = t[key].astype(np.int32)
        return t

    folder = edited_copy(fixture_dir(case), tmp_path / case, edit)
    with pytest.raises(ValueError, match=f"{key.replace('.', '[.]')}: dtype I32, expected a floating dtype"):
        MODULES[case].from_pretrained(folder)


@pytest.mark.parametrize("case,key", [("clip", "encoder.layers.2.mlp.fc1.weight"),  # a layer the config lacks
                                      ("t5", "encoder.block.0.layer.2.DenseReluDense.wi.weight"),
                                      ("qwen2_5_vl", "model.layers.0.self_attn.o_proj.bias")])
def test_unexpected_key(case, key, fixture_dir, tmp_path):
    folder = edited_copy(fixture_dir(case), tmp_path / case, lambda t: {**t, key: np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match=f"unexpected keys .*{key.replace('.', '[.]')}"):
        MODULES[case].from_pretrained(folder)


def test_wrong_config(fixture_dir, tmp_path):
    folder = tmp_path / "t5"
    shutil.copytree(fixture_dir("t5"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "feed_forward_proj": "gelu-gated"}))
    with pytest.raises(ValueError, match="feed_forward_proj"):
        t5.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert'"):
        t5.from_pretrained(folder)
    with pytest.raises(TypeError, match="floating"):
        t5.from_pretrained(fixture_dir("t5"), dtype=jnp.int32)


# --------------------------------------------------------------------------
# Bad meshes
# --------------------------------------------------------------------------

def test_mesh_without_tp_axis(fixture_dir):
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    with pytest.raises(ValueError, match="axis named 'tp'"):
        clip.from_pretrained(fixture_dir("clip"), mesh=mesh)


@pytest.mark.parametrize("case,what", [("clip", "num_attention_heads 4"), ("t5", "num_heads 4"),
                                       ("qwen2_5_vl", "num_attention_heads 8")])
def test_heads_not_divisible_by_tp(case, what, fixture_dir):
    mesh = Mesh(np.array(jax.devices()[:3]), ("tp",))
    with pytest.raises(ValueError, match=f"{what} does not divide over tp=3"):
        MODULES[case].from_pretrained(fixture_dir(case), mesh=mesh)


# --------------------------------------------------------------------------
# Bad inputs: refused before the forward
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "fixtures" / "encoders"
    return {case: MODULES[case].from_pretrained(root / case, dtype=jnp.float32)
            for case in ("clip", "t5", "qwen2_5_vl")}


@pytest.mark.parametrize("case", ["clip", "t5", "qwen2_5_vl"])
def test_bad_inputs(case, models):
    model = models[case]
    vocab = model.config.vocab_size
    ids = np.ones((2, 6), np.int32)
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\], got shape \(6,\)"):
        encode(model, ids[0])
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\], got shape \(1, 2, 6\)"):
        encode(model, ids[None])
    with pytest.raises(TypeError, match="integer dtype, got float32"):
        encode(model, ids.astype(np.float32))
    with pytest.raises(TypeError, match="integer array"):
        encode(model, [[1, 2, 3]])
    bad = ids.copy()
    bad[1, 3] = vocab
    with pytest.raises(ValueError, match=rf"must be in \[0, {vocab}\) .*got \[1, {vocab}\]"):
        encode(model, bad)
    bad[1, 3] = -1
    with pytest.raises(ValueError, match=rf"must be in \[0, {vocab}\)"):
        encode(model, bad)
    with pytest.raises(ValueError, match=r"attention_mask must have input_ids' shape \(2, 6\), got \(2, 5\)"):
        encode(model, ids, np.ones((2, 5), np.int32))
    with pytest.raises(ValueError, match="only 0 and 1"):
        encode(model, ids, np.full((2, 6), 2, np.int32))
    with pytest.raises(TypeError, match="attention_mask must be bool, integer or float"):
        encode(model, ids, np.ones((2, 6), np.complex64))
    encode(model, ids, np.ones((2, 6), bool))  # bool and float masks are fine


def test_non_finite_output_is_an_error(fixture_dir, io):
    model = clip.from_pretrained(fixture_dir("clip"), dtype=jnp.float32)
    model.encoder.layers[1].mlp.fc2.bias[...] = jnp.full((32,), jnp.inf)
    with pytest.raises(FloatingPointError, match="not finite"):
        encode(model, io("clip")["in.input_ids"])


def test_runtime_imports_no_torch_or_transformers():
    import subprocess
    import sys

    code = ("import sys, difflet_tpu.encoders; "
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'diffusers'}); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
