"""Loading diffusers-format transformer checkpoints into the Flax ports.

`load_transformer(path)` reads a diffusers `transformer/` directory
(`config.json` + one safetensors file, or several with
`diffusion_pytorch_model.safetensors.index.json`), builds the port named by
`_class_name` from the config, maps every checkpoint key onto a parameter,
validates all of them (missing, unexpected and mis-shaped keys are reported
together, before anything compiles), casts, and places each parameter with
its sharding. With a mesh every device reads only its own slice
(`safe_open(...).get_slice`) and the slice goes to its device before the
next is read, so a checkpoint never exists whole on one device, and the host
holds one device's slice of one parameter at a time.

A port describes its checkpoint with a key map: parameter path (dot-joined
NNX state path) -> `Key`. `default_key_map` derives the usual rules
(Linear `kernel` = torch `weight` transposed; `bias`; norm `scale` = torch
`weight`; stacked blocks `name.{i}.`); ports override what differs.
Permutations (split-halves RoPE) are applied here, once, on the host; the
model records them in its config, so a cached (orbax) copy is not permuted
twice. A packed torch Linear (one weight over concatenated inputs) can feed
several Flax kernels: `Key(in_range=(a, b))` takes input features [a, b).
With `cache_dir`, the converted parameters are saved with orbax
and later restored straight onto the mesh (`difflet_tpu.checkpoint`).
See docs/loading.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from difflet_tpu.parallel import divisibility_problems, param_specs, path_names

log = logging.getLogger(__name__)

SINGLE_FILE = "diffusion_pytorch_model.safetensors"
INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"
TRANSFORMS = ("identity", "linear", "conv_as_linear")
# safetensors dtypes a floating-point parameter is read from (cast to the load dtype). Integer,
# bool and quantised (F8_*, and any dtype a later safetensors adds) tensors are refused: a cast
# would load wrong values silently, and there is no quantised path (scales) yet.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
INT_DTYPES = ("I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64")


class WeightsError(ValueError):
    """A checkpoint that does not fit its port: all problems, listed together."""


@dataclasses.dataclass(frozen=True)
class Key:
    """Where a parameter comes from in a diffusers checkpoint.

    template: the diffusers key; `{i}` stands for the layer of a stacked block.
    transform: "identity"; "linear" (torch `[out, in]` -> `[in, out]`);
      "conv_as_linear" (a patch-embedding Conv `[D, C, *k]` -> `[C*prod(k), D]`,
      patches flattened as (c, kt, kh, kw)).
    perm: a permutation of the parameter's last axis (split-halves RoPE).
    layers: how many stacked layers the template expands to.
    dtype: keep this dtype (e.g. "float32") whatever the load dtype.
    in_range: (a, b), "linear" only: the parameter is torch input features
      [a, b) (axis 1 of `[out, in]`), so one packed torch Linear (e.g. over
      `cat([attn, mlp])`) can feed separate kernels, each row-parallel on its
      own. A sharded read reads only its rows, offset by a. The Keys sharing a
      template must cover its input features exactly once (`validate`).
    """

    template: str
    transform: str = "identity"
    perm: tuple | None = None
    layers: int | None = None
    dtype: str | None = None
    in_range: tuple[int, int] | None = None

    def keys(self) -> list[str]:
        if self.layers is None:
            return [self.template]
        return [self.template.format(i=i) for i in range(self.layers)]


# --------------------------------------------------------------------------
# Key maps
# --------------------------------------------------------------------------

def param_paths(model_or_state) -> dict[str, tuple]:
    """Dot-joined parameter paths -> shapes."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = path_names(path)
        if names and names[-1] == "value":
            names = names[:-1]
        out[".".join(names)] = tuple(leaf.shape)
    return out


def default_key_map(model, stacked: dict[str, int] | None = None) -> dict[str, Key]:
    """The usual diffusers naming for every parameter of `model`.

    `stacked`: module paths of stacked blocks -> layer count, e.g.
    `{"transformer_blocks": 19}`; their keys get `.{i}` after that prefix.
    """
    stacked = stacked or {}
    out = {}
    for path, shape in param_paths(model).items():
        module, leaf = path.rsplit(".", 1) if "." in path else ("", path)
        layers = None
        for prefix, n in stacked.items():
            if module == prefix or module.startswith(prefix + "."):
                module = prefix + ".{i}" + module[len(prefix):]
                layers = n
                break
        if leaf == "kernel":
            key = Key(f"{module}.weight", "linear" if len(shape) - (layers is not None) == 2 else "identity",
                      layers=layers)
        elif leaf == "scale":
            key = Key(f"{module}.weight", layers=layers)
        else:
            key = Key(f"{module}.{leaf}" if module else leaf, layers=layers)
        out[path] = key
    return out


