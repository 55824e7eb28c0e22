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
and later restored straight onto the mesh (`difflet_tpu.loading.cache`).
See docs/loading.md.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from difflet_tpu.parallel.modes import param_specs, path_names

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
        twice = {}
        for f, h in self.handles.items():
            for k in h.keys():
                if k in self.where:
                    twice.setdefault(k, [self.where[k]]).append(f)
                self.where[k] = f
        if twice:  # which copy is meant would be a guess (diffusers' loader takes the last one read)
            k, fs = sorted(twice.items())[0]
            raise WeightsError(f"{self.path}: {len(twice)} key(s) are in more than one file, e.g. {k} in "
                               f"{' and '.join(fs)}; keep one copy of each tensor")
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


def file_problem(p) -> str | None:
    """Why `p` is not a readable regular file, in words (None: it is one): missing, a
    directory, a dangling symlink or a symlink loop (both listed by `ls`, so "missing"
    would mislead)."""
    p = pathlib.Path(p)
    try:
        os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop"
        if os.path.islink(p):
            return f"is a symlink to {os.readlink(p)}, which does not exist"
        return "does not exist" if e.errno == errno.ENOENT else f"cannot be read ({e.strerror})"
    if p.is_dir():
        return "is a directory, not a file"
    if not os.access(p, os.R_OK):
        return "is not readable (permissions)"
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
            if all(file_problem(path / f) == "does not exist" for f in missing):
                raise WeightsError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
            raise WeightsError(f"{index} names shard(s) that cannot be read: "
                               + "; ".join(f"{f} {file_problem(path / f)}" for f in missing))
        return files, weight_map
    if os.path.lexists(single):
        problem = file_problem(single)
        if problem:
            raise WeightsError(f"{single}: {problem}")
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
