"""The published tokenizer folders, called as diffusers' pipelines call them.

The folders are read with transformers' own tokenizer classes (tokenizers-backed; transformers
imports without torch), so the ids are the reference's by construction; what this module adds is
the exact call each pipeline makes, and the checks before it:

* FLUX.1 CLIP (diffusers `pipelines/flux/pipeline_flux.py`, `_get_clip_prompt_embeds`):
  `padding="max_length"`, `max_length=tokenizer.model_max_length` (77), truncation, and a warning
  listing the text truncation removed.
* FLUX.1 T5 (`_get_t5_prompt_embeds`): the same with `max_length=max_sequence_length` (512 by
  default; FLUX.1-schnell is usually run with 256). diffusers' warning slices the removed ids at
  CLIP's 77 (`tokenizer_max_length - 1`); here it lists what was really removed.
* Qwen-Image (`pipelines/qwenimage/pipeline_qwenimage.py`, `_get_qwen_prompt_embeds`): the prompt
  in Qwen-Image's chat template, `padding=True` (to the longest), truncation at
  1024 + 34 tokens; after the text encoder, `drop_template` keeps each prompt's valid hidden states
  past the 34 template tokens, right-pads them to the longest with a 0/1 mask, and `encode_prompt`
  then cuts at `max_sequence_length`.
* LTX-2 Gemma-3 (`pipelines/ltx2/pipeline_ltx2.py`, `_get_gemma_prompt_embeds`): prompts stripped,
  left padding (the tokenizer's `padding_side` set to "left", its eos as pad when it has none, as
  diffusers does), `padding="max_length"`, `max_length=max_sequence_length` (1024 by default),
  truncation, special tokens (Gemma's leading `<bos>`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from difflet_tpu import arguments
from difflet_tpu.arguments import ArgumentError

logger = logging.getLogger(__name__)

# QwenImagePipeline.__init__: the template, the count of its tokens before the prompt, the limit
QWEN_IMAGE_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
QWEN_IMAGE_TEMPLATE_START_IDX = 34
QWEN_IMAGE_TOKENIZER_MAX_LENGTH = 1024


class TokenizerError(ArgumentError):
    """A tokenizer folder that cannot be read, or a prompt that cannot be tokenized."""


@dataclasses.dataclass(frozen=True)
class Tokens:
    input_ids: np.ndarray       # [B, L] int32
    attention_mask: np.ndarray  # [B, L] int32, 1 = token, 0 = padding
    removed: list[str]          # per prompt, the text truncation dropped ("" when nothing)


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

# family -> (transformers class, the tokenizer_class names a folder of it may declare,
#            the file sets any one of which the class reads)
_FAMILIES = {
    "clip": ("CLIPTokenizer", {"CLIPTokenizer", "CLIPTokenizerFast"},
             [("tokenizer.json",), ("vocab.json", "merges.txt")]),
    "t5": ("T5Tokenizer", {"T5Tokenizer", "T5TokenizerFast"}, [("tokenizer.json",), ("spiece.model",)]),
    "qwen2": ("Qwen2Tokenizer", {"Qwen2Tokenizer", "Qwen2TokenizerFast"},
              [("tokenizer.json",), ("vocab.json", "merges.txt")]),
    # HunyuanVideo `tokenizer/` (llava-llama-3-8b's; model_index.json names LlamaTokenizerFast, the
    # folder declares PreTrainedTokenizerFast): read as diffusers reads it, with LlamaTokenizerFast
    "llama": ("LlamaTokenizerFast", {"LlamaTokenizer", "LlamaTokenizerFast", "PreTrainedTokenizerFast"},
              [("tokenizer.json",)]),
    "gemma": ("GemmaTokenizer", {"GemmaTokenizer", "GemmaTokenizerFast"}, [("tokenizer.json",), ("tokenizer.model",)]),
}


def folder_problems(folder: Path, family: str) -> list[str]:
    """What keeps `folder` from being a `family` tokenizer folder (empty: nothing)."""
    cls_name, accepted, file_sets = _FAMILIES[family]
    expected = " or ".join(" + ".join(s) for s in file_sets) + ", with tokenizer_config.json"
    if not folder.is_dir():
        return [f"no such folder (expected a {cls_name} folder: {expected})"]
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return [f"no tokenizer_config.json (a {cls_name} folder has {expected})"]
    problems = []
    try:
        declared = json.loads(config_path.read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError) as e:
        return [f"tokenizer_config.json: cannot read it ({e})"]
    if declared is not None and declared not in accepted:
        problems.append(f"tokenizer_config.json declares {declared!r}, expected {cls_name} "
                        f"(is this the right tokenizer folder?)")
    if not any(all((folder / f).is_file() for f in s) for s in file_sets):
        have = sorted(p.name for p in folder.iterdir())
        problems.append(f"missing the vocabulary files of a {cls_name}: expected {expected}; found {have}")
    return problems


def load_tokenizer(folder, family: str):
    """The tokenizer of a published `tokenizer/` folder: `family` is "clip" (FLUX.1 `tokenizer/`),
    "t5" (FLUX.1 `tokenizer_2/`), "qwen2" (Qwen-Image `tokenizer/`), "llama" (HunyuanVideo
    `tokenizer/`) or "gemma" (LTX-2 `tokenizer/`).

    Raises TokenizerError naming the folder and the files expected when the folder or its files
    are missing, or when its tokenizer_config.json declares another tokenizer class."""
    if family not in _FAMILIES:
        raise TokenizerError(f"unknown tokenizer family {family!r}; expected one of {sorted(_FAMILIES)}")
    cls_name = _FAMILIES[family][0]
    folder = Path(folder)
    problems = folder_problems(folder, family)
    if problems:
        raise TokenizerError(f"{folder}: " + "; ".join(problems))
    if not (folder / "tokenizer.json").is_file() and (folder / "spiece.model").is_file():
        try:
            import sentencepiece  # noqa: F401  (transformers converts spiece.model with it)
        except ImportError:
            raise TokenizerError(f"{folder}: has spiece.model but no tokenizer.json; converting it needs the "
                                 "sentencepiece package (pip install sentencepiece protobuf)") from None
    import transformers

    cls = getattr(transformers, cls_name)
    try:
        return cls.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - transformers / tokenizers raise many types; all name the folder here
        raise TokenizerError(f"{folder}: {cls_name} cannot load it ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------


def as_prompt_list(prompt, name: str = "prompt", allow_empty: bool = False) -> list[str]:
    """`prompt` (a string or a list of strings) as a list, refusing an empty list, non-strings
    and, unless `allow_empty` (negative prompts), empty or blank strings."""
    try:
        return arguments.prompts(prompt, name, allow_empty)
    except ArgumentError as e:
        raise TokenizerError(str(e)) from None


def _tokens(tokenizer, prompts: list[str], max_length: int, padding: str, what: str) -> Tokens:
    enc = tokenizer(prompts, padding=padding, max_length=max_length, truncation=True, return_tensors="np")
    ids = np.asarray(enc["input_ids"], np.int32)
    mask = np.asarray(enc["attention_mask"], np.int32)
    # what truncation removed: the untruncated ids past the kept ones (the last kept is the EOS
    # the tokenizer re-adds, the last untruncated one is the same EOS)
    full = tokenizer(prompts, padding=False, truncation=False, verbose=False)["input_ids"]
    removed = [tokenizer.decode(f[max_length - 1:-1], skip_special_tokens=True, clean_up_tokenization_spaces=False) if len(f) > max_length else ""
               for f in full]
    if any(removed):
        logger.warning("The following part of your input was truncated because %s: %s", what,
                       [r for r in removed if r])
    return Tokens(input_ids=ids, attention_mask=mask, removed=removed)


def clip_tokens(tokenizer, prompt, name: str = "prompt", allow_empty: bool = False) -> Tokens:
    """FluxPipeline._get_clip_prompt_embeds' tokenizer call: padded and truncated to
    `tokenizer.model_max_length` (77)."""
    n = int(tokenizer.model_max_length)
    return _tokens(tokenizer, as_prompt_list(prompt, name, allow_empty), n, "max_length",
                   f"CLIP can only handle sequences up to {n} tokens")


def t5_tokens(tokenizer, prompt, max_sequence_length: int = 512, name: str = "prompt_2",
              allow_empty: bool = False) -> Tokens:
    """FluxPipeline._get_t5_prompt_embeds' tokenizer call: padded and truncated to
    `max_sequence_length` (FluxPipeline refuses more than 512)."""
    try:
        max_sequence_length = arguments.max_sequence_length(max_sequence_length, 512)
    except ArgumentError as e:
        raise TokenizerError(str(e)) from None
    return _tokens(tokenizer, as_prompt_list(prompt, name, allow_empty), max_sequence_length, "max_length",
                   f"`max_sequence_length` is set to {max_sequence_length} tokens")


def qwen_image_tokens(tokenizer, prompt, name: str = "prompt", allow_empty: bool = False) -> Tokens:
    """QwenImagePipeline._get_qwen_prompt_embeds' tokenizer call: each prompt in the template,
    padded to the longest, truncated at 1024 + 34 tokens."""
    prompts = as_prompt_list(prompt, name, allow_empty=allow_empty)
    text = [QWEN_IMAGE_PROMPT_TEMPLATE.format(p) for p in prompts]
    return _tokens(tokenizer, text, QWEN_IMAGE_TOKENIZER_MAX_LENGTH + QWEN_IMAGE_TEMPLATE_START_IDX, "longest",
                   f"Qwen-Image reads at most {QWEN_IMAGE_TOKENIZER_MAX_LENGTH} prompt tokens")


def hunyuan_video_tokens(tokenizer, prompt, template: str, crop_start: int, max_sequence_length: int,
                         name: str = "prompt", allow_empty: bool = False) -> Tokens:
    """HunyuanVideoPipeline._get_llama_prompt_embeds' tokenizer call: each prompt in the template,
    padded and truncated to `max_sequence_length + crop_start` (the template's tokens before the
    prompt are cropped after the encoder)."""
    prompts = as_prompt_list(prompt, name, allow_empty=allow_empty)
    text = [template.format(p) for p in prompts]
    return _tokens(tokenizer, text, max_sequence_length + crop_start, "max_length",
                   f"`max_sequence_length` is set to {max_sequence_length} tokens")


def ltx2_tokens(tokenizer, prompt, max_sequence_length: int = 1024, name: str = "prompt",
                allow_empty: bool = False) -> Tokens:
    """LTX2Pipeline._get_gemma_prompt_embeds' tokenizer call: stripped prompts, left-padded and
    truncated to `max_sequence_length`, with Gemma's `<bos>`."""
    if not isinstance(max_sequence_length, int) or max_sequence_length < 1:
        raise TokenizerError(f"`max_sequence_length` must be a positive int, got {max_sequence_length!r}")
    prompts = [p.strip() for p in as_prompt_list(prompt, name, allow_empty)]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                    add_special_tokens=True, return_tensors="np")
    full = tokenizer(prompts, padding=False, truncation=False, add_special_tokens=True, verbose=False)["input_ids"]
    removed = [tokenizer.decode(f[max_sequence_length:], skip_special_tokens=True) if len(f) > max_sequence_length
               else "" for f in full]
    if any(removed):
        logger.warning("The following part of your input was truncated because `max_sequence_length` is set to "
                       "%d tokens: %s", max_sequence_length, [r for r in removed if r])
    return Tokens(input_ids=np.asarray(enc["input_ids"], np.int32), attention_mask=np.asarray(enc["attention_mask"],
                                                                                              np.int32),
                  removed=removed)


