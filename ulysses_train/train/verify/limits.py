"""The limits `--verify` holds a run to (train/verify/verify.py's docstring says why), shared with the pairs' check
(pairs.py)."""

BF16_FLOOR = 2.0**-15  # ~3e-5 relative: the least error a bf16 statistic is held to (times 2)
FP32_LIMIT = 1e-4  # relative: reduction order, chunked loss and partitioned gradients in fp32
