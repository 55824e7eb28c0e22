"""VAE loading and input checks (difflet_tpu.vae): bad checkpoints refused naming the key,
the encoder half skipped, unknown keys reported, configs checked, bad latents refused
with the value echoed, non-finite outputs refused."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from difflet_tpu import vae
from difflet_tpu.vae import WeightsError
from difflet_tpu.vae.loading import INDEX_NAME, WEIGHTS_NAME

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "vae"


def copy_vae(case, tmp_path, edit=None, config_edit=None) -> pathlib.Path:
    """A copy of a fixture's vae/ folder, its tensors passed through `edit` (a dict -> dict)."""
    src, dst = FIXTURES / case / "vae", tmp_path / case
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / WEIGHTS_NAME)
    save_file(edit(tensors) if edit else tensors, dst / WEIGHTS_NAME)
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def load(folder, **kw):
    return vae.from_pretrained(folder, dtype=jnp.float32, **kw)


KEY_KL = "decoder.up_blocks.1.resnets.0.conv1.weight"
KEY_3D = "decoder.up_blocks.1.upsamplers.0.time_conv.weight"


@pytest.mark.parametrize("case,key", [("flux_vae", KEY_KL), ("qwen_image_vae", KEY_3D),
                                      ("wan22_vae", "decoder.up_blocks.0.upsampler.resample.1.weight")])
def test_wrong_shape_named(case, key, tmp_path):
    def edit(t):
        t[key] = t[key][:-1]
        return t
    with pytest.raises(WeightsError, match=rf"{key}: shape \[\d+(, \d+)*\], expected"):
        load(copy_vae(case, tmp_path, edit))


@pytest.mark.parametrize("case,key", [("flux_vae", "decoder.mid_block.attentions.0.to_out.0.bias"),
                                      ("qwen_image_vae", "decoder.mid_block.attentions.0.norm.gamma"),
                                      ("sd_vae", "post_quant_conv.weight")])
def test_missing_key_named(case, key, tmp_path):
    def edit(t):
        del t[key]
        return t
    with pytest.raises(WeightsError, match=rf"missing {key} \(expected shape"):
        load(copy_vae(case, tmp_path, edit))


def test_integer_dtype_named(tmp_path):
    key = "decoder.conv_norm_out.weight"

    def edit(t):
        t[key] = t[key].astype(np.int32)
        return t
    with pytest.raises(WeightsError, match=rf"{key}: dtype I32, expected a floating dtype"):
        load(copy_vae("flux_vae", tmp_path, edit))


def test_encoder_half_skipped(tmp_path):
    """Dropping every encoder / quant_conv key changes nothing (the documented skip rule)."""
    def edit(t):
        return {k: v for k, v in t.items() if not k.startswith(("encoder.", "quant_conv."))}
    folder = copy_vae("sd_vae", tmp_path, edit)
    data = np.load(FIXTURES / "sd_vae" / "io.npz")
    got = load(folder).decode(data["image.latents"])
    np.testing.assert_allclose(np.asarray(got), data["image.sample"], atol=2e-5)


def test_unknown_keys_reported(tmp_path):
    """A checkpoint with weights the config does not describe (post_quant_conv weights beside
    `use_post_quant_conv: false`): an error naming them, a warning with strict=False."""
    def config_edit(cfg):
        cfg["use_post_quant_conv"] = False
    folder = copy_vae("sd_vae", tmp_path, config_edit=config_edit)
    with pytest.raises(WeightsError, match=r"2 checkpoint key\(s\) the config does not describe.*post_quant_conv.bias"):
        load(folder)
    with pytest.warns(UserWarning, match="post_quant_conv.weight"):
        load(folder, strict=False)


def test_float16_and_bfloat16_checkpoints_load(tmp_path):
    """Published VAEs are often stored in bfloat16: read and cast to the model dtype."""
    import ml_dtypes

    def edit(t):
        return {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}
    model = load(copy_vae("flux_vae", tmp_path, edit))
    data = np.load(FIXTURES / "flux_vae" / "io.npz")
    got = model.decode(data["image.latents"])
    assert 0 < float(np.linalg.norm(got - data["image.sample"]) / np.linalg.norm(data["image.sample"])) < 2e-2


