"""CLIPVisionModel and its image processor against transformers' float32 outputs
(tests/fixtures/encoders/clip_vision: WanImageToVideoPipeline.encode_image's call, shrunk)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from PIL import Image
from safetensors.numpy import load_file, save_file

from difflet_tpu import encoders
from difflet_tpu.encoders import clip_vision, loading
from difflet_tpu.encoders.runtime import encode_image
from difflet_tpu.pipeline.diffusion import encoder_mesh

CASE = "clip_vision"


@pytest.fixture(scope="module")
def model():
    from pathlib import Path

    return clip_vision.from_pretrained(Path(__file__).resolve().parents[1] / "fixtures" / "encoders" / CASE,
                                       dtype=jnp.float32)


def edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = edit(load_file(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    save_file(tensors, dst / "model.safetensors")
    return dst


# --------------------------------------------------------------------------
# Parity with transformers
# --------------------------------------------------------------------------

def test_parity_hidden_states_minus_2(model, io, compare):
    """Wan's output: hidden_states[-2] (the penultimate layer, before post_layernorm)."""
    data = io(CASE)
    got = encode_image(model, data["in.pixel_values"])
    assert got.shape == (2, 1 + (28 // 7) ** 2, 32) and got.dtype == jnp.float32
    compare(got, data["out.hidden_states_penultimate"], what="hidden_states[-2]")
    # the fixture's penultimate state differs from the last one (else the index could be wrong unseen)
    assert np.abs(data["out.hidden_states_penultimate"] - data["out.last_hidden_state"]).max() > 0.1


@pytest.mark.parametrize("index", [-4, -3, -1, 0, 1, 2, 3])
def test_parity_every_hidden_state(index, model, io, compare):
    data = io(CASE)
    compare(encode_image(model, data["in.pixel_values"], index), data["out.hidden_states"][index],
            what=f"hidden_states[{index}]")


def test_last_hidden_state_and_pooler(model, io, compare):
    """The last layer and post_layernorm are loaded too: last_hidden_state and pooler_output."""
    data = io(CASE)
    last = encode_image(model, data["in.pixel_values"], -1)
    compare(last, data["out.last_hidden_state"], what="last_hidden_state")
    compare(model.pooler_output(last), data["out.pooler_output"], what="pooler_output")


def test_bfloat16_close_to_float32(fixture_dir, io, compare):
    data = io(CASE)
    bf16 = clip_vision.from_pretrained(fixture_dir(CASE))
    assert bf16.encoder.layers[0].mlp.fc1.kernel[...].dtype == jnp.bfloat16
    got = encode_image(bf16, data["in.pixel_values"])
    assert got.dtype == jnp.bfloat16
    compare(got, data["out.hidden_states_penultimate"], rel=3e-2, abs=0.2, what="bf16 hidden_states[-2]")


# --------------------------------------------------------------------------
# Preprocessing: the saved preprocessor_config.json, as diffusers calls it
# --------------------------------------------------------------------------

def test_pixel_values_equal_transformers(fixture_dir, io, tmp_path):
    """uint8 arrays, PIL images and files all give the reference's pixel_values exactly."""
    data = io(CASE)
    processor = clip_vision.load_image_processor(fixture_dir(CASE))
    arrays = [data["in.image0"], data["in.image1"]]
    got = clip_vision.preprocess(processor, arrays)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, data["in.pixel_values"])
    np.testing.assert_array_equal(clip_vision.preprocess(processor, [Image.fromarray(a) for a in arrays]),
                                  data["in.pixel_values"])
    paths = []
    for i, a in enumerate(arrays):
        Image.fromarray(a).save(tmp_path / f"{i}.png")
        paths.append(tmp_path / f"{i}.png")
    np.testing.assert_array_equal(clip_vision.preprocess(processor, paths), data["in.pixel_values"])
    np.testing.assert_array_equal(clip_vision.preprocess(processor, arrays[1]), data["in.pixel_values"][1:])


def test_images_to_embeddings(model, fixture_dir, io, compare):
    """encode_image([image, last_image]) end to end: images -> processor -> hidden_states[-2]."""
    data = io(CASE)
    processor = clip_vision.load_image_processor(fixture_dir(CASE))
    values = clip_vision.preprocess(processor, [data["in.image0"], data["in.image1"]])
    compare(encode_image(model, values), data["out.hidden_states_penultimate"], what="images -> hidden_states[-2]")


def test_bad_images(fixture_dir, tmp_path):
    processor = clip_vision.load_image_processor(fixture_dir(CASE))
    err = clip_vision.ImageProcessorError
    (tmp_path / "not_an_image.png").write_text("hello")
    with pytest.raises(err, match=r"image 1: cannot read .*not_an_image\.png"):
        clip_vision.preprocess(processor, [np.zeros((8, 8, 3), np.uint8), tmp_path / "not_an_image.png"])
    with pytest.raises(err, match="cannot read .*missing.png"):
        clip_vision.preprocess(processor, str(tmp_path / "missing.png"))
    with pytest.raises(err, match="must be uint8 .* got dtype float32"):
        clip_vision.preprocess(processor, np.zeros((8, 8, 3), np.float32))
    with pytest.raises(err, match=r"got shape \(8, 8, 5\)"):
        clip_vision.preprocess(processor, np.zeros((8, 8, 5), np.uint8))
    with pytest.raises(err, match=r"got shape \(2, 8, 8, 3\)"):
        clip_vision.preprocess(processor, np.zeros((2, 8, 8, 3), np.uint8))
    with pytest.raises(err, match="is empty"):
        clip_vision.preprocess(processor, np.zeros((0, 8, 3), np.uint8))
    with pytest.raises(err, match="no image given"):
        clip_vision.preprocess(processor, [])
    with pytest.raises(err, match="expected a PIL image, .* got int"):
        clip_vision.preprocess(processor, 3)


def test_bad_processor_folder(fixture_dir, tmp_path):
    err = clip_vision.ImageProcessorError
    with pytest.raises(err, match="preprocessor_config.json: cannot read it"):
        clip_vision.load_image_processor(tmp_path)
    cfg = json.loads((fixture_dir(CASE) / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**cfg, "image_processor_type": "SiglipImageProcessor"}))
    with pytest.raises(err, match="declares 'SiglipImageProcessor'"):
        clip_vision.load_image_processor(tmp_path)