def drop_template(hidden_states, attention_mask, max_sequence_length: int = 512,
                  drop_idx: int = QWEN_IMAGE_TEMPLATE_START_IDX):
    """QwenImagePipeline's `_get_qwen_prompt_embeds` after the encoder, then `encode_prompt`'s cut:
    each row's valid hidden states (mask 1) past the first `drop_idx` (the template's system turn),
    right-padded with zeros to the longest, a 0/1 int32 mask, both cut at `max_sequence_length`.

    hidden_states [B, L, D] (numpy or jax), attention_mask [B, L] -> ([B, L', D], [B, L'])."""
    import jax.numpy as jnp

    mask = np.asarray(attention_mask).astype(bool)
    lengths = mask.sum(1) - drop_idx
    if (lengths < 0).any():
        raise TokenizerError(f"a prompt's tokens ({mask.sum(1).tolist()}) are fewer than the {drop_idx} template tokens")
    width = int(lengths.max())
    # valid tokens may sit anywhere (left or right padding): gather each row's valid positions
    index = np.zeros((mask.shape[0], width), np.int32)
    out_mask = np.zeros((mask.shape[0], width), np.int32)
    for b in range(mask.shape[0]):
        pos = np.nonzero(mask[b])[0][drop_idx:]
        index[b, :len(pos)] = pos
        out_mask[b, :len(pos)] = 1
    h = jnp.take_along_axis(jnp.asarray(hidden_states), jnp.asarray(index)[..., None], axis=1)
    h = h * jnp.asarray(out_mask, h.dtype)[..., None]
    return h[:, :max_sequence_length], out_mask[:, :max_sequence_length]
