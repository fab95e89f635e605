"""Sequence parallelism: parallel sizes, process groups, the all-to-all, sharding, the attention wrapper and kernels."""
