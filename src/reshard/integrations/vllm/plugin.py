"""``vllm.general_plugins`` entry point: registers the ``reshard`` backend with vLLM.

vLLM loads general plugins in the front end, in EngineCore and in every worker before the model is
loaded, so an installed ``reshard`` is all the inference side needs. Registration is by module
path: nothing heavy is imported until a ``reshard`` engine is created.
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
    """Register the worker-side and trainer-side engines (once per process; repeats are harmless)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for name, worker, trainer in ENGINES:
        for factory, where in ((WeightTransferEngineFactory, worker), (WeightTransferTrainerFactory, trainer)):
            module, cls = where.split(":")
            try:
                factory.register_engine(name, module, cls)
            except ValueError:  # already registered in this process
                pass
