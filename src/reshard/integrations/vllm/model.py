"""A live vLLM model as the destination side of a refit: its own parameter objects, written in place.

Each vLLM worker lays out its model with :func:`reshard.frameworks.vllm.vllm_layout` (the layout
the tests check against vLLM's own weight loaders) and keeps its own rank's part. Buffers are the
model's parameters by ``named_parameters`` name, in the form vLLM loads them (fused QKV, gate-up,
FusedMoE ``w13``/``w2``, padded vocabulary). At connect every buffer is checked against the form
vLLM recorded when it built the model (``record_metadata_for_reloading``), in both directions: a
buffer vLLM does not have, or a parameter the layout does not fill, is an error naming the
parameter and rank.

Two ways in, chosen per vLLM layer (the module that owns the parameters):

    way          layers                                   how the bytes land
    in place     the parameters are what the forward      the executor writes into the live
                 reads: norms (every platform); linear,   parameter storage
                 embedding layers on GPUs, unquantized
    reprocessed  the engine transforms weights after      the executor writes into staging in the
                 loading: on CPUs linear and embedding    loaded form; then vLLM's layerwise reload
                 layers (repacked for the CPU kernels)    (initialize_layerwise_reload /
                 and FusedMoE (padded, prepacked); any    finalize_layerwise_reload) materializes the
                 quantized layer; FusedMoE on GPUs        layer, copies the staged tensors in, runs the
                 (kernel formats)                         layer's own post-load processing and copies
                                                          the result into the live storage

The reprocessed way still moves only this rank's boxes (no full tensor, no ``load_weights``): each
parameter's loader is a plain copy of its staged tensor for the duration of the refit. The session
reports the bytes of each way.

**FP8 engines** (a refit under a dtype policy, ``RefitOptions(precision="fp8")``): the side
declares the engine's layout at the engine's dtype (what the trainer sends) and holds the buffers
of :func:`~reshard.planning.precision.precision_layout`, which are vLLM's own block-FP8 parameters:
``weight`` in float8_e4m3fn and ``weight_scale_inv`` (FusedMoE: ``w13_weight_scale_inv``,
``w2_weight_scale_inv``). They are checked against vLLM's recorded form like any buffer, so a
policy the engine contradicts fails at connect naming the tensor (the message says the engine's
quantization and the policy). Quantized layers always take the reprocessed way: vLLM's FP8
kernels post-process what was loaded (on CPU ``CPUFp8BlockScaledMMKernel`` repacks the weight for
AMX; ``Fp8MoEMethod`` converts and repacks ``w13``/``w2`` on every load). The attention layers'
KV-cache scales a quantized engine makes (``attn.k_scale``, ...) fill no checkpoint weight and
are left alone.

**Staged receives** (``receive="staged"``): the engine serves while the bytes arrive, so the
reprocessing must not touch a live layer before the engine is paused. Once every byte arrived
(before the commit), :meth:`VLLMModelSide.prepare_staged` runs the same layerwise reload on a
*shadow* of each reprocessed layer: a copy sharing its attributes but owning its tensors and
module state, where vLLM's post-load step builds the new packed weights. Putting the version in
place (:meth:`VLLMModelSide.end_write`, with the engine paused) then only copies the shadow's
tensors into the live storage and sets the attributes the processing changed (on CPUs the packed
linear weights live in a closure, ``cpu_linear``)::

    layer kind                       prepared on the receive thread       while paused
    linear, embedding (CPU)          repacked on a shadow                 closure swapped, tensors copied
    quantized linear                 processed on a shadow                tensors copied, attributes set
    FusedMoE, layers with children,  nothing                              layerwise reload, as in place
    attention layers vLLM defers

FusedMoE layers keep their kernel object on the quantization method, which the shadow would
share with the live layer, so they are reprocessed while paused (the pause grows with them).

vLLM 0.32 on CPUs does not redo the FusedMoE packing and padding on a weight update (the CPU
experts' ``process_weights_after_loading`` runs only when the MoE kernel is first built; a reload
serves checkpoint-layout weights at TP=1 and fails on the padded shapes at TP=2). We mark the
layer's kernel as not built before reprocessing it, so vLLM redoes the whole step, packing and
padding included.
"""

from __future__ import annotations

import copy
import os
import threading

import torch

