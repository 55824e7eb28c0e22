"""diffusers' LoRA loader methods on every pipeline (`FluxLoraLoaderMixin`,
`QwenImageLoraLoaderMixin`, `WanLoraLoaderMixin`, `HunyuanVideoLoraLoaderMixin`,
`LTX2LoraLoaderMixin` in diffusers/loaders/lora_pipeline.py; transformer adapters only): the
adapters go into the transformer's Runner (difflet_tpu/loading/lora.py), fused into its
parameters on the chips; the compiled step is reused. Two-expert pipelines (Wan 2.2 A14B):
`load_into_transformer_2=True` loads the file into the second expert instead of the first, as
diffusers' `WanLoraLoaderMixin.load_lora_weights` does; `set_adapters` sets each expert's own
adapters among the names."""

from __future__ import annotations


class LoraLoaderMixin:
    """The pipeline lists its transformer Runners (`DiffusionPipeline._runners`)."""

    def load_lora_weights(self, pretrained_model_name_or_path_or_dict, adapter_name=None, *, weight_name=None,
                          load_into_transformer_2: bool = False) -> str:
        """A LoRA file (or a folder with `weight_name`) into the transformer (or `transformer_2`), as
        its only active adapter at weight 1.0; returns the adapter's name. Errors name every key that
        does not fit, before any parameter changes."""
        from difflet_tpu.loading import lora

        runners = self._runners()
        if load_into_transformer_2 and len(runners) < 2:
            raise lora.LoraError(f"load_into_transformer_2=True: {type(self).__name__} has no transformer_2")
        run = runners[1] if load_into_transformer_2 else runners[0]
        return run.load_lora_weights(pretrained_model_name_or_path_or_dict, adapter_name, weight_name)

    def set_adapters(self, adapter_names, adapter_weights=None) -> None:
        """The active adapters and their weights (one float, a list, or None = 1.0); each
        transformer takes the ones it holds. No recompilation."""
        from difflet_tpu.loading import lora

        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        if adapter_weights is None or isinstance(adapter_weights, (int, float)):
            weights = [adapter_weights] * len(names)
        else:
            weights = list(adapter_weights)
        if len(weights) != len(names):
            raise lora.LoraError(f"set_adapters: {len(names)} adapters and {len(weights)} adapter_weights")
        held = [set(getattr(run, "_lora", lora.Adapters()).loaded) for run in self._runners()]
        unknown = [n for n in names if not any(n in h for h in held)]
        if unknown:
            loaded = sorted(set().union(*held))
            raise lora.LoraError(f"set_adapters: adapter(s) {unknown} not loaded (loaded: {loaded})")
        for run, h in zip(self._runners(), held):
            if h:
                pairs = [(n, w) for n, w in zip(names, weights) if n in h]
                run.set_adapters([n for n, _ in pairs], [1.0 if w is None else w for _, w in pairs])

    def unload_lora_weights(self) -> None:
        """Every transformer's base parameters back, bit-exact; adapters dropped."""
        for run in self._runners():
            if getattr(run, "_lora", None) is not None:
                run.unload_lora_weights()

    def get_active_adapters(self) -> list[str]:
        return [n for run in self._runners() for n in run.get_active_adapters()]


def parse_lora_arg(text: str) -> tuple[str, float]:
    """`FILE[:SCALE]` (the command lines' `--lora`) -> (file, scale); a missing scale is 1.0.
    A ValueError for an unreadable file or a scale that is not a finite number."""
    import math
    import pathlib

    from difflet_tpu.loading.checkpoint import file_problem

    path, scale = text, 1.0
    if ":" in text:
        head, tail = text.rsplit(":", 1)
        try:
            scale = float(tail)
            path = head
        except ValueError:
            if not pathlib.Path(text).exists():
                raise ValueError(f"--lora {text!r}: expected FILE[:SCALE], {tail!r} is not a number") from None
    if not math.isfinite(scale):
        raise ValueError(f"--lora {text!r}: the scale must be a finite number")
    problem = file_problem(path)
    if problem:
        raise ValueError(f"--lora {text!r}: {path} {problem}")
    return path, scale


def apply_lora_args(pipe, loras) -> list[str]:
    """Loads each (file, scale) as adapter `lora_<i>` and activates them all with their scales."""
    names = [pipe.load_lora_weights(path, adapter_name=f"lora_{i}") for i, (path, _) in enumerate(loras)]
    if names:
        pipe.set_adapters(names, [scale for _, scale in loras])
    return names
