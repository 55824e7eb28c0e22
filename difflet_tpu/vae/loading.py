"""Reading a published diffusers `vae/` folder, and the jitted, batch-sharded decode call.

A folder holds `config.json` and `diffusion_pytorch_model.safetensors` (or shards
named by `diffusion_pytorch_model.safetensors.index.json`). Every decoder
parameter (an `nnx.Param` made by `layers.param`) maps to the checkpoint key
`<module path joined by dots>.<torch_leaf>`, e.g. the path
`("decoder", "up_blocks", 0, "resnets", 1, "conv1", "kernel")` reads
`decoder.up_blocks.0.resnets.1.conv1.weight` and is transposed OIHW -> HWIO.

Rules:
- every needed key must be present, of the checkpoint shape, of a floating dtype
  (F16 / BF16 / F32 / F64); the first problems are named in one `WeightsError`;
- keys of the encoder half (`ENCODER_PREFIXES`: `encoder.*`, `quant_conv.*`) are
  skipped unless the model builds its encoder (`from_pretrained(..., encoder=True)`),
  then they are needed like the rest;
- any other key is unknown (a config that does not describe the checkpoint, e.g.
  `use_post_quant_conv: false` beside `post_quant_conv.*` weights): an error, or a
  warning with `strict=False`.
"""

from __future__ import annotations

import json
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from difflet_tpu.vae import spread as vae_spread
from difflet_tpu.vae.layers import from_torch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
ENCODER_PREFIXES = ("encoder.", "quant_conv.")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


class WeightsError(ValueError):
    """A checkpoint that does not fit the model its config describes."""


def read_config(folder, class_names: tuple[str, ...]) -> dict:
    """`config.json` of a VAE folder; its `_class_name` (if any) must be one of `class_names`."""
    path = pathlib.Path(folder) / CONFIG_NAME
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightsError(f"{path}: no config.json (expected a diffusers vae/ folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path}: a {type(config).__name__}, not a JSON object")
    name = config.get("_class_name")
    if name is not None and name not in class_names:
        raise WeightsError(f"{path}: _class_name {name!r} is not one of {list(class_names)}")
    return config


def config_fields(config: dict, known: set[str], where: str) -> dict:
    """The config's entries without the `_`-prefixed bookkeeping; unknown names refused
    (they mean a model this port does not describe)."""
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{where}: unknown config field(s) {unknown}")
    return fields


class Checkpoint:
    """The safetensors file(s) of a diffusers model folder, read lazily."""

    def __init__(self, folder):
        from safetensors import safe_open

        self.folder = pathlib.Path(folder)
        index = self.folder / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise WeightsError(f"{index}: not a safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
            for f in files:  # shard names stay inside the folder
                p = pathlib.PurePosixPath(str(f))
                if not isinstance(f, str) or not f or p.is_absolute() or ".." in p.parts:
                    raise WeightsError(f"{index}: refusing shard name {f!r}")
        elif (self.folder / WEIGHTS_NAME).exists():
            weight_map, files = None, [WEIGHTS_NAME]
        else:
            raise WeightsError(f"{self.folder}: neither {WEIGHTS_NAME} nor {INDEX_NAME}")
        self.handles, self.where = {}, {}
        for f in files:
            try:
                self.handles[f] = safe_open(str(self.folder / f), framework="np")
            except Exception as e:  # safetensors raises its own error types
                raise WeightsError(f"{self.folder / f}: cannot read safetensors file ({e})") from None
            for k in self.handles[f].keys():
                self.where[k] = f
        if weight_map is not None:
            wrong = sorted(k for k, f in weight_map.items() if self.where.get(k) != f)
            if wrong:
                raise WeightsError(f"{index}: {len(wrong)} key(s) not in the shard it names, e.g. {wrong[:3]}")

    def keys(self):
        return self.where.keys()

    def _slice(self, key):
        return self.handles[self.where[key]].get_slice(key)

    def shape(self, key) -> tuple:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key) -> str:
        return self._slice(key).get_dtype()

    def read(self, key) -> np.ndarray:
        try:
            return np.asarray(self.handles[self.where[key]].get_tensor(key))
        except Exception as e:
            raise WeightsError(f"{self.folder / self.where[key]}: cannot read {key} ({e})") from None


def param_keys(model: nnx.Module) -> dict[str, nnx.Param]:
    """Checkpoint key -> parameter, for every `nnx.Param` of the model (`layers.param` metadata)."""
    out = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            out[".".join(map(str, path[:-1] + (var.torch_leaf,)))] = var
    return out


def load_weights(model: nnx.Module, folder, *, dtype, mesh: Mesh | None = None, strict: bool = True):
    """Fill every parameter of `model` (built abstractly, `nnx.eval_shape`) from the folder's
    checkpoint, cast to `dtype`, replicated over `mesh` if given. Checks everything first."""
    ckpt = Checkpoint(folder)
    wanted = param_keys(model)
    problems = []
    for key, var in wanted.items():
        if key not in ckpt.where:
            problems.append(f"missing {key} (expected shape {list(var.torch_shape)})")
            continue
        shape, dt = ckpt.shape(key), ckpt.dtype(key)
        if shape != var.torch_shape:
            problems.append(f"{key}: shape {list(shape)}, expected {list(var.torch_shape)}")
        if dt not in FLOAT_DTYPES:
            problems.append(f"{key}: dtype {dt}, expected a floating dtype {list(FLOAT_DTYPES)}")
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        if any(k.startswith(ENCODER_PREFIXES) and k not in ckpt.where for k in wanted):
            more += " (the encoder half was asked for, encoder=True, and the checkpoint lacks it)"
        raise WeightsError(f"{ckpt.folder}: " + "; ".join(problems[:8]) + more)
    unknown = sorted(k for k in ckpt.keys() if k not in wanted and not k.startswith(ENCODER_PREFIXES))
    if unknown:
        msg = (f"{ckpt.folder}: {len(unknown)} checkpoint key(s) the config does not describe "
               f"(not decoder, not encoder half): {unknown[:8]}")
        if strict:
            raise WeightsError(msg)
        warnings.warn(msg, stacklevel=3)
    sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    for key, var in wanted.items():
        value = from_torch(ckpt.read(key), var.torch_layout, var.get_value().shape)
        value = jnp.asarray(value, dtype)
        var.set_value(value if sharding is None else jax.device_put(value, sharding))
    return model


