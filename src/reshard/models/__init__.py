"""Model specs: the logical (Hugging Face-named) tensors of real model families."""

from .arch import DEMO_MODEL, PRESETS, Arch, category, from_hf_config, from_module, get_arch, model_specs, tiny_arch

__all__ = ["Arch", "DEMO_MODEL", "PRESETS", "category", "from_hf_config", "from_module", "get_arch", "model_specs",
           "tiny_arch"]