def torch_shape(key: Key, flax_shape: tuple) -> tuple | None:
    """The checkpoint tensor shape a parameter expects (per layer); None = only check the size."""
    shape = flax_shape[1:] if key.layers is not None else flax_shape
    if key.transform == "linear":
        if key.in_range is not None:  # at least b inputs; `validate` checks the coverage
            return None
        return (shape[1], shape[0])
    if key.transform == "conv_as_linear":
        return None
    return tuple(shape)


# --------------------------------------------------------------------------
# Checkpoint files
# --------------------------------------------------------------------------

class Checkpoint:
    """The safetensors files of one diffusers transformer directory."""

    def __init__(self, path):
        from safetensors import safe_open

        self.path = pathlib.Path(path)
        files, weight_map = checkpoint_files(self.path)
        index = self.path / INDEX_FILE
        self.handles = {}
        for f in files:
            try:
                self.handles[f] = safe_open(str(self.path / f), framework="np")
            except Exception as e:  # safetensors raises its own error types
                raise WeightsError(f"{self.path / f}: cannot read safetensors file "
                                   f"(truncated or corrupt?): {e}") from None
        self.where = {}
        for f, h in self.handles.items():
            for k in h.keys():
                self.where[k] = f
        if weight_map is not None:
            wrong = [k for k, f in weight_map.items() if self.where.get(k) != f]
            if wrong:
                raise WeightsError(f"{index}: {len(wrong)} keys are not in the shard it names, "
                                   f"e.g. {wrong[:3]}")

    def keys(self):
        return self.where.keys()

    def shape(self, key) -> tuple:
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())

    def dtype(self, key) -> str:
        """The safetensors dtype name of a tensor ("F32", "BF16", "I8", "BOOL", ...)."""
        return self.handles[self.where[key]].get_slice(key).get_dtype()

    def read(self, key, index=None) -> np.ndarray:
        """A tensor, or only `index` (a tuple of slices) of it."""
        sl = self.handles[self.where[key]].get_slice(key)
        if index is None:
            index = tuple(slice(0, d) for d in sl.get_shape())
        try:
            return np.asarray(sl[index])
        except Exception as e:
            raise WeightsError(f"{self.path / self.where[key]}: cannot read {key} "
                               f"(truncated or corrupt file?): {e}") from None


def _shard_name_problem(name) -> str | None:
    """Why an index's shard name is refused (None: it names a file inside the directory)."""
    if not isinstance(name, str) or not name:
        return f"{name!r} is not a file name"
    parts = pathlib.PurePosixPath(name).parts
    if pathlib.PurePosixPath(name).is_absolute() or pathlib.PureWindowsPath(name).is_absolute():
        return f"{name!r} is an absolute path"
    if ".." in parts:
        return f"{name!r} leaves the directory"
    return None


def checkpoint_files(path) -> tuple[list[str], dict | None]:
    """The safetensors files of a transformer directory (sorted) and the index's
    key -> file map (None for a single file). Refuses an unreadable index, shard
    names that leave the directory (absolute, `..`) and missing shards. Symlinks
    inside the directory (the Hugging Face cache's blobs) are followed as usual."""
    path = pathlib.Path(path)
    index = path / INDEX_FILE
    single = path / SINGLE_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{index}: not a safetensors index ({e})") from None
        bad = sorted({p for p in map(_shard_name_problem, weight_map.values()) if p})
        if bad:
            raise WeightsError(f"{index}: refusing shard name(s) that do not name a file in {path}: "
                               + "; ".join(bad))
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise WeightsError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files, weight_map
    if single.exists():
        return [SINGLE_FILE], None
    if not path.is_dir():
        raise WeightsError(f"{path}: not a directory")
    found = sorted(p.name for p in path.glob("*.safetensors"))
    raise WeightsError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}" + (f" (found {found})" if found else ""))


