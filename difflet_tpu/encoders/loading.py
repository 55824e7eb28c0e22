"""Loading transformers-format encoder folders into the NNX models, and abstract models.

A folder is what `save_pretrained` writes and what diffusers checkpoints publish under
`text_encoder/`, `text_encoder_2/`: `config.json` plus `model.safetensors`, or
`model.safetensors.index.json` and its shards.

Key rule: an NNX parameter path `a.b.0.c.kernel` is the torch key `a.b.0.c.weight`, transposed
(torch Linear weights are `[out, in]`, kernels `[in, out]`); every other leaf keeps its name.
Each model adds its candidates for that key (`candidates(path)`: optional prefixes such as
CLIP's `text_model.`, aliases such as T5's `encoder.embed_tokens.weight` for `shared.weight`)
and its documented skips (checkpoint keys the encoder does not use: a vision tower, an LM head,
a decoder). Before any tensor is read, every expected key is checked present with the expected
shape and a floating dtype, and every checkpoint key that is neither used nor skipped is an
error: both name the key.

Each tensor is read with `safetensors` (numpy), cast to the model dtype on the host, and
placed with `NamedSharding(mesh, spec)` (its `tp_spec`, layers.py) on `mesh`, or on one device.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

# safetensors dtype names -> numpy dtypes (bfloat16 from ml_dtypes)
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


# --------------------------------------------------------------------------
# Parameters of a model: paths, torch keys, partition specs
# --------------------------------------------------------------------------

def param_path(path: Iterable) -> str:
    return ".".join(str(p) for p in path)


def torch_key(path: str) -> tuple[str, bool]:
    """NNX parameter path -> (torch key, transpose?)."""
    head, _, leaf = path.rpartition(".")
    if leaf == "kernel":
        return f"{head}.weight", True
    return path, False


def flat_params(model) -> dict[str, nnx.Variable]:
    """`{path: Param}` of a model (concrete or abstract)."""
    return {param_path(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def partition_specs(model):
    """The `PartitionSpec` of each parameter (its `tp_spec` metadata), as a State like `nnx.state(model, nnx.Param)`."""
    return jax.tree.map(lambda v: v.get_metadata().get("tp_spec", PartitionSpec()),
                        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))


def check_mesh(mesh, model) -> None:
    """`mesh` must have the `tp` axis, the model's head counts (`model.check_tp`) and every
    sharded dimension must divide by its size."""
    if mesh is None:
        return
    if "tp" not in mesh.axis_names:
        raise ValueError(f"the mesh needs an axis named 'tp', got {mesh.axis_names}")
    tp = mesh.shape["tp"]
    model.check_tp(tp)
    for path, var in flat_params(model).items():
        spec = var.get_metadata().get("tp_spec", PartitionSpec())
        for dim, axis in zip(var.shape, spec):
            if axis is not None and dim % tp:
                raise ValueError(f"{path}: dimension {dim} does not divide over tp={tp} (check the config's "
                                 f"head counts and widths)")


def abstract(build: Callable, mesh=None):
    """`build()` without memory: parameters are ShapeDtypeStructs, with their `NamedSharding`
    on `mesh` when given (for deviceless compiles of released sizes)."""
    model = nnx.eval_shape(build)
    check_mesh(mesh, model)
    if mesh is None:
        return model
    specs = dict(nnx.to_flat_state(partition_specs(model)))
    placed = [(path, var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=NamedSharding(mesh, specs[path]))))
              for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    nnx.update(model, nnx.from_flat_state(placed))
    return model


def num_params(model) -> int:
    return sum(int(np.prod(v.shape)) for v in flat_params(model).values())


# --------------------------------------------------------------------------
# Reading a folder
# --------------------------------------------------------------------------

def read_config(folder) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return json.loads(path.read_text())


def known_fields(cls, d: dict) -> dict:
    """The entries of a transformers `config.json` dict that are fields of the config dataclass
    `cls` (the file carries many the encoder does not read: tokenizer ids, dtypes, ...)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


