"""Engine integrations: adapters that let an inference engine receive a refit, and a trainer drive it.

    vllm/   the ``reshard`` weight-transfer backend for vLLM (worker side and trainer side)
    trl.py  TRL's GRPOTrainer with its vLLM sync done by reshard (server and colocate modes)

Only this package imports an engine, and only when its adapters are used.
"""
