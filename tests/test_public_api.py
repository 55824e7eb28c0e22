"""The API the README and docs promise: top-level names, diffusers' output object,
`subfolder=`, and the errors for a pipeline root or a hub id."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import difflet_tpu
from difflet_tpu.config import Config
from difflet_tpu.loading import WeightsError
from difflet_tpu.models import flux
from difflet_tpu.port import Transformer2DModelOutput

PIPELINE = pathlib.Path(__file__).parent / "fixtures" / "pipelines" / "flux_schnell"


@pytest.fixture(scope="module")
def model():
    return difflet_tpu.load_transformer(PIPELINE, subfolder="transformer", dtype=jnp.float32, config=Config())


def test_subfolder_loads_the_pipelines_transformer(model):
    direct = difflet_tpu.load_transformer(PIPELINE / "transformer", dtype=jnp.float32, config=Config())
    from flax import nnx

    a = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    b = dict(nnx.to_flat_state(nnx.state(direct, nnx.Param)))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))


def test_return_dict_as_diffusers(model):
    kw = flux.example_inputs(model.config, height=32, width=32, text_len=8)
    run = difflet_tpu.Runner(model, None, Config())
    out = run(**kw)  # return_dict=True, diffusers' default
    assert isinstance(out, Transformer2DModelOutput)
    (plain,) = run(**kw, return_dict=False)
    assert out.sample.shape == kw["hidden_states"].shape
    np.testing.assert_array_equal(np.asarray(out.sample), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(plain))  # BaseOutput's indexing


def test_a_pipeline_root_says_what_to_pass():
    with pytest.raises(WeightsError, match=r"pipeline folder \(model_index.json\); pass its transformer: "
                                           r".*subfolder='transformer'.*DiffusionPipeline.from_pretrained"):
        difflet_tpu.load_transformer(PIPELINE, dtype=jnp.float32)


def test_a_hub_id_is_not_downloaded():
    with pytest.raises(WeightsError, match=r"'black-forest-labs/FLUX.1-dev' is not a folder here; it looks like "
                                           r"a hub id, and nothing is downloaded"):
        difflet_tpu.load_transformer("black-forest-labs/FLUX.1-dev")


@pytest.mark.parametrize("bad", ["", "/abs", 3])
def test_bad_subfolder(bad):
    with pytest.raises(WeightsError, match=r"subfolder: .*expected a relative folder name"):
        difflet_tpu.load_transformer(PIPELINE, subfolder=bad)


def test_top_level_names():
    assert {"Config", "make_mesh", "Runner", "load_transformer", "DiffusionPipeline"} <= set(difflet_tpu.__all__)
    from difflet_tpu.pipeline.diffusion import DiffusionPipeline

    assert difflet_tpu.DiffusionPipeline is DiffusionPipeline


def test_one_device_step_traced_once_whatever_the_inputs_commitment(model):
    """Fresh noise (uncommitted) at step 1 and an update's output (committed) at step 2
    run the same compiled step: the Runner commits inputs to the parameters' device."""
    import jax

    kw = flux.example_inputs(model.config, height=32, width=32, text_len=8)
    run = difflet_tpu.Runner(model, None, Config())
    first = run(**{**kw, "hidden_states": jax.random.normal(jax.random.key(0), kw["hidden_states"].shape)}).sample
    committed = jax.jit(lambda x: x * 0.5)(first)
    run(**{**kw, "hidden_states": committed})
    (step,) = run._steps.values()
    assert step._cache_size() == 1
