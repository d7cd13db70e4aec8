"""Framework rules as layout constructors: each module turns one framework's parallel
configuration into a :class:`reshard.Layout` of a model's logical (Hugging Face-named) tensors.

    module            side       framework
    megatron          training   Megatron-Core TP / CP / PP / EP / expert-TP / DP
    fsdp              training   torch FSDP2 / HSDP, over tensor parallelism
    deepspeed         training   DeepSpeed ZeRO-3: a flat chunk of every parameter per rank, as boxes
    tensor_parallel   either     torch DTensor tensor parallelism (parallelize_module), in replicas
    vllm              inference  vLLM engines (fused QKV / gate-up, FusedMoE, padded vocab)
    hf                inference  Hugging Face transformers ``tp_plan="auto"``
    parallel          both       one parallel-configuration type per side, parsed from strings like
                                 ``tp1,ep16,pp4,dp2`` / ``tp8,dp16``, and the layouts of a named model
"""