def ignored_key(name: str, patterns) -> bool:
    """Whether a checkpoint key matches one of a port's IGNORED_KEYS (diffusers'
    `_keys_to_ignore_on_load_unexpected`: regexes applied with `re.search`)."""
    return any(re.search(p, name) for p in patterns)


def summarize_keys(keys) -> str:
    """Keys with their layer index folded: `blocks.{0..39}.attn2.norm_added_q.weight`."""
    groups: dict[str, list[int]] = {}
    singles = []
    for k in sorted(keys):
        m = re.search(r"\.(\d+)\.", k)
        if m is None:
            singles.append(k)
            continue
        groups.setdefault(k[:m.start()] + ".{i}." + k[m.end():], []).append(int(m.group(1)))
    out = list(singles)
    for template, idx in sorted(groups.items()):
        idx = sorted(idx)
        span = (f"{idx[0]}..{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1)) and len(idx) > 1
                else ",".join(map(str, idx)))
        out.append(template.replace("{i}", "{" + span + "}"))
    return ", ".join(out)


def _norm_index(index, shape):
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape))


def read_param(ckpt: Checkpoint, key: Key, flax_shape: tuple, index) -> np.ndarray:
    """The slice `index` of one parameter (flax layout), reading only what it needs."""
    index = _norm_index(index, flax_shape)
    if key.layers is not None:
        layer_sl, rest = index[0], index[1:]
        return np.stack([_read_one(ckpt, key, key.template.format(i=i), flax_shape[1:], rest)
                         for i in range(layer_sl.start, layer_sl.stop)])
    return _read_one(ckpt, key, key.template, flax_shape, index)


def _read_one(ckpt, key, name, shape, index):
    if key.transform == "conv_as_linear":  # small, replicated: read whole
        w = ckpt.read(name)
        full = w.reshape(w.shape[0], -1).T
        return _permute_last(full, key.perm)[index]
    last = index[-1]
    if key.perm is not None:
        # The permutation stays within heads and shards hold whole heads, so the
        # source rows of a slice lie in the same range: read it, then reorder.
        src = np.asarray(key.perm)[last]
        lo, hi = int(src.min()), int(src.max()) + 1
        src_last, take = slice(lo, hi), src - lo
    else:
        src_last, take = last, None
    if key.transform == "linear":
        rows = index[0]
        if key.in_range is not None:  # this slice's input features within the packed ones
            rows = slice(rows.start + key.in_range[0], rows.stop + key.in_range[0])
        w = ckpt.read(name, (src_last, rows)).T  # torch [out, in]
    else:
        w = ckpt.read(name, (*index[:-1], src_last))
    return w if take is None else np.take(w, take, axis=-1)


def _permute_last(a, perm):
    return a if perm is None else np.take(a, np.asarray(perm), axis=-1)


def _range_problem(key: Key, per_layer: tuple) -> str | None:
    """What is wrong with a Key's in_range by itself (None: nothing)."""
    if key.transform != "linear":
        return f"in_range {key.in_range} applies only to transform 'linear', not {key.transform!r}"
    r = key.in_range
    if (not isinstance(r, tuple) or len(r) != 2 or not all(isinstance(v, (int, np.integer)) for v in r)
            or not 0 <= r[0] < r[1]):
        return f"in_range {r!r} is not a tuple (a, b) with 0 <= a < b"
    if len(per_layer) != 2 or r[1] - r[0] != per_layer[0]:
        return (f"in_range {tuple(int(v) for v in r)} selects {r[1] - r[0]} input features, "
                f"the kernel {per_layer} has {per_layer[0] if per_layer else '?'}")
    return None


def _dtype_problem(ckpt, name: str, path: str, float_param: bool) -> str | None:
    got = ckpt.dtype(name)
    if float_param and got not in FLOAT_DTYPES:
        return (f"wrong dtype for {name} in {ckpt.where[name]}: checkpoint {got}, expected a float tensor "
                f"({', '.join(FLOAT_DTYPES)}) for {path}; integer, bool and quantised tensors are not "
                f"converted (no quantised path yet)")
    if not float_param and got not in INT_DTYPES + ("BOOL",):
        return f"wrong dtype for {name} in {ckpt.where[name]}: checkpoint {got}, expected an integer tensor for {path}"
    return None