def test_sharded_checkpoint(tmp_path):
    """A sharded checkpoint (index + two files) loads as the single file; a shard name leaving
    the folder is refused."""
    src = FIXTURES / "flux_vae" / "vae"
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / WEIGHTS_NAME)
    keys = sorted(tensors)
    shards = {"a.safetensors": keys[::2], "b.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, dst / name)
    index = {"weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (dst / INDEX_NAME).write_text(json.dumps(index))
    data = np.load(FIXTURES / "flux_vae" / "io.npz")
    np.testing.assert_allclose(np.asarray(load(dst).decode(data["image.latents"])), data["image.sample"], atol=2e-5)
    index["weight_map"][keys[0]] = "../a.safetensors"
    (dst / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=r"refusing shard name '\.\./a\.safetensors'"):
        load(dst)


def test_no_weights_file(tmp_path):
    shutil.copy(FIXTURES / "flux_vae" / "vae" / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightsError, match=f"neither {WEIGHTS_NAME}"):
        load(tmp_path)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(_class_name="AutoencoderKLCogVideoX"), "_class_name 'AutoencoderKLCogVideoX' is not one of"),
    (lambda c: c.update(norm_num_groups=3), r"block_out_channels \[8, 16\] are not multiples of norm_num_groups 3"),
    (lambda c: c.update(up_block_types=["AttnUpDecoderBlock2D"] * 2), "only UpDecoderBlock2D"),
    (lambda c: c.update(use_temporal_tiling=True), r"unknown config field\(s\) \['use_temporal_tiling'\]"),
])
def test_bad_config_refused(edit, match, tmp_path):
    with pytest.raises((ValueError, WeightsError), match=match):
        load(copy_vae("flux_vae", tmp_path, config_edit=edit))


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(latents_std=c["latents_std"][:-1]), "latents_std has 15 entries, z_dim is 16"),
    (lambda c: c.update(temperal_downsample=[False, True]), r"temperal_downsample \[False, True\] needs"),
    (lambda c: c.update(is_residual=True), r"unknown config field\(s\) \['is_residual'\]"),  # a Wan field
])
def test_bad_causal3d_config_refused(edit, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        load(copy_vae("qwen_image_vae", tmp_path, config_edit=edit))


def test_bad_dtype_refused():
    with pytest.raises(ValueError, match="int32 is not a floating-point dtype"):
        vae.from_pretrained(FIXTURES / "flux_vae" / "vae", dtype=jnp.int32)


@pytest.fixture(scope="module")
def models():
    return {case: load(FIXTURES / case / "vae") for case in ("flux_vae", "qwen_image_vae")}


@pytest.mark.parametrize("shape", [(2, 4, 6, 8), (2, 16, 6), (2, 16, 1, 6, 8), (0, 16, 6, 8)])
def test_bad_latents_flux(models, shape):
    """Wrong channel count, wrong rank, empty: refused before any work, the shape echoed."""
    m = models["flux_vae"]
    for fn in (m.decode, m):
        with pytest.raises(ValueError, match=rf"latents: shape \({', '.join(map(str, shape))},?\), "
                                             r"expected \[batch, 16, height, width\]"):
            fn(np.zeros(shape, np.float32))


@pytest.mark.parametrize("shape", [(2, 8, 1, 4, 6), (2, 16, 4, 6), (1, 16, 0, 4, 6)])
def test_bad_latents_qwen(models, shape):
    m = models["qwen_image_vae"]
    for fn in (m.decode, m.decode_video, m):
        with pytest.raises(ValueError, match=rf"latents: shape \({', '.join(map(str, shape))}\), "
                                             r"expected \[batch, 16, frames, height, width\]"):
            fn(np.zeros(shape, np.float32))


def test_integer_latents_refused(models):
    with pytest.raises(ValueError, match="latents: dtype int32, expected a floating dtype"):
        models["flux_vae"].decode(np.zeros((1, 16, 4, 4), np.int32))


@pytest.mark.parametrize("case,shape", [("flux_vae", (1, 16, 4, 4)), ("qwen_image_vae", (1, 16, 1, 4, 4))])
def test_non_finite_output_refused(models, case, shape):
    z = np.zeros(shape, np.float32)
    z[0, 3, ..., 1, 2] = np.nan
    with pytest.raises(FloatingPointError, match="non-finite"):
        models[case].decode(z)
