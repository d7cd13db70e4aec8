"""Model specs: the logical (Hugging Face-named) tensors of real model families."""

from .arch import PRESETS, Arch, category, from_hf_config, from_module, get_arch, model_specs

__all__ = ["Arch", "PRESETS", "category", "from_hf_config", "from_module", "get_arch", "model_specs"]