# --------------------------------------------------------------------------
# Tensor parallelism
# --------------------------------------------------------------------------

def test_sharded_tp4_equals_one_device(model, fixture_dir, io, compare, mesh4):
    data = io(CASE)
    assert encoder_mesh(clip_vision, model.config, mesh4) is mesh4
    tp = clip_vision.from_pretrained(fixture_dir(CASE), dtype=jnp.float32, mesh=mesh4)
    q = tp.encoder.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.spec == P(None, "tp") and q.sharding.shard_shape(q.shape) == (32, 8)
    assert tp.encoder.layers[2].mlp.fc2.kernel[...].sharding.spec == P("tp", None)
    assert tp.embeddings.patch_embedding.weight[...].sharding.spec == P()
    for index in (-2, -1):
        got = encode_image(tp, data["in.pixel_values"], index)
        compare(got, encode_image(model, data["in.pixel_values"], index), rel=1e-6, abs=5e-6,
                what=f"tp4 vs one device [{index}]")
        compare(got, data["out.hidden_states"][index], what=f"tp4 vs transformers [{index}]")


def test_heads_not_divisible_by_tp(model, fixture_dir):
    mesh = Mesh(np.array(jax.devices()[:3]), ("tp",))
    with pytest.raises(ValueError, match="num_attention_heads 4 does not divide over tp=3"):
        clip_vision.from_pretrained(fixture_dir(CASE), mesh=mesh)
    assert encoder_mesh(clip_vision, model.config, mesh) is None  # the pipeline then keeps it on one device


def vit_h_count(c):
    d, f, p = c.hidden_size, c.intermediate_size, c.patch_size
    layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
    return d * c.num_channels * p * p + d + c.num_positions * d + c.num_hidden_layers * layer + 2 * 2 * d


def test_vit_h_14_abstract_sharded(mesh4):
    """Wan2.1 I2V's image encoder at its released size: 630.8M parameters (open_clip's ViT-H-14
    visual tower, 632.1M, less its 1280x1024 projection), abstract on tp=4, the forward traced."""
    config = clip_vision.CLIP_VIT_H_14
    model = encoders.abstract(config, jnp.bfloat16, mesh4)
    assert loading.num_params(model) == vit_h_count(config) == 630_766_080
    params = loading.flat_params(model)
    assert {v.get_value().dtype for v in params.values()} == {jnp.dtype(jnp.bfloat16)}  # the patch kernel too
    assert params["encoder.layers.31.self_attn.q_proj.kernel"].get_value().sharding == NamedSharding(mesh4, P(None, "tp"))
    assert params["encoder.layers.0.mlp.fc2.kernel"].get_value().sharding == NamedSharding(mesh4, P("tp", None))
    graphdef, state = nnx.split(model)
    out = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state,
                         jax.ShapeDtypeStruct((2, 3, 224, 224), jnp.float32))
    assert out.shape == (2, 257, 1280) and out.dtype == jnp.bfloat16


# --------------------------------------------------------------------------
# Bad weights, configs and inputs: refused before the work
# --------------------------------------------------------------------------

def test_transformers4_layout(fixture_dir, io, tmp_path, compare):
    """transformers 4.x CLIPVisionModel checkpoints (the published Wan2.1 I2V image_encoder/):
    every key under `vision_model.`, and a `position_ids` buffer (a documented skip)."""
    def edit(t):
        out = {f"vision_model.{k}": v for k, v in t.items()}
        out["vision_model.embeddings.position_ids"] = np.arange(17, dtype=np.int64)[None]
        return out

    folder = edited_copy(fixture_dir(CASE), tmp_path / "v4", edit)
    data = io(CASE)
    got = encode_image(clip_vision.from_pretrained(folder, dtype=jnp.float32), data["in.pixel_values"])
    compare(got, data["out.hidden_states_penultimate"], what="4.x layout")


