"""LoRA adapters fused into a Runner's (sharded) parameters: diffusers' `load_lora_weights`,
`set_adapters`, `unload_lora_weights`.

Files: a LoRA safetensors as diffusers saves it (`FluxPipeline.save_lora_weights`: keys
`transformer.<module>.lora_A.weight` [r, in] / `lora_B.weight` [out, r], the peft LoraConfig
in the metadata `lora_adapter_metadata`, read as diffusers' `_load_sft_state_dict_metadata`
does), or the same keys without the `transformer.` prefix, or peft's own
`base_model.model.` prefix; diffusers' older `.lora.down` / `.lora.up` names are read as A / B.
The scale of a module is peft's `LoraConfig` scaling: `lora_alpha / r` (`alpha_pattern` /
`rank_pattern` matched as peft's `get_pattern_key` does; `use_rslora`: alpha / sqrt(r));
without metadata diffusers' `get_peft_kwargs` makes alpha = r, scale 1. FLUX's community (kohya /
sd-scripts) files are converted as diffusers does (`lora_kohya.py`). A key that names no Linear
of the port, a text-encoder key, DoRA and LoRA biases are refused with every such key listed.

Each LoRA module is matched to the port's parameters through the port's key map (the same
`Key`s the checkpoint is loaded with), so every load-time transform applies to the delta as to
the weight: the transpose, the split-halves RoPE permutation of q/k output columns
(`Key.perm` on B's rows), a packed Linear split into kernels by input features (`Key.in_range`
on A's columns), stacked layers (zeros for the layers an adapter does not touch).

On the mesh, A^T [in, r] is placed with the kernel's input-axis sharding and B^T [r, out] with
its output-axis sharding (replicated over r), so each chip computes its own shard of
`scale * A^T @ B^T` and adds it to its shard of the weight (in float32, then cast to the
weight's dtype); no weight is gathered. Several adapters are one concatenation over r with a
per-rank scale vector (a runtime argument: changing scales compiles nothing).

The fused arrays replace the Runner's parameters with the same shapes, dtypes and shardings,
so the compiled step is reused. The base arrays are kept (the Runner's original device arrays)
so `unload_lora_weights` restores them bit-exactly (the same arrays) and `set_adapters` always
fuses from them (no drift from fusing and un-fusing): the cost is one extra copy in HBM of every
parameter an active adapter touches (`base_bytes`; up to the whole model for an adapter on
every Linear).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from difflet_tpu.loading.checkpoint import WeightsError, file_problem
from difflet_tpu.parallel.modes import path_names

METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
PREFIX = "transformer."  # diffusers' `transformer_name` in every pipeline's LoRA file
_AB = re.compile(r"^(?P<module>.+)\.(?P<which>lora_A|lora_B|lora\.down|lora\.up)\.weight$")


class LoraError(WeightsError):
    """A LoRA file or call that does not fit the model: every problem listed."""


@dataclasses.dataclass
class Module:
    """One LoRA'd torch Linear: A [r, in], B [out, r] (float32) and its scale alpha / r."""

    A: np.ndarray
    B: np.ndarray
    scale: float


# --------------------------------------------------------------------------
# Reading a file
# --------------------------------------------------------------------------

def read_lora_file(path) -> tuple[dict[str, np.ndarray], dict | None]:
    """Tensors (numpy) and the transformer's LoraConfig dict from the metadata (None without)."""
    from safetensors import safe_open

    p = pathlib.Path(path)
    problem = file_problem(p)
    if problem:
        raise LoraError(f"LoRA file {p} {problem}")
    try:
        with safe_open(str(p), framework="np") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
            meta = h.metadata() or {}
    except Exception as e:  # safetensors raises its own error types
        raise LoraError(f"{p}: cannot read as safetensors (truncated or not a LoRA file?): {e}") from None
    raw = meta.get(METADATA_KEY)
    if not raw:
        return tensors, None
    try:
        packed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LoraError(f"{p}: metadata {METADATA_KEY} is not JSON ({e})") from None
    config = {k[len(PREFIX):]: v for k, v in packed.items() if k.startswith(PREFIX)}
    return tensors, config or None


def _pattern_value(patterns: dict, module: str, default):
    """peft's `get_pattern_key`: the first pattern p with re.match(rf"(.*\\.)?({p})$", module)."""
    for p, v in (patterns or {}).items():
        if re.match(rf"(.*\.)?({p})$", module):
            return v
    return default


