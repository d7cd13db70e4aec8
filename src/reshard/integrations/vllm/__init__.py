"""The ``reshard`` weight-transfer backend for vLLM.

    plugin.py    registers the backend with vLLM's factories (the ``vllm.general_plugins`` entry point)
    engine.py    worker side: ReshardWeightTransferEngine, driven by vLLM's weight-sync calls
    trainer.py   trainer side: ReshardTrainerInitInfo, ReshardSource, ReshardTrainerWeightTransferEngine,
                 EngineGroup (several engines as one client); pausing around refits, and gating
                 engines a failed refit may have torn (WeightsPoisonedError)
    model.py     a live vLLM model as the destination side (in place, or through vLLM's layerwise reload)
    broadcast.py the baseline ``gloo_broadcast`` backend: vLLM's nccl broadcast path with gloo standing in
    inspect.py   what tests and benchmarks read from engines (tensors, digests, stats, each worker's refit state)

Inference side, nothing to import::

    llm = LLM(model=path, tensor_parallel_size=2,
              weight_transfer_config=WeightTransferConfig(backend="reshard"))

Trainer side, on every trainer rank (see the README, "Use with vLLM")::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from reshard.integrations.vllm import ReshardSource, ReshardTrainerInitInfo

    info = ReshardTrainerInitInfo(rank=rank, master_address="10.0.0.1", master_port=29600,
                                  num_trainer_ranks=2, world_size=2 + 2)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ReshardSource(model))
    engine.send_weights(weight_version="step-1")     # every step, every trainer rank

Importing this package does not import vLLM; its names load on first use.
"""

_NAMES = {"ReshardTrainerInitInfo": "trainer", "ReshardSource": "trainer", "EngineGroup": "trainer",
          "ReshardTrainerWeightTransferEngine": "trainer", "ReshardWeightTransferEngine": "engine",
          "ReshardWeightTransferInitInfo": "engine", "VLLMModelSide": "model", "register": "plugin",
          "BroadcastTrainerInitInfo": "broadcast", "full_checkpoint_tensors": "broadcast",
          "WeightsPoisonedError": "trainer", "OfflineClient": "trainer", "HTTPClient": "trainer",
          "transfer_state": "inspect"}


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = sorted(_NAMES)