@pytest.mark.parametrize("key", ["post_layernorm.weight", "embeddings.class_embedding", "pre_layrnorm.bias",
                                 "encoder.layers.2.self_attn.v_proj.bias"])
def test_missing_key(key, fixture_dir, tmp_path):
    folder = edited_copy(fixture_dir(CASE), tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(ValueError, match=f"missing key .*{key.replace('.', '[.]')}"):
        clip_vision.from_pretrained(folder)


def test_wrong_shape_dtype_unexpected(fixture_dir, tmp_path):
    def edit(t):
        t["embeddings.patch_embedding.weight"] = t["embeddings.patch_embedding.weight"][:, :, :6, :6]
        t["embeddings.class_embedding"] = t["embeddings.class_embedding"].astype(np.int32)
        t["visual_projection.weight"] = np.zeros((16, 32), np.float32)  # CLIPVisionModelWithProjection's
        return t

    folder = edited_copy(fixture_dir(CASE), tmp_path / "bad", edit)
    with pytest.raises(ValueError) as e:
        clip_vision.from_pretrained(folder)
    msg = str(e.value)
    assert r"embeddings.patch_embedding.weight: shape (32, 3, 6, 6), expected (32, 3, 7, 7)" in msg
    assert "embeddings.class_embedding: dtype I32, expected a floating dtype" in msg
    assert "unexpected keys (not used by this model, not a documented skip): visual_projection.weight" in msg


def test_wrong_config(fixture_dir, tmp_path):
    folder = tmp_path / "cfg"
    shutil.copytree(fixture_dir(CASE), folder)
    cfg = json.loads((folder / "config.json").read_text())
    for bad, match in [({"model_type": "clip_text_model"}, "model_type 'clip_text_model'"),
                       ({"image_size": 30}, "image_size 30 is not a multiple of patch_size 7"),
                       ({"num_attention_heads": 5}, "hidden_size 32 is not a multiple of num_attention_heads 5"),
                       ({"image_size": [28, 28]}, "image_size must be an int"),
                       ({"hidden_act": "swish"}, "unsupported activation 'swish'")]:
        (folder / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ValueError, match=match):
            clip_vision.from_pretrained(folder)
    # a full CLIPConfig's vision_config reads as the same config
    full = {"model_type": "clip", "text_config": {"model_type": "clip_text_model"}, "vision_config": cfg}
    assert clip_vision.CLIPVisionConfig.from_dict(full) == clip_vision.CLIPVisionConfig.from_dict(cfg)
    # fields a config.json omits take transformers' CLIPVisionConfig defaults (ViT-B/32's)
    assert clip_vision.CLIPVisionConfig.from_dict({"model_type": "clip_vision_model"}).hidden_act == "quick_gelu"


def test_bad_inputs(model, io):
    values = io(CASE)["in.pixel_values"]
    with pytest.raises(ValueError, match=r"must be \[batch, 3, 28, 28\] .* got shape \(2, 3, 32, 32\)"):
        encode_image(model, np.zeros((2, 3, 32, 32), np.float32))
    with pytest.raises(ValueError, match=r"got shape \(3, 28, 28\)"):
        encode_image(model, values[0])
    with pytest.raises(ValueError, match=r"got shape \(2, 28, 28, 3\)"):
        encode_image(model, values.transpose(0, 2, 3, 1))
    with pytest.raises(TypeError, match="must be floating .* got uint8"):
        encode_image(model, values.astype(np.uint8))
    with pytest.raises(TypeError, match="float array"):
        encode_image(model, values.tolist())
    with pytest.raises(ValueError, match=r"hidden_state must be an int in \[-4, 3\]"):
        encode_image(model, values, 4)
    with pytest.raises(ValueError, match=r"hidden_state must be an int in \[-4, 3\]"):
        encode_image(model, values, -5)


def test_non_finite_output_is_an_error(fixture_dir, io):
    model = clip_vision.from_pretrained(fixture_dir(CASE), dtype=jnp.float32)
    model.encoder.layers[0].mlp.fc2.bias[...] = jnp.full((32,), jnp.nan)
    with pytest.raises(FloatingPointError, match="not finite"):
        encode_image(model, io(CASE)["in.pixel_values"])


def test_megatron_collectives(model, fixture_dir, mesh4):
    """Under tp=4 GSPMD partitions the forward with one all-reduce after each row-parallel product
    of the layers it runs (hidden_states[-2] of 3 layers: 2 layers, 4 all-reduces) and no other
    collective: the patch / class / position embeddings and the norms stay replicated."""
    import re
    from collections import Counter

    collective = re.compile(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
    tp = clip_vision.from_pretrained(fixture_dir(CASE), dtype=jnp.float32, mesh=mesh4)
    graphdef, state = nnx.split(tp)
    x = jnp.zeros((2, 3, 28, 28), jnp.float32)
    for index, layers in ((-2, 2), (-1, 3)):
        hlo = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v, index)).lower(state, x).compile().as_text()
        assert Counter(collective.findall(hlo)) == {"all-reduce": 2 * layers}