def parse_lora(tensors: dict, config: dict | None, where: str, kohya=None) -> dict[str, Module]:
    """diffusers module name -> Module, or a LoraError listing every key that is not a
    transformer LoRA factor this loader reads. `kohya`: the port's converter of kohya-style
    (`lora_unet_*`) files, None where diffusers has none."""
    problems = []
    if any(k.startswith(("lora_unet_", "lora_te")) for k in tensors):
        if kohya is None:
            raise LoraError(f"{where}: kohya-style keys (lora_unet_* / lora_te*) are read for FLUX only")
        return kohya(tensors, where)
    if config:
        for flag in ("use_dora", "lora_bias"):
            if config.get(flag):
                problems.append(f"LoraConfig {flag}=True is not supported (plain LoRA only)")
    prefixed = any(k.startswith(PREFIX) for k in tensors)
    pairs: dict[str, dict] = {}
    for key, value in sorted(tensors.items()):
        name = key
        if prefixed:
            if not name.startswith(PREFIX):
                problems.append(f"unexpected key {key} (not the transformer's: text-encoder and LTX-2 connectors LoRAs are not loaded)")
                continue
            name = name[len(PREFIX):]
        name = name.removeprefix("base_model.model.")
        m = _AB.match(name)
        if m is None:
            problems.append(f"unexpected key {key} (neither lora_A.weight nor lora_B.weight)")
            continue
        which = "A" if m["which"] in ("lora_A", "lora.down") else "B"
        if value.ndim != 2 or not np.issubdtype(value.dtype, np.floating):
            problems.append(f"{key}: shape {value.shape} {value.dtype}, expected a 2-D float matrix")
            continue
        pairs.setdefault(m["module"], {})[which] = np.asarray(value, np.float32)
    modules = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            problems.append(f"{module}: lora_{'B' if 'A' in ab else 'A'}.weight is missing")
            continue
        A, B = ab["A"], ab["B"]
        r = A.shape[0]
        if B.shape[1] != r:
            problems.append(f"{module}: lora_A {A.shape} and lora_B {B.shape} ranks differ")
            continue
        if config is None:  # diffusers' get_peft_kwargs without metadata: alpha = r for every module
            scale = 1.0
        else:
            cr = _pattern_value(config.get("rank_pattern"), module, config.get("r", r))
            alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", cr))
            if cr != r:
                problems.append(f"{module}: rank {r} in the file, {cr} in its LoraConfig metadata")
                continue
            scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        modules[module] = Module(A, B, float(scale))
    if problems:
        raise LoraError(f"{where}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    if not modules:
        raise LoraError(f"{where}: no LoRA factors (lora_A / lora_B weights) in the file")
    return modules


# --------------------------------------------------------------------------
# Matching modules to the port's parameters
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Target:
    """Where a torch Linear's weight lives in the port: parameter path, layer (stacked) or None,
    its Key (transform, perm, in_range)."""

    path: str
    layer: int | None
    key: object


def linear_targets(key_map: dict) -> dict[str, list[Target]]:
    """torch module name -> the port parameters its `.weight` is loaded into (a packed
    Linear feeds several)."""
    out: dict[str, list[Target]] = {}
    for path, key in key_map.items():
        if not key.template.endswith(".weight") or key.transform != "linear":
            continue
        layers = [None] if key.layers is None else range(key.layers)
        for i in layers:
            name = key.template.format(i=i) if i is not None else key.template
            out.setdefault(name[:-len(".weight")], []).append(Target(path, i, key))
    return out


def factors(modules: dict[str, Module], key_map: dict, shapes: dict, where: str) -> dict[str, tuple]:
    """parameter path -> (a [.., in, r], b [.., r, out], s [.., r]) in the parameter's flax
    layout (stacked: a leading layer axis, zeros where a layer has no LoRA), with the Key's
    permutation and input range applied: kernel delta = (a * s) @ b."""
    targets = linear_targets(key_map)
    problems = [f"{m}: no Linear of the model has this name (its weight is not a kernel the port loads)"
                for m in modules if m not in targets]
    parts: dict[str, list] = {}
    for m, mod in modules.items():
        for t in targets.get(m, []):
            shape = shapes[t.path]
            per_layer = shape[1:] if t.layer is not None else shape
            n_in, n_out = per_layer
            lo, hi = t.key.in_range or (0, n_in)
            total_in = max(tt.key.in_range[1] if tt.key.in_range else n_in for tt in targets[m])
            if mod.A.shape[1] != total_in or mod.B.shape[0] != n_out:
                problems.append(f"{m}: lora_A {mod.A.shape} / lora_B {mod.B.shape} do not fit its weight "
                                f"[{n_out}, {total_in}] (out, in)")
                continue
            a = mod.A.T[lo:hi]
            b = mod.B.T if t.key.perm is None else mod.B.T[:, np.asarray(t.key.perm)]
            parts.setdefault(t.path, []).append((t.layer, a, b, mod.scale))
    if problems:
        raise LoraError(f"{where}: {len(problems)} LoRA module(s) do not match the model:\n  "
                        + "\n  ".join(sorted(set(problems))))
    out = {}
    for path, items in parts.items():
        r = max(a.shape[1] for _, a, _, _ in items)
        stacked = items[0][0] is not None
        shape = shapes[path]
        lead = (shape[0],) if stacked else ()
        a_all = np.zeros(lead + (shape[-2], r), np.float32)
        b_all = np.zeros(lead + (r, shape[-1]), np.float32)
        s_all = np.zeros(lead + (r,), np.float32)
        for layer, a, b, s in items:
            at = (layer,) if stacked else ()
            k = a.shape[1]
            a_all[at + (slice(None), slice(0, k))] = a
            b_all[at + (slice(0, k),)] = b
            s_all[at + (slice(0, k),)] = s
        out[path] = (a_all, b_all, s_all)
    return out


# --------------------------------------------------------------------------
# Fusing on the mesh
# --------------------------------------------------------------------------

def factor_specs(spec: P, ndim: int) -> tuple[P, P, P]:
    """A's, B's and the scale vector's PartitionSpecs from the kernel's: A takes the input
    axis's sharding, B the output axis's; r is never sharded."""
    s = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    lead = s[:-2]
    return P(*lead, s[-2], None), P(*lead, None, s[-1]), P(*lead, None)


@jax.jit
def _fuse(w, a, b, s):
    delta = jnp.einsum("...ir,...ro->...io", a * s[..., None, :], b, precision=jax.lax.Precision.HIGHEST)
    return (w.astype(jnp.float32) + delta).astype(w.dtype)


def place(x: np.ndarray, like: jax.Array, spec: P | None, mesh):
    if mesh is None:
        return jax.device_put(x, like.sharding)
    return jax.device_put(x, NamedSharding(mesh, spec))


def fuse(base: jax.Array, a, b, s, spec: P | None, mesh) -> jax.Array:
    """base + (a * s) @ b on the chips, each chip its own shard (sharded like `base`)."""
    sa, sb, ss = factor_specs(spec, base.ndim) if mesh is not None else (None, None, None)
    out = _fuse(base, place(a, base, sa, mesh), place(b, base, sb, mesh), place(s, base, ss, mesh))
    if out.sharding != base.sharding:  # XLA's choice would make the step's parameters differ
        out = jax.device_put(out, base.sharding)
    return out


def leaf_path(path) -> str:
    names = path_names(path)
    return ".".join(names[:-1] if names and names[-1] == "value" else names)


def replace_leaves(state, new: dict):
    """`state` with the leaves at the dotted parameter paths of `new` replaced."""
    return jax.tree_util.tree_map_with_path(lambda p, x: new.get(leaf_path(p), x), state)


def state_leaves(state, paths) -> dict:
    wanted = set(paths)
    return {leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0] if leaf_path(p) in wanted}


