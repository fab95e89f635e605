"""The hybrid Ulysses x ring attention cases, in fp64: their inputs and `run_cases`, which runs cases on the SP groups
SequenceParallelGroups builds and returns each rank's shard of the output and gradients. tests/distributed/test_ring.py
checks them against tests/references.py; tests/helpers/train_then_ring_cases.py runs CASES_8 after a training run on the
same 8 processes."""

import torch

from ulysses_train.sp.sharding import shard_order

DTYPE = torch.float64
B, D, S = 2, 8, 48  # S: a multiple of lcm(2 ring, sp) for every case below
PACKED = [[5, 17, 1, 25], [S]]  # documents per batch row: boundaries inside chunks and across them; one whole row

# (sp, ring, q heads, kv heads, packed, kernel, seed)
CASES_4 = [(2, 2, 8, 2, False, "sdpa", 1), (2, 2, 8, 2, True, "sdpa", 2), (2, 2, 8, 8, True, "flash_attn_4", 3),
           (4, 2, 8, 2, False, "sdpa", 4), (4, 2, 8, 1, True, "sdpa", 5), (4, 2, 8, 2, True, "flash_attn_4", 6),
           (4, 4, 8, 2, False, "sdpa", 7), (4, 4, 8, 4, True, "sdpa", 8)]
CASES_8 = [(8, 4, 8, 2, True, "sdpa", 9), (8, 4, 8, 1, False, "sdpa", 10),
           (8, 2, 8, 2, True, "sdpa", 11), (8, 2, 8, 4, False, "flash_attn_4", 12)]


def inputs(seed, hq, hkv, s=S):
    """q, k, v, dout of a case, each (b, s, heads, d) in DTYPE, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, s, h, D, generator=g, dtype=DTYPE) for h in (hq, hkv, hkv, hq)]  # q, k, v, dout


def run_cases(rank, world, cases):
    """Each case on the SP groups that SequenceParallelGroups builds for it; every rank returns its shard's
    results and the ranks of its groups."""
    import torch.distributed as dist

    from ulysses_train.sp import fa4_op
    from ulysses_train.sp.attention import UlyssesAttention
    from ulysses_train.sp.groups import SequenceParallelGroups

    fa4_op.IMPL.update(forward=fa4_op.reference_forward, backward=fa4_op.reference_backward)  # FA4's path on CPU
    results = []
    for sp, ring, hq, hkv, packed, kernel, seed in cases:
        groups = SequenceParallelGroups(sp, ring)
        q, k, v, dout = inputs(seed, hq, hkv)
        local = S // sp
        mine = shard_order(S, ring)[groups.sp_rank * local:(groups.sp_rank + 1) * local]
        ql, kl, vl = (t[:, mine].transpose(1, 2).clone().requires_grad_() for t in (q, k, v))  # (b, h, s/sp, d)
        attention = UlyssesAttention(groups.ulysses_group, kernel, groups.ring_group)
        attention.doc_lengths = PACKED if packed else None
        out, _ = attention(None, ql, kl, vl, None, scaling=0.3)
        out.backward(dout[:, mine])
        results.append({"rows": mine, "out": out.detach(), "dq": ql.grad.transpose(1, 2),
                        "dk": kl.grad.transpose(1, 2), "dv": vl.grad.transpose(1, 2),
                        "ulysses": dist.get_process_group_ranks(groups.ulysses_group),
                        "ring": dist.get_process_group_ranks(groups.ring_group)})
    return results