def from_pretrained(cls, config_cls, folder, *, dtype, mesh: Mesh | None, strict: bool, **options):
    """`cls` (a VAE whose config is `config_cls`) built from a diffusers `vae/` folder: the config
    checked against `cls.CLASS_NAMES`, the weights checked and placed (`load_weights`).
    `options` go to `cls` (e.g. `encoder=True`)."""
    config = config_cls.from_dict(read_config(folder, cls.CLASS_NAMES))
    model = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=None, **options))
    load_weights(model, folder, dtype=model.dtype, mesh=mesh, strict=strict)
    model.mesh = mesh
    return model


def check_latents(z, channels: int, axes: tuple[str, ...], layout: str) -> None:
    """Refuse what is not a `[batch, channels, *axes]` floating array (diffusers' `layout`)."""
    shape = tuple(getattr(z, "shape", ()))
    if len(shape) != 2 + len(axes) or shape[1] != channels or 0 in shape:
        raise ValueError(f"latents: shape {shape}, expected [batch, {channels}, {', '.join(axes)}] ({layout})")
    if not jnp.issubdtype(z.dtype, jnp.floating):
        raise ValueError(f"latents: dtype {z.dtype}, expected a floating dtype")


def check_dtype(dtype):
    d = jnp.dtype(dtype)
    if not jnp.issubdtype(d, jnp.floating):
        raise ValueError(f"dtype: {d.name} is not a floating-point dtype (use jnp.bfloat16 or jnp.float32)")
    return d


# --------------------------------------------------------------------------
# The jitted decode call
# --------------------------------------------------------------------------

def batch_sharding(mesh: Mesh | None, shape) -> NamedSharding | None:
    """The batch axis over every device of the mesh when it divides the batch, else
    replicated (None without a mesh)."""
    if mesh is None:
        return None
    if shape[0] % mesh.size == 0:
        return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    return NamedSharding(mesh, PartitionSpec())


def to_uint8(x):
    """Pixels in [-1, 1] to uint8 as diffusers' `VaeImageProcessor` (`denormalize`:
    `(x * 0.5 + 0.5).clamp(0, 1)`) then `numpy_to_pil` (`(x * 255).round()`, half to even,
    as numpy) in float32. diffusers' `export_to_video` of float frames truncates instead
    (`(frame * 255).astype(np.uint8)`): at most one level lower."""
    y = jnp.clip(x.astype(jnp.float32) * 0.5 + 0.5, 0.0, 1.0)
    return jnp.round(y * 255.0).astype(jnp.uint8)


def _apply(graphdef, state, method: str, x, options: tuple = (), uint8: bool = False):
    model = nnx.merge(graphdef, state)
    if uint8 and method in getattr(model, "UINT8_METHODS", ()):
        # the method converts as it decodes, chunk by chunk: (uint8 frames, all finite)
        return getattr(model, method)(x, uint8=True, **dict(options))
    out = getattr(model, method)(x, **dict(options)).astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(out))
    if uint8:  # only the uint8 frames leave the devices: channels last, as diffusers' output_type="np"
        out = jnp.moveaxis(to_uint8(out), 1, -1)
    return out, finite


_apply_jit = jax.jit(_apply, static_argnums=(0, 2, 4, 5))  # compiled once per (model, method, options, shape)


def call_jitted(model: nnx.Module, method: str, x, mesh: Mesh | None, *, options: tuple = (),
                uint8: bool = False, batch_split: bool = True):
    """`model.<method>(x, **dict(options))` under `jax.jit` as float32 (`uint8`: as uint8
    channels-last pixels, `to_uint8`), the batch sharded over `mesh` when it divides and
    `batch_split` (else `x` replicated); refuses non-finite results."""
    sharding = batch_sharding(mesh, x.shape) if batch_split or mesh is None else NamedSharding(mesh, PartitionSpec())
    x = jnp.asarray(x) if sharding is None else jax.device_put(x, sharding)
    graphdef, state = nnx.split(model)
    out, finite = _apply_jit(graphdef, state, method, x, tuple(options), bool(uint8))
    if not bool(finite):
        raise FloatingPointError(f"{type(model).__name__}.{method}: the output has non-finite values")
    return out


def call_decode(model: nnx.Module, method: str, latents, *, spread: str | None = None, axis: str | None = None,
                uint8: bool = False):
    """A video VAE's jitted decode `model.<method>(latents, spread_axis=...)` (`call_jitted`): each
    video's rows spread over `model.mesh` (`spread.choose`: `spread` "auto" / "on" / "off", None
    for `Config.vae_spread`; `axis` "height" / "width", None to choose), else the batch sharded
    when the devices divide it."""
    split = vae_spread.choose(model.mesh, latents.shape, spread, axis)
    return call_jitted(model, method, latents, model.mesh, options=(("spread_axis", split),), uint8=uint8,
                       batch_split=split is None)
