"""The ``reshard`` weight-transfer backend for vLLM.

    plugin.py     registers the backend with vLLM's factories (the ``vllm.general_plugins`` entry point)
    engine.py     worker side: ReshardWeightTransferEngine, driven by vLLM's weight-sync calls
    model.py      a live vLLM model as the destination side (in place, or through vLLM's layerwise reload)
    init_info.py  trainer side: ReshardTrainerInitInfo, how the trainer ranks and engines form the refit group
    source.py     trainer side: ReshardSource, a trainer rank's local shards and their layout
    clients.py    the engines as the trainer drives them: OfflineClient, HTTPClient, AsyncLLMClient (pause,
                  gate: WeightsPoisonedError; AsyncLLMClient.stream times each token), EngineGroup (several
                  engines as one client)
    threads.py    calls made bounded: each on a daemon thread, waited for at most a given time
    trainer.py    trainer side: ReshardTrainerWeightTransferEngine; pausing around refits, and gating
                  engines a failed refit may have torn
    broadcast.py  the baseline ``gloo_broadcast`` backend: vLLM's nccl broadcast path with gloo standing in
    inspect.py    what tests and benchmarks read from engines (tensors, digests, stats, each worker's refit state)

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

_NAMES = {"ReshardTrainerInitInfo": "init_info", "ReshardSource": "source",
          "ReshardTrainerWeightTransferEngine": "trainer", "EngineGroup": "clients", "OfflineClient": "clients",
          "HTTPClient": "clients", "AsyncLLMClient": "clients", "TokenStream": "clients",
          "WeightsPoisonedError": "clients", "ReshardWeightTransferEngine": "engine",
          "ReshardWeightTransferInitInfo": "engine", "VLLMModelSide": "model", "register": "plugin",
          "BroadcastTrainerInitInfo": "broadcast", "full_checkpoint_tensors": "broadcast",
          "transfer_state": "inspect", "engine_precision": "init_info"}


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = sorted(_NAMES)