from ...frameworks.vllm import vllm_layout
from ...layout import Layout
from ...models.arch import from_hf_config
from ...planning.precision import precision_layout
from ...refit.sides import IN_PLACE, REPROCESSED, Side, WriteReport
from ...tensors import LayoutError


def _copy_staged(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """The weight loader of a reprocessed parameter during a refit: the staged tensor is already in
    this rank's loaded form."""
    param.data.copy_(loaded_weight)


def redo_cpu_moe_packing(module: torch.nn.Module) -> None:
    """On CPUs, mark every FusedMoE kernel under ``module`` as not built, so that the next
    ``process_weights_after_loading`` redoes the packing and padding vLLM 0.32 skips on a weight
    update (see module doc)."""
    for layer in module.modules():
        method = getattr(layer, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None and next(layer.parameters()).device.type == "cpu":
            method.moe_kernel = None


def _kv_cache_scales(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is an attention layer whose parameters are a quantized engine's KV-cache and
    activation scales (``attn.k_scale``, ...): vLLM makes them, no checkpoint weight fills them (with the
    default KV-cache dtype they stay 1.0), so a refit leaves them alone."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    return isinstance(getattr(layer, "quant_method", None), BaseKVCacheMethod)


def _reprocessed(layer: torch.nn.Module, *, cpu: bool, quantized: bool) -> bool:
    """Whether the engine transforms this layer's weights after loading (see module doc)."""
    method = getattr(layer, "quant_method", None)
    if method is None:
        return False
    return cpu or quantized or hasattr(method, "moe_kernel")


class VLLMModelSide(Side):
    """This worker's part of the inference side: live parameters, or staging that the engine's
    post-load path puts in place (see module doc)."""

    def __init__(self, rank: int, layout: Layout, model: torch.nn.Module, model_config, *, cpu: bool,
                 quantized: bool, policy=None, engine_quantization: str = "none") -> None:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self.model, self.model_config = model, model_config
        modules = dict(model.named_modules())
        # under a dtype policy the side declares ``layout`` (the trainer's precision) and holds the buffers of
        # its precision layout: FP8 weights and their <buffer>_scale_inv (see module doc, "FP8 engines")
        held = layout if policy is None else precision_layout(layout, policy)
        wanted = held.buffers(rank)
        hint = (f" (the engine's quantization: {engine_quantization}; the refit's dtype policy: "
                f"{'none' if policy is None else policy}{_POLICY_HINT if policy is None and quantized else ''})")
        live: dict[str, torch.Tensor] = {}
        self.staged_specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.layers: dict[str, list[str]] = {}  # reprocessed layer -> its staged parameters
        for name in sorted(wanted):
            mod_name, _, pname = name.rpartition(".")
            layer = modules.get(mod_name)
            if layer is None or pname not in dict(layer.named_parameters(recurse=False)):
                raise LayoutError(f"rank {rank}: vLLM's model has no parameter {name!r}, which the layout fills"
                                  + (hint if policy is not None or quantized else ""))
        for mod_name, layer in modules.items():
            own = dict(layer.named_parameters(recurse=False))
            if not own or _kv_cache_scales(layer):
                continue
            # the form vLLM loads into (biases are made after it records that form: they keep theirs)
            loaded = {**own, **get_layerwise_info(layer).restore_metadata[0]}
            reprocess = _reprocessed(layer, cpu=cpu, quantized=quantized)
            for pname, meta in loaded.items():
                name = f"{mod_name}.{pname}"
                if name not in wanted:
                    raise LayoutError(f"rank {rank}: vLLM parameter {name!r} {tuple(meta.shape)} {meta.dtype} is not "
                                      f"filled by the layout (a model feature reshard does not lay out)"
                                      + (hint if policy is not None or quantized else ""))
                shape, dtype = wanted[name]
                if tuple(meta.shape) != shape or meta.dtype != dtype:
                    raise LayoutError(f"rank {rank}: vLLM parameter {name!r} is {tuple(meta.shape)} {meta.dtype}, the "
                                      f"layout says {shape} {dtype}" + (hint if policy is not None or quantized else ""))
                if reprocess and pname in get_layerwise_info(layer).restore_metadata[0]:
                    self.staged_specs[name] = (shape, dtype)
                    self.layers.setdefault(mod_name, []).append(pname)
                else:
                    live[name] = own[pname].data
        super().__init__(rank, layout, live)
        self.device = next(iter(live.values()), next(iter(model.parameters()))).device
        self._staging: dict[str, torch.Tensor] = {}
        self._prepared: dict[str, torch.nn.Module] = {}  # layer -> its processed shadow (staged receives)

    @classmethod
    def from_worker(cls, model: torch.nn.Module, vllm_config, rank: int, first_rank: int, policy=None
                    ) -> "VLLMModelSide":
        """This worker's side: ``rank`` in the refit group, its engine's workers starting at ``first_rank``;
        ``policy``: the refit's dtype policy (a :class:`~reshard.planning.precision.DtypePolicy`; None: every
        tensor in the engine's dtype)."""
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.platforms import current_platform

        parallel, model_config = vllm_config.parallel_config, vllm_config.model_config
        if parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1:
            raise LayoutError("the reshard backend lays out tensor-parallel engines (run several engines for data "
                              "parallelism); this one has pipeline_parallel_size="
                              f"{parallel.pipeline_parallel_size}, data_parallel_size={parallel.data_parallel_size}")
        tp_size = parallel.tensor_parallel_size
        if rank != first_rank + get_tensor_model_parallel_rank():
            raise LayoutError(f"rank {rank}: expected TP rank {rank - first_rank} of the engine, vLLM says "
                              f"{get_tensor_model_parallel_rank()}")
        arch = from_hf_config(model_config.hf_config.to_dict()).with_overrides(dtype=model_config.dtype)
        layout = vllm_layout(arch, range(first_rank, first_rank + tp_size), tp_size, 1, dtype=model_config.dtype,
                             expert_parallel=bool(parallel.enable_expert_parallel)).subset([rank])
        quantized = getattr(model_config, "quantization", None) is not None
        return cls(rank, layout, model, model_config, cpu=current_platform.is_cpu(), quantized=quantized,
                   policy=policy, engine_quantization=engine_quantization(model_config.hf_config))

    # ------------------------------------------------------------------ one refit
    def begin_write(self) -> dict[str, torch.Tensor]:
        self._prepared = {}
        self._staging = {name: torch.empty(shape, dtype=dtype, device=self.device)
                         for name, (shape, dtype) in self.staged_specs.items()}
        return {**self.tensors, **self._staging}

    def abort_write(self) -> None:
        self._staging, self._prepared = {}, {}

    def end_write(self) -> WriteReport:
        staged = sum(tensor.numel() * tensor.element_size() for tensor in self._staging.values())
        modules = dict(self.model.named_modules())
        for mod_name, shadow in self._prepared.items():
            _install(modules[mod_name], shadow)
        for mod_name, pnames in self.layers.items():
            if mod_name not in self._prepared:
                self._reprocess(modules[mod_name], mod_name, pnames)
        self._staging, self._prepared = {}, {}
        in_place = self.layout_bytes(self.tensors)
        paths = {**dict.fromkeys(self.tensors, IN_PLACE), **dict.fromkeys(self.staged_specs, REPROCESSED)}
        return WriteReport(in_place_bytes=in_place, reprocessed_bytes=self.layout_bytes(self.staged_specs),
                           staging_bytes=staged, paths=paths)

    def prepare_staged(self) -> None:
        """A staged receive, before the commit: run vLLM's post-load processing of each reprocessed layer
        on a shadow of it (its own parameter objects, the live layer untouched), so that
        :meth:`end_write` only swaps the processed state in (see module doc, "Staged receives")."""
        if self.device.type == "cpu" and threading.current_thread() is not threading.main_thread():
            # a receive thread of a CPU worker, which serves on the same cores: serving goes first (Linux
            # priorities are per thread; the thread ends with the receive, so it is never raised again)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARE_NICE)
        modules = dict(self.model.named_modules())
        with torch.no_grad():
            for mod_name, pnames in self.layers.items():
                layer = modules[mod_name]
                if _preparable(layer):
                    shadow = _shadow(layer)
                    self._reprocess(shadow, mod_name, pnames, info_of=layer)
                    self._prepared[mod_name] = shadow

    def _reprocess(self, layer: torch.nn.Module, mod_name: str, pnames: list[str], *,
                   info_of: torch.nn.Module | None = None) -> None:
        """vLLM's layerwise reload of ``layer`` from this rank's staged tensors (``info_of``: the live layer
        whose recorded form a shadow takes)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        recorded = get_layerwise_info(info_of or layer)
        if info_of is not None:
            info = get_layerwise_info(layer)
            info.restore_metadata, info.restore_device = recorded.restore_metadata, recorded.restore_device
        loaded = recorded.restore_metadata[0]
        # vLLM's parameter classes keep their loader behind a property (in ``_weight_loader``):
        # put each recorded parameter's attributes back exactly as they were
        saved = {pname: dict(loaded[pname].__dict__) for pname in pnames}
        for pname in pnames:
            loaded[pname].weight_loader = _copy_staged
        redo_cpu_moe_packing(layer)
        try:
            initialize_layerwise_reload(layer)
            for pname in pnames:
                param = getattr(layer, pname)
                param.weight_loader(param, self._staging.pop(f"{mod_name}.{pname}"))
            finalize_layerwise_reload(layer, self.model_config)
        finally:
            for pname, attributes in saved.items():
                loaded[pname].__dict__.clear()
                loaded[pname].__dict__.update(attributes)


_POLICY_HINT = ("; a quantized engine takes the refit's precision from the trainer's RefitOptions(precision=...): "
                "reshard.integrations.vllm.engine_precision(checkpoint) reads it from the engine's quantization_config")


def engine_quantization(hf_config) -> str:
    """The engine's quantization as a few words (for errors): ``none``, or its ``quantization_config``'s
    method, format and block size."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return "none"
    config = config if isinstance(config, dict) else getattr(config, "to_dict", lambda: vars(config))()
    words = [str(config.get("quant_method", "?"))]
    if config.get("fmt"):
        words.append(str(config["fmt"]))
    if config.get("weight_block_size"):
        words.append("blocks " + "x".join(map(str, config["weight_block_size"])))
    return " ".join(words)


PREPARE_NICE = 19  # the repacking on a CPU worker's receive thread runs at the lowest priority
_MODULE_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def _preparable(layer: torch.nn.Module) -> bool:
    """Whether a reprocessed layer can be processed on a shadow: not a FusedMoE (its kernel object is
    shared state), no child modules, not an attention layer vLLM defers."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return (not layer._modules and not hasattr(getattr(layer, "quant_method", None), "moe_kernel")
            and not is_deferred_attention_layer(layer))


def _shadow(layer: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``layer`` sharing its attributes but owning its tensors (empty, as large as the live
    ones: the processed values land there) and its module state, so that reprocessing it changes
    nothing the engine serves with."""
    shadow = copy.copy(layer)
    shadow._parameters = {name: None if p is None else torch.nn.Parameter(torch.empty_like(p), requires_grad=False)
                          for name, p in layer._parameters.items()}
    shadow._buffers = {name: None if b is None else torch.empty_like(b) for name, b in layer._buffers.items()}
    shadow._modules = {}
    shadow._non_persistent_buffers_set = set(layer._non_persistent_buffers_set)
    return shadow


def _install(layer: torch.nn.Module, shadow: torch.nn.Module) -> None:
    """Put a processed shadow's state into the live ``layer``: its tensors copied into the live storage
    (vLLM keeps storages fixed, CUDA graphs read them), every other attribute it changed (the CPU
    kernels' packed weights live in closures there) set on the layer."""
    stream = torch.cuda.current_stream() if any(
        t is not None and t.is_cuda for t in shadow._parameters.values()) else None
    with torch.inference_mode():
        for store in ("_parameters", "_buffers"):
            live, done = getattr(layer, store), getattr(shadow, store)
            for name, tensor in done.items():
                if tensor is None or live.get(name) is None:
                    live[name] = tensor
                    continue
                live[name].data.copy_(tensor)
                if stream is not None:  # made on the receive's stream: free it only after this copy
                    tensor.record_stream(stream)
    for key in set(layer.__dict__) - set(shadow.__dict__) - set(_MODULE_STATE):
        del layer.__dict__[key]
    for key, value in shadow.__dict__.items():
        if key not in _MODULE_STATE and layer.__dict__.get(key, _MISSING) is not value:
            layer.__dict__[key] = value


_MISSING = object()


__all__ = ["VLLMModelSide", "redo_cpu_moe_packing"]