def validate(ckpt: Checkpoint, key_map: dict[str, Key], shapes: dict[str, tuple], where: str, *,
             ignore=(), float_params: dict[str, bool] | None = None) -> list[str]:
    """Missing, unexpected, mis-shaped and mis-typed keys, all at once (one WeightsError
    listing every problem). Returns the checkpoint keys left unused on purpose
    (those matching a pattern of `ignore`, the port's IGNORED_KEYS).

    A checkpoint key may feed several parameters (Keys with `in_range`, slices of
    one packed Linear): it is expected once, must have each kernel's output
    features, and the ranges must cover its input features exactly once.
    Dtypes: a floating-point parameter (all of them unless `float_params` says
    otherwise) is read from F16 / BF16 / F32 / F64 only.
    """
    float_params = float_params or {}
    problems, expected, missing, typed = [], set(), set(), set()
    ranged: dict[str, list] = {}  # checkpoint key -> [(in_range, path, out features)]
    for path in sorted(set(key_map) - set(shapes)):
        problems.append(f"key map entry {path} names no parameter of the model")
    for path, key in key_map.items():
        if path not in shapes:
            continue
        if key.transform not in TRANSFORMS:
            problems.append(f"{path}: unknown transform {key.transform!r}")
            continue
        per_layer = shapes[path][1:] if key.layers is not None else shapes[path]
        if key.in_range is not None:
            bad = _range_problem(key, per_layer)
            if bad is not None:
                problems.append(f"{path}: {bad}")
                continue
        want = torch_shape(key, shapes[path])
        for name in key.keys():
            expected.add(name)
            if name not in ckpt.where:
                if name not in missing:
                    missing.add(name)
                    problems.append(f"missing key {name} (for {path})")
                continue
            if name not in typed:  # once per checkpoint key (a packed one feeds several parameters)
                typed.add(name)
                bad_dtype = _dtype_problem(ckpt, name, path, float_params.get(path, True))
                if bad_dtype is not None:
                    problems.append(bad_dtype)
            got = ckpt.shape(name)
            if key.in_range is not None:
                a, b = (int(v) for v in key.in_range)
                if len(got) != 2 or got[0] != per_layer[1] or got[1] < b:
                    problems.append(f"wrong shape for {name} in {ckpt.where[name]}: checkpoint {got}, "
                                    f"expected ({per_layer[1]}, >= {b}) (for {path} {shapes[path]}, "
                                    f"input features [{a}, {b}))")
                else:
                    ranged.setdefault(name, []).append(((a, b), path, got[1]))
            elif want is not None and got != want:
                problems.append(f"wrong shape for {name} in {ckpt.where[name]}: checkpoint {got}, "
                                f"expected {want} (for {path} {shapes[path]})")
            elif want is None and (int(np.prod(got)) != int(np.prod(per_layer))
                                   or not got or got[0] != per_layer[-1]):
                problems.append(f"wrong shape for {name} in {ckpt.where[name]}: checkpoint {got}, expected "
                                f"[{per_layer[-1]}, ...] with {int(np.prod(per_layer))} elements "
                                f"(for {path} {shapes[path]})")
    problems += _coverage_problems(ranged, key_map, ckpt)
    unused = sorted(set(ckpt.keys()) - expected)
    ignored = [k for k in unused if ignored_key(k, ignore)]
    problems += [f"unexpected key {k} in {ckpt.where[k]}" for k in unused if k not in set(ignored)]
    if problems:
        raise WeightsError(f"{where}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return ignored


def _coverage_problems(ranged, key_map, ckpt) -> list[str]:
    """The in_range slices of each packed checkpoint key must tile its input features:
    no overlap, no gap, and no other Key reading it whole. Reported once per template
    (the first layer's key stands for the stack)."""
    problems, seen = [], set()
    whole = {}
    for path, key in key_map.items():
        if key.in_range is None:
            for name in key.keys():
                whole.setdefault(name, path)
    for name, parts in ranged.items():
        paths = tuple(sorted(p for _, p, _ in parts))
        if paths in seen:
            continue
        seen.add(paths)
        n_in = parts[0][2]
        if name in whole:
            problems.append(f"{name} in {ckpt.where[name]}: read whole by {whole[name]} and in part by "
                            f"{', '.join(paths)}")
            continue
        at = 0
        for (a, b), path, _ in sorted(parts):
            if a < at:
                problems.append(f"{name} in {ckpt.where[name]}: input features [{a}, {min(at, b)}) read by "
                                f"more than one key ({path} in_range ({a}, {b}))")
            elif a > at:
                problems.append(f"{name} in {ckpt.where[name]}: input features [{at}, {a}) read by no key "
                                f"(in_range of {', '.join(paths)})")
            at = max(at, b)
        if at < n_in:
            problems.append(f"{name} in {ckpt.where[name]}: input features [{at}, {n_in}) of {n_in} read by "
                            f"no key (in_range of {', '.join(paths)})")
    return problems


def target_dtype(key: Key, leaf_dtype, dtype):
    """The dtype a parameter is loaded as: the key's own dtype (kept fp32 tables), else
    `dtype` (None: the model's), and never a cast of an integer / bool parameter."""
    if key.dtype is not None:
        return jnp.dtype(key.dtype)
    leaf_dtype = jnp.dtype(leaf_dtype)
    if dtype is None or not jnp.issubdtype(leaf_dtype, jnp.floating):
        return leaf_dtype
    return jnp.dtype(dtype)


# --------------------------------------------------------------------------
# Ports and loading
# --------------------------------------------------------------------------

def port_for(class_name: str):
    """The port for a diffusers `_class_name`.

    `difflet_tpu.models.REGISTRY` maps class names to port module names; an
    entry may also be a module-like object itself (tests register toy ports
    with `monkeypatch.setitem(REGISTRY, name, obj)`).
    """
    from difflet_tpu.models import REGISTRY

    if class_name not in REGISTRY:
        raise WeightsError(f"unknown _class_name {class_name!r}; supported: {', '.join(sorted(REGISTRY))}")
    port = REGISTRY[class_name]
    if not isinstance(port, str):
        return port
    try:
        return importlib.import_module(port)
    except ImportError as e:
        raise WeightsError(f"_class_name {class_name!r}: its port {port} cannot be imported ({e})") from e


def read_config(path) -> dict:
    """A diffusers transformer directory's config.json, checked for `_class_name`."""
    cfg_path = pathlib.Path(path) / "config.json"
    if not cfg_path.exists():
        raise WeightsError(f"{path}: no config.json (expected a diffusers transformer directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{cfg_path}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise WeightsError(f"{cfg_path}: not a JSON object")
    if "_class_name" not in cfg:
        raise WeightsError(f"{cfg_path}: no _class_name")
    return cfg


def place_from_callback(shape: tuple, sharding, cb) -> jax.Array:
    """A global array from `cb(index) -> host slice`, one addressable device at a time.

    Like `jax.make_array_from_callback`, but each slice goes to its device
    before the next is read, so the host holds one device's slice of one
    parameter at a time; a slice that several devices hold (replicated) is
    read once and copied between devices.
    """
    placed, arrays = {}, []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        index = _norm_index(index, shape)
        spot = tuple((s.start, s.stop) for s in index)
        if spot in placed:
            arrays.append(jax.device_put(placed[spot], device))
            continue
        host = np.asarray(cb(index))
        arr = jax.device_put(host, device)
        arr.block_until_ready()
        del host
        placed[spot] = arr
        arrays.append(arr)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _float_params(params) -> dict[str, bool]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = path_names(path)
        out[".".join(names[:-1] if names[-1] == "value" else names)] = bool(
            jnp.issubdtype(jnp.dtype(leaf.dtype), jnp.inexact))
    return out


# Port config fields that count attention heads (TP and SP give each rank whole heads).
_HEAD_FIELD = re.compile(r"(^|_)(num_attention_heads|heads)$")


def mesh_problems(port_config, params, mesh, plan) -> list[str]:
    """Head counts (port config fields `*num_attention_heads` / `heads`) and sharded
    parameter axes that do not divide over the mesh's `tp` axis."""
    if mesh is None:
        return []
    size = mesh.shape["tp"]
    bad = []
    if dataclasses.is_dataclass(port_config):
        for f in dataclasses.fields(port_config):
            v = getattr(port_config, f.name)
            if _HEAD_FIELD.search(f.name) and isinstance(v, int) and v % size:
                bad.append(f"{f.name}: {v} heads over tp={size} (each rank needs whole heads)")
    return bad + divisibility_problems(plan, params, size)


def _raise_mesh_problems(where, port_config, params, mesh, plan):
    bad = mesh_problems(port_config, params, mesh, plan)
    if bad:
        raise WeightsError(f"{where}: heads or parameters do not divide over the tp axis (tp={mesh.shape['tp']}):"
                           f"\n  " + "\n  ".join(bad))


def load_params(model, ckpt: Checkpoint, key_map: dict[str, Key], *, dtype, mesh=None, plan=None,
                where: str = "", ignore=(), port_config=None):
    """Reads, validates and places every parameter of an (abstract) `model` in place.

    ignore: the port's IGNORED_KEYS (checkpoint keys dropped with one notice).
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    shapes = param_paths(params)
    missing_map = sorted(set(shapes) - set(key_map))
    if missing_map:
        raise WeightsError(f"key map has no entry for parameters {missing_map}")
    where = where or str(ckpt.path)
    ignored = validate(ckpt, key_map, shapes, where, ignore=ignore, float_params=_float_params(params))
    if ignored:
        log.warning("%s: ignoring %d checkpoint key(s) that the reference ignores too (diffusers "
                    "_keys_to_ignore_on_load_unexpected %s): %s", where, len(ignored), list(ignore),
                    summarize_keys(ignored))
    if mesh is not None:
        _raise_mesh_problems(where, port_config, params, mesh, plan)
        specs = param_specs(params, plan)
    else:
        specs = None
    dev = jax.devices()[0]

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    spec_leaves = jax.tree_util.tree_leaves(specs) if specs is not None else [None] * len(flat)
    out = []
    for (path, leaf), spec in zip(flat, spec_leaves):
        names = path_names(path)
        pname = ".".join(names[:-1] if names[-1] == "value" else names)
        key = key_map[pname]
        shape = tuple(leaf.shape)
        target = target_dtype(key, leaf.dtype, dtype)
        sharding = NamedSharding(mesh, spec) if mesh is not None else SingleDeviceSharding(dev)

        def cb(index, key=key, shape=shape, target=target):
            return read_param(ckpt, key, shape, index).astype(target)

        out.append(place_from_callback(shape, sharding, cb))
    params = jax.tree_util.tree_unflatten(treedef, out)
    return nnx.merge(graphdef, params, rest)


def abstract_port_model(port, port_config, *, dtype):
    """The port's model without memory: parameters are ShapeDtypeStructs."""
    return nnx.eval_shape(lambda: port.build(port_config, dtype=dtype, rngs=nnx.Rngs(0)))


def fill_state(model, port, port_config, *, dtype, mesh=None, plan=None):
    """Materialises the non-parameter state of a model whose parameters are loaded
    (buffers a port computes from its config, if any; most ports have none).

    Computed under `jit` from `port.build`, so the parameter initialisation is
    dead code and never runs; placed with the plan's sharding on `mesh`.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(rest)):
        return model
    rest = jax.jit(lambda: nnx.state(port.build(port_config, dtype=dtype, rngs=nnx.Rngs(0)),
                                     nnx.Not(nnx.Param)))()
    if mesh is not None:
        rest = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), rest,
                            param_specs(rest, plan))
    return nnx.merge(graphdef, params, rest)


def _check_arguments(dtype, mesh, config):
    """The Python arguments of load_transformer, before any file is opened."""
    from jax.sharding import Mesh

    from difflet_tpu.config import Config

    if dtype is not None:
        try:
            d = jnp.dtype(dtype)
        except TypeError:
            raise WeightsError(f"dtype: {dtype!r} is not a dtype (use jnp.bfloat16, jnp.float32 or None)") from None
        if not jnp.issubdtype(d, jnp.floating):
            raise WeightsError(f"dtype: {d.name} is not a floating-point dtype (use jnp.bfloat16, "
                               f"jnp.float32 or None)")
    if mesh is not None and not (isinstance(mesh, Mesh) and "tp" in mesh.shape):
        raise WeightsError(f"mesh: {mesh!r} is not a jax.sharding.Mesh with a 'tp' axis "
                           f"(use difflet_tpu.make_mesh(), or None for one device)")
    if config is None:
        return Config.from_env()
    if not isinstance(config, Config):
        raise WeightsError(f"config: {config!r} is not a difflet_tpu.Config")
    return config


def _port_and_config(path, config, overrides):
    from difflet_tpu.port_config import UnknownOption

    if "split_rope" in overrides:
        raise WeightsError("load_transformer: split_rope is not a keyword argument; pass "
                           "config=difflet_tpu.Config(split_rope=...)")
    cfg = read_config(path)
    port = port_for(cfg["_class_name"])
    name = getattr(port, "__name__", port)
    try:
        port_config = port.config_from_diffusers(cfg, split_rope=config.split_rope, **overrides)
    except (UnknownOption, TypeError) as e:
        if not overrides:
            raise
        raise WeightsError(f"load_transformer: unknown keyword argument(s) {sorted(overrides)} for "
                           f"{name} (not a load_transformer argument nor a build option of the port): {e}"
                           ) from None
    except ValueError as e:
        raise WeightsError(f"{pathlib.Path(path) / 'config.json'}: not supported by {name}: {e}") from None
    return port, port_config


def check_transformer(path, *, dtype=jnp.bfloat16, mesh=None, config=None, **overrides):
    """Everything `load_transformer` validates, without reading a tensor or compiling.

    Checks the arguments, config.json against the port, the files (headers,
    lengths, index, shard names), every key's presence, shape and dtype, and
    that heads and sharded dimensions divide over `mesh`. Returns
    `(port, port_config)`; raises WeightsError like `load_transformer`.
    """
    config = _check_arguments(dtype, mesh, config)
    port, port_config = _port_and_config(path, config, overrides)
    abstract = abstract_port_model(port, port_config, dtype=dtype)
    params = nnx.state(abstract, nnx.Param)
    if mesh is not None:
        _raise_mesh_problems(str(path), port_config, params, mesh, port.PLAN)
    ckpt = Checkpoint(path)
    validate(ckpt, port.key_map(port_config, abstract), param_paths(params), str(path),
             ignore=getattr(port, "IGNORED_KEYS", ()), float_params=_float_params(params))
    return port, port_config


def load_transformer(path, *, dtype=jnp.bfloat16, mesh=None, config=None, cache_dir=None, **overrides):
    """A ready port of the diffusers transformer at `path`.

    Args:
      path: a diffusers transformer directory (config.json + safetensors).
      dtype: parameter dtype (the port keeps fp32 where the reference does,
        through `Key(dtype="float32")`); a floating-point dtype or None.
      mesh: a `tp` mesh from `make_mesh`; each parameter is placed with its
        plan's sharding and each device reads only its slice. None: one device.
      config: a `difflet_tpu.Config` (default: the environment); its
        `split_rope` decides the q/k layout.
      cache_dir: an orbax cache of the converted parameters (see
        `difflet_tpu.checkpoint`): the first load converts and saves them, a
        later load with the same checkpoint, port config and dtype restores
        them onto `mesh` without reading the safetensors. A local path, gs://
        or s3://; on a miss it must be writable (checked before converting).
      overrides: port-specific build options (config keys of the port, passed
        to `config_from_diffusers`); an unknown one is an error.

    Raises:
      WeightsError: before anything is read or compiled, for a bad argument
        (dtype, mesh, config, an unknown keyword, an unusable cache_dir), an
        unknown `_class_name`, a config value the port does not support,
        missing / unexpected / mis-shaped / mis-typed keys (all listed
        together), truncated or corrupt files, an index naming a missing
        shard or a file outside the directory, a missing config.json, or
        heads / sharded dimensions that do not divide over `mesh`.
    """
    config = _check_arguments(dtype, mesh, config)
    port, port_config = _port_and_config(path, config, overrides)
    abstract = abstract_port_model(port, port_config, dtype=dtype)
    if mesh is not None:
        _raise_mesh_problems(str(path), port_config, nnx.state(abstract, nnx.Param), mesh, port.PLAN)
    if cache_dir is not None:
        from difflet_tpu import checkpoint

        checkpoint.check_cache_dir(cache_dir)
        cached = checkpoint.restore_if_cached(cache_dir, path, port, port_config, dtype=dtype, mesh=mesh,
                                              abstract=abstract)
        if cached is not None:
            return cached
        checkpoint.check_cache_dir(cache_dir, write=True)  # before the conversion, not after it
    ckpt = Checkpoint(path)
    model = load_params(abstract, ckpt, port.key_map(port_config, abstract), dtype=dtype, mesh=mesh,
                        plan=port.PLAN, where=str(path), ignore=getattr(port, "IGNORED_KEYS", ()),
                        port_config=port_config)
    model = fill_state(model, port, port_config, dtype=dtype, mesh=mesh, plan=port.PLAN)
    if cache_dir is not None:
        from difflet_tpu import checkpoint

        checkpoint.save(cache_dir, path, port, port_config, model, dtype=dtype)
    return model
