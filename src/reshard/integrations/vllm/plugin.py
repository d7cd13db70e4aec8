"""``vllm.general_plugins`` entry point: registers the ``reshard`` backend with vLLM.

vLLM loads general plugins in the front end, in EngineCore and in every worker before the model is
loaded, so an installed ``reshard`` is all the inference side needs. Registration is by module
path: nothing heavy is imported until a ``reshard`` engine is created.
"""

from __future__ import annotations

BACKEND = "reshard"


def register() -> None:
    """Register the worker-side and trainer-side engines (once per process; repeats are harmless)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, cls in (
            (WeightTransferEngineFactory, "reshard.integrations.vllm.engine", "ReshardWeightTransferEngine"),
            (WeightTransferTrainerFactory, "reshard.integrations.vllm.trainer", "ReshardTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:  # already registered in this process
            pass
