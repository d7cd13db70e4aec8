"""Engine integrations: adapters that let an inference engine receive a refit, and a trainer drive it.

    vllm/   the ``reshard`` weight-transfer backend for vLLM (worker side and trainer side)
    trl.py  TRL's GRPOTrainer with its vLLM sync done by reshard (server and colocate modes)
    deepspeed.py  a live DeepSpeed ZeRO-3 model as a refit source (views of its partitions, ``ds_tensor``)

Only this package imports an engine (or DeepSpeed), and only when its adapters are used.
"""
