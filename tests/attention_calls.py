"""Counting attention kernel calls at the dispatcher: how the tests see whether a checkpoint's recompute ran the
attention again or kept its outputs."""

from torch.utils._python_dispatch import TorchDispatchMode


class CountAttention(TorchDispatchMode):
    """While active, `calls` counts the attention forward ops dispatched (SDPA's kernels, FA4's registered op); their
    backward ops are not counted."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if ("scaled_dot_product" in str(func) or "fa4_fwd" in str(func)) and "backward" not in str(func):
            self.calls += 1
        return func(*args, **(kwargs or {}))
