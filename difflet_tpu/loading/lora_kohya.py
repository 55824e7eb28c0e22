"""The community (kohya / sd-scripts) LoRA format of FLUX, converted as diffusers'
`_convert_kohya_flux_lora_to_diffusers` (diffusers/loaders/lora_conversion_utils.py) does.

Keys `lora_unet_<BFL module>.lora_down.weight` [r, in] / `.lora_up.weight` [out, r] / `.alpha`
name the modules of the original FLUX code (black-forest-labs/flux `model.py`): a fused
`img_attn_qkv` / `txt_attn_qkv` feeds diffusers' to_q, to_k, to_v (add_*_proj): A shared, B
split by rows in thirds; a single block's `linear1` feeds to_q, to_k, to_v and proj_mlp (rows
D, D, D, 4D: diffusers hard-codes FLUX.1's 3072 x 3 + 12288, this takes the model's widths).
Scale alpha / r (alpha = r without an `.alpha` key); `final_layer_adaLN_modulation_1`'s rows
swapped to diffusers' (scale, shift) order as diffusers' `swap_scale_shift` does. The top-level
modules (img_in, txt_in, time_in, vector_in, guidance_in, final_layer) are loaded here; diffusers
0.42.1's converter returns them without the `transformer.` prefix, so its load_lora_weights
drops them without a word: a file with them differs from diffusers there, on purpose.
Text-encoder keys (`lora_te*`) are refused: only the transformer is loaded.
"""

from __future__ import annotations

import re

import numpy as np

from difflet_tpu.loading.lora import LoraError, Module

_DOUBLE = {"img_attn_proj": ["attn.to_out.0"], "img_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
           "img_mlp_0": ["ff.net.0.proj"], "img_mlp_2": ["ff.net.2"], "img_mod_lin": ["norm1.linear"],
           "txt_attn_proj": ["attn.to_add_out"],
           "txt_attn_qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
           "txt_mlp_0": ["ff_context.net.0.proj"], "txt_mlp_2": ["ff_context.net.2"],
           "txt_mod_lin": ["norm1_context.linear"]}
_SINGLE = {"linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"], "linear2": ["proj_out"],
           "modulation_lin": ["norm.linear"]}
_TOP = {"guidance_in_in_layer": "time_text_embed.guidance_embedder.linear_1",
        "guidance_in_out_layer": "time_text_embed.guidance_embedder.linear_2",
        "img_in": "x_embedder", "txt_in": "context_embedder",
        "time_in_in_layer": "time_text_embed.timestep_embedder.linear_1",
        "time_in_out_layer": "time_text_embed.timestep_embedder.linear_2",
        "vector_in_in_layer": "time_text_embed.text_embedder.linear_1",
        "vector_in_out_layer": "time_text_embed.text_embedder.linear_2",
        "final_layer_linear": "proj_out", "final_layer_adaLN_modulation_1": "norm_out.linear"}
_KEY = re.compile(r"^lora_unet_(?P<name>.+)\.(?P<what>lora_down\.weight|lora_up\.weight|alpha)$")


def _targets(name: str, config):
    """(diffusers modules, row sizes of the up weight or None for equal parts) of a BFL name."""
    m = re.fullmatch(r"double_blocks_(\d+)_(.+)", name)
    if m and m[2] in _DOUBLE:
        return [f"transformer_blocks.{m[1]}.{t}" for t in _DOUBLE[m[2]]], None
    m = re.fullmatch(r"single_blocks_(\d+)_(.+)", name)
    if m and m[2] in _SINGLE:
        D = config.inner_dim
        dims = [D, D, D, config.mlp_hidden_dim] if m[2] == "linear1" else None
        return [f"single_transformer_blocks.{m[1]}.{t}" for t in _SINGLE[m[2]]], dims
    if name in _TOP:
        return [_TOP[name]], None
    return None, None


def flux_modules(tensors: dict, where: str, config) -> dict[str, Module]:
    """diffusers module name -> Module of a kohya-style FLUX LoRA (LoraError listing every key
    that does not convert)."""
    problems, groups = [], {}
    for key, value in sorted(tensors.items()):
        m = _KEY.match(key)
        if key.startswith("lora_te"):
            problems.append(f"unexpected key {key} (text-encoder LoRAs are not loaded)")
        elif m is None:
            problems.append(f"unexpected key {key} (not lora_unet_<module>.lora_down/lora_up.weight/alpha)")
        else:
            groups.setdefault(m["name"], {})[m["what"]] = np.asarray(value, np.float32)
    out = {}
    for name, g in sorted(groups.items()):
        modules, dims = _targets(name, config)
        if modules is None:
            problems.append(f"lora_unet_{name}: no FLUX module of this name")
            continue
        if "lora_down.weight" not in g or "lora_up.weight" not in g:
            problems.append(f"lora_unet_{name}: lora_down and lora_up are not both present")
            continue
        down, up = g["lora_down.weight"], g["lora_up.weight"]
        r = down.shape[0]
        if down.ndim != 2 or up.ndim != 2 or up.shape[1] != r:
            problems.append(f"lora_unet_{name}: lora_down {down.shape} / lora_up {up.shape} are not [r, in] / [out, r]")
            continue
        scale = float(g.get("alpha", np.float32(r))) / r
        if name == "final_layer_adaLN_modulation_1":  # BFL (shift, scale) -> diffusers (scale, shift)
            up = np.concatenate(np.split(up, 2, axis=0)[::-1], axis=0)
        dims = dims or [up.shape[0] // len(modules)] * len(modules)
        if sum(dims) != up.shape[0]:
            problems.append(f"lora_unet_{name}: lora_up has {up.shape[0]} rows, the model's {modules} take {sum(dims)}")
            continue
        for module, rows in zip(modules, np.split(up, np.cumsum(dims)[:-1], axis=0)):
            out[module] = Module(down, rows, scale)
    if problems:
        raise LoraError(f"{where}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return out
