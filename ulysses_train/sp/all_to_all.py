"""The differentiable all-to-all at the heart of Ulysses.

`all_to_all(x, group, scatter_dim, gather_dim)` cuts `x` into `sp` chunks along `scatter_dim`, sends chunk j to
rank j of `group`, and concatenates what it receives along `gather_dim`, in rank order. Its gradient is the same
exchange with the two dims swapped. Written on `all_to_all_single` because that is the one form every backend we
run on (NCCL, and gloo for CPU tests) implements.

Around attention (HF layout `(b, h, s, d)`):
    q, k, v: (b, h, s/sp, d) --all_to_all(scatter=heads, gather=seq)--> (b, h/sp, s, d)
    output:  (b, s, h/sp, d) --all_to_all(scatter=seq, gather=heads)--> (b, s/sp, h, d)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .weak_group import WeakGroup


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _exchange(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    sp = dist.get_world_size(group)
    if x.shape[scatter_dim] % sp != 0:
        raise ValueError(f"all_to_all: dim {scatter_dim} of shape {tuple(x.shape)} is not divisible by sp={sp}")
    # (sp, *chunk): chunk j is the j-th slice along scatter_dim, the one rank j receives
    send = x.unflatten(scatter_dim, (sp, -1)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] came from rank j: put the rank index just outside gather_dim and merge, so chunks concatenate in order
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        # weakly: a graph the caller keeps (its loss, its hidden states) must not keep the group alive (groups.py)
        ctx.group, ctx.scatter_dim, ctx.gather_dim = WeakGroup(group), scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group.get(), ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all; the identity when the group has one rank (or is None)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)