# --------------------------------------------------------------------------
# The Runner's adapters (Runner.load_lora_weights / set_adapters / unload_lora_weights)
# --------------------------------------------------------------------------

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE


@dataclasses.dataclass
class Adapters:
    """A Runner's loaded adapters (host factors per parameter), the active ones with their
    weights, and the base arrays of every parameter an adapter touches."""

    loaded: dict = dataclasses.field(default_factory=dict)  # name -> {path: (a, b, s)}
    active: list = dataclasses.field(default_factory=list)  # [(name, weight)]
    base: dict = dataclasses.field(default_factory=dict)    # path -> the Runner's original array


def lora_file(path, weight_name=None) -> pathlib.Path:
    """A LoRA file, or a folder with `weight_name` (default diffusers' pytorch_lora_weights.safetensors)."""
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / (weight_name or WEIGHT_NAME)
    elif weight_name is not None:
        raise LoraError(f"weight_name={weight_name!r} names a file in a folder, but {path} is not a folder")
    return p


def _adapters(run) -> Adapters:
    if not hasattr(run, "_lora"):
        run._lora = Adapters()
    return run._lora


def _check_runner(run, what):
    if run.abstract:
        raise LoraError(f"{what}: this Runner holds an abstract model (ShapeDtypeStructs); load the weights first")
    run._check_resident()