class Checkpoint:
    """The tensors of a transformers folder: one `model.safetensors` or an index and shards.
    Headers only until `read(key)`."""

    def __init__(self, folder, weights: str = "model"):
        from safetensors import safe_open

        folder = Path(folder)  # weights: the file stem ("diffusion_pytorch_model" for diffusers' own modules)
        single, index = folder / f"{weights}.safetensors", folder / f"{weights}.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = [single.name]
        else:
            raise FileNotFoundError(f"no {single.name} or {index.name} in {folder}")
        self.folder = folder
        self.file_of, self.info = {}, {}  # key -> file, key -> (safetensors dtype, shape)
        for name in files:
            path = folder / name
            if not path.is_file():
                raise FileNotFoundError(f"shard {name} listed in the index is missing from {folder}")
            try:
                with safe_open(path, framework="numpy") as f:
                    for key in f.keys():
                        s = f.get_slice(key)
                        self.file_of[key] = path
                        self.info[key] = (s.get_dtype(), tuple(s.get_shape()))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ValueError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None

    def keys(self):
        return self.info.keys()

    def read(self, key: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(self.file_of[key], framework="numpy") as f:
            try:
                return f.get_tensor(key)
            except (TypeError, ValueError):  # older safetensors cannot build numpy bfloat16
                return _read_raw(self.file_of[key], key)


def _read_raw(path: Path, key: str) -> np.ndarray:
    """One tensor straight from the safetensors layout (8-byte little-endian header length,
    JSON header, data), for dtypes numpy lacks (bfloat16 via ml_dtypes)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n))[key]
        start, end = entry["data_offsets"]
        f.seek(8 + n + start)
        buf = f.read(end - start)
    return np.frombuffer(buf, dtype=_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

def plan_keys(model, ckpt: Checkpoint, candidates: Callable[[str], list[str]], skip: Iterable[str]):
    """`{param path: (checkpoint key, transpose)}` after checking names, shapes and dtypes.

    `candidates(torch_key)`: checkpoint keys to try, in order, for one parameter. `skip`: regexes
    of checkpoint keys that are documented as unused. Raises ValueError naming the bad keys."""
    skip = [re.compile(s) for s in skip]
    plan, problems = {}, []
    for path, var in flat_params(model).items():
        key, transpose = torch_key(path)
        found = next((c for c in candidates(key) if c in ckpt.info), None)
        if found is None:
            problems.append(f"missing key {' or '.join(candidates(key))} (for {path}, shape "
                            f"{_torch_shape(var.shape, transpose)})")
            continue
        st_dtype, shape = ckpt.info[found]
        want = _torch_shape(var.shape, transpose)
        if shape != want:
            problems.append(f"{found}: shape {shape}, expected {want}")
        if st_dtype not in _FLOAT_DTYPES:
            problems.append(f"{found}: dtype {st_dtype}, expected a floating dtype ({', '.join(_FLOAT_DTYPES)})")
        plan[path] = (found, transpose)
    used = {k for k, _ in plan.values()}
    unexpected = sorted(k for k in ckpt.keys() if k not in used and not any(s.search(k) for s in skip))
    if unexpected:
        shown = ", ".join(unexpected[:10]) + (f", ... ({len(unexpected)} in all)" if len(unexpected) > 10 else "")
        problems.append(f"unexpected keys (not used by this model, not a documented skip): {shown}")
    if problems:
        raise ValueError(f"checkpoint {ckpt.folder} does not match {type(model).__name__}:\n  " + "\n  ".join(problems))
    return plan


def _torch_shape(shape, transpose):
    shape = tuple(shape)
    return shape[::-1] if transpose else shape


def load(build: Callable, folder, *, candidates: Callable[[str], list[str]], skip: Iterable[str] = (), mesh=None,
         weights: str = "model", memory_kind: str | None = None):
    """The model `build()` makes (built abstractly, nothing allocated), its parameters read
    from `folder` (`<weights>.safetensors` or its index), cast to the dtype `build` gave each (the
    model dtype, or e.g. float32 for T5's `wo`) and placed on `mesh` (or the default device), in
    `memory_kind` when given (host memory for a text encoder that streams, `Config.encoder_stream`)."""
    model = nnx.eval_shape(build)
    check_mesh(mesh, model)
    ckpt = Checkpoint(folder, weights)
    plan = plan_keys(model, ckpt, candidates, skip)
    graphdef, state = nnx.split(model, nnx.Param)
    specs = dict(nnx.to_flat_state(partition_specs(model)))
    device = jax.devices()[0]
    flat = []
    for path_tuple, var in nnx.to_flat_state(state):
        path = param_path(path_tuple)
        key, transpose = plan[path]
        arr = ckpt.read(key)
        if transpose:
            arr = arr.T
        arr = np.ascontiguousarray(arr.astype(var.dtype))
        sharding = NamedSharding(mesh, specs[path_tuple]) if mesh is not None else jax.sharding.SingleDeviceSharding(
            device)
        if memory_kind is not None:
            sharding = sharding.with_memory_kind(memory_kind)
        flat.append((path_tuple, var.replace(jax.device_put(arr, sharding))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def dtype_of(dtype):
    """`dtype` as a jnp dtype, refusing non-float ones."""
    dt = jnp.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"the model dtype must be floating, got {dt}")
    return dt
