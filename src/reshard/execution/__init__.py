"""Execution: running a plan over torch.distributed (or in one process): packing, executors, process groups."""