def load_lora_weights(run, path, adapter_name=None, weight_name=None) -> str:
    """Reads and checks a LoRA file (or a state dict of arrays) against the Runner's model, keeps
    its factors on the host and makes it the only active adapter (weight 1.0), as diffusers
    does. Returns its name."""
    _check_runner(run, "load_lora_weights")
    ad = _adapters(run)
    name = adapter_name if adapter_name is not None else f"default_{len(ad.loaded)}"
    if not isinstance(name, str) or not name:
        raise LoraError(f"adapter_name: {name!r}, expected a non-empty string")
    if name in ad.loaded:
        raise LoraError(f"adapter name {name!r} is already in use (loaded: {sorted(ad.loaded)})")
    if isinstance(path, dict):  # a state dict, as diffusers takes it (no metadata: alpha = r)
        p, tensors, config = "the state dict", {k: np.asarray(v) for k, v in path.items()}, None
    else:
        p = lora_file(path, weight_name)
        tensors, config = read_lora_file(p)
    model = run.model
    shapes = {leaf_path(q): tuple(x.shape) for q, x in jax.tree_util.tree_flatten_with_path(run._state)[0]}
    key_map = run.spec.key_map(run.cfg, model)
    kohya = None
    if run.spec.name == "flux":  # the only family diffusers converts kohya-style files for here
        from difflet_tpu.loading import lora_kohya

        kohya = lambda t, where: lora_kohya.flux_modules(t, where, run.cfg)  # noqa: E731
    ad.loaded[name] = factors(parse_lora(tensors, config, str(p), kohya), key_map, shapes, str(p))
    set_adapters(run, [name])
    return name


def set_adapters(run, adapter_names, adapter_weights=None) -> None:
    """Fuses the named adapters (weights: one float for all, a list, or None = 1.0) into the
    parameters from their base arrays; parameters no active adapter touches get their base back."""
    _check_runner(run, "set_adapters")
    ad = _adapters(run)
    names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
    if adapter_weights is None or isinstance(adapter_weights, (int, float)):
        weights = [1.0 if adapter_weights is None else float(adapter_weights)] * len(names)
    else:
        weights = list(adapter_weights)
    unknown = [n for n in names if n not in ad.loaded]
    if unknown:
        raise LoraError(f"set_adapters: adapter(s) {unknown} not loaded (loaded: {sorted(ad.loaded)})")
    if len(weights) != len(names):
        raise LoraError(f"set_adapters: {len(names)} adapters and {len(weights)} adapter_weights")
    if any(not isinstance(w, (int, float)) or not math.isfinite(w) for w in weights):
        raise LoraError(f"set_adapters: adapter_weights {weights} must be finite numbers")
    _apply(run, list(zip(names, map(float, weights))))


def unload_lora_weights(run) -> None:
    """Every parameter back to its base array (the same array: bit-exact) and every adapter dropped."""
    _check_runner(run, "unload_lora_weights")
    _apply(run, [])
    run._lora = Adapters()


def _apply(run, active):
    ad = _adapters(run)
    touched = sorted({p for f in ad.loaded.values() for p in f})
    current = state_leaves(run._state, touched)
    for p in touched:
        ad.base.setdefault(p, current[p])
    _base_on_device(ad, current)
    specs = {} if run.mesh is None else state_leaves(run._param_specs, touched)
    # the base arrays back first, so the previous fused arrays are dropped before new ones are
    # made: the peak is the base copies + the new fused arrays + one fuse's factors
    run._state = replace_leaves(run._state, {p: ad.base[p] for p in touched})
    new = {}
    for p in touched:
        parts = [(ad.loaded[n][p], w) for n, w in active if p in ad.loaded[n]]
        if not parts:
            continue
        a = np.concatenate([f[0] for f, _ in parts], axis=-1)
        b = np.concatenate([f[1] for f, _ in parts], axis=-2)
        s = np.concatenate([f[2] * w for f, w in parts], axis=-1)
        new[p] = fuse(ad.base[p], a, b, s, specs.get(p), run.mesh)
    run._state = replace_leaves(run._state, new)
    run._host = None     # an offload() copy of the old weights is stale
    run.state.clear()    # port caches computed from the weights (Wan's text K/V)
    ad.active = list(active)
    for p in [p for p in ad.base if p not in touched]:
        del ad.base[p]


def active_adapters(run) -> list[str]:
    return [n for n, _ in _adapters(run).active]


def base_bytes(run) -> int:
    """Bytes per device held for the base copies of the parameters adapters touch (0 without
    an active adapter: then the base arrays are the parameters)."""
    from difflet_tpu import runtime

    ad = _adapters(run)
    current = state_leaves(run._state, ad.base)
    return runtime.tree_bytes_per_device([x for p, x in ad.base.items() if current[p] is not x])


def offload_base(run, kind: str) -> None:
    """`Runner.offload`: the base copies go to host memory (`kind`) too, so the device holds none
    of this Runner's arrays; `_apply` brings back the ones it fuses from."""
    ad = getattr(run, "_lora", None)
    if ad is None or not ad.base:
        return
    ad.base = {p: x if x.sharding.memory_kind == kind else jax.device_put(x, x.sharding.with_memory_kind(kind))
               for p, x in ad.base.items()}
    jax.block_until_ready(list(ad.base.values()))


def _base_on_device(ad, current: dict) -> None:
    for p, x in ad.base.items():
        if x.sharding != current[p].sharding:  # in host memory since an offload()
            ad.base[p] = jax.device_put(x, current[p].sharding)
