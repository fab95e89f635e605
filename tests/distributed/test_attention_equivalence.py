"""Ulysses attention on sp ranks equals one process's attention over the whole sequence: outputs and dq/dk/dv.

fp32 on CPU. The sharded run computes the same dot products in the same order for each head (the all-to-alls only
move data), so differences are rounding of the reductions inside SDPA: we allow 1e-5 relative, about 100x fp32
epsilon accumulated over the ~64-term softmax sums of this size, far below any indexing error (which is O(1))."""

import pytest
import torch

from tests.multiprocess import run_distributed
from tests.references import causal_attention

B, S, D = 2, 32, 16
CASES = [(sp, hq, hkv) for sp in (1, 2, 4) for hq, hkv in ((8, 8), (8, 4), (8, 2), (8, 1), (4, 4))
         if hq % sp == 0 and (hkv % sp == 0 or sp % hkv == 0)]


def _inputs(seed, hq, hkv):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (hq, hkv, hkv))
    grad_out = torch.randn(B, S, hq, D, generator=g)
    return q, k, v, grad_out


def _oracle(sp, hq, hkv):
    return sp == 2 and (hq, hkv) == (8, 4)


def _seed(sp, hq, hkv):
    return 1000 * sp + 10 * hq + hkv  # fresh inputs for every case


def _run_cases(rank, world, cases):
    """Every case in one world of max(sp) processes: for each sp the ranks form world/sp groups of consecutive
    ranks, and every group runs each case of that sp on the same inputs (so a group's own ranks, not the world's,
    must place each shard). Returns this rank and {case: (rank in its group, group index, that rank's result)}."""
    import torch.distributed as dist

    results = {}
    for sp in sorted({case[0] for case in cases}):
        groups = [dist.new_group(list(range(first, first + sp))) for first in range(0, world, sp)]  # collective
        for case in (c for c in cases if c[0] == sp):
            _, hq, hkv = case
            result = _run_case(groups[rank // sp], rank % sp, sp, _seed(*case), hq, hkv, _oracle(*case))
            results[case] = (rank % sp, rank // sp, result)
    return rank, results


def _run_case(group, rank, world, seed, hq, hkv, with_deepspeed_oracle):
    """One SP rank (`rank` of `world` in `group`) of a sharded attention forward and backward."""
    from ulysses_train.sp.attention import UlyssesAttention

    q, k, v, grad_out = _inputs(seed, hq, hkv)
    local = S // world
    cut = slice(rank * local, (rank + 1) * local)
    # this rank's shard, in HF layout (b, h, s/sp, d)
    ql, kl, vl = (t[:, :, cut].clone().requires_grad_() for t in (q, k, v))
    out, _ = UlyssesAttention(group, "sdpa")(None, ql, kl, vl, None, scaling=D ** -0.5)
    out.backward(grad_out[:, cut])
    result = {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    if with_deepspeed_oracle:
        result["deepspeed_out"] = _deepspeed_oracle(group, world, ql.detach(), kl.detach(), vl.detach(), hq, hkv)
    return result


def _deepspeed_oracle(group, world, q, k, v, hq, hkv):
    """DeepSpeed's own UlyssesSPAttentionHF on the same shard, as a second, independent implementation."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Module(torch.nn.Module):
        is_causal = True
        num_key_value_groups = hq // hkv

    attn = UlyssesSPAttentionHF(sdpa_attention_forward, batch_size=B, attn_head_count=hq, attn_head_size=D,
                                kv_head_count=hkv, num_hidden_layers=1, process_group=group,
                                seq_length_is_variable=True)
    position_ids = torch.arange(S // world)[None].expand(B, -1) + dist_rank(group) * (S // world)
    out, _ = attn(Module(), q, k, v, None, position_ids=position_ids, scaling=D ** -0.5)
    return out.detach()


def dist_rank(group):
    import torch.distributed as dist

    return dist.get_rank(group)


@pytest.fixture(scope="module")
def sharded():
    """All cases in one launch: max(sp) processes (DeepSpeed's comm initialised, for its oracle)."""
    world = max(sp for sp, _, _ in CASES)
    by_rank = run_distributed(_run_cases, world, CASES, use_deepspeed=True)
    assert [rank for rank, _ in by_rank] == list(range(world))  # the harness returns results in rank order
    results = {}  # case -> one list of SP-rank results per group, in SP-rank order
    for _, rank_results in by_rank:
        for case, (sp_rank, group, result) in rank_results.items():
            results.setdefault(case, {}).setdefault(group, {})[sp_rank] = result
    return {case: [[ranks[r] for r in sorted(ranks)] for _, ranks in sorted(groups.items())]
            for case, groups in results.items()}


@pytest.mark.parametrize("sp,hq,hkv", CASES)
def test_ulysses_attention_matches_single_process(sp, hq, hkv, sharded):
    oracle = _oracle(sp, hq, hkv)
    q, k, v, grad_out = _inputs(_seed(sp, hq, hkv), hq, hkv)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = causal_attention(q, k, v)
    ref.backward(grad_out)
    groups = sharded[(sp, hq, hkv)]
    assert len(groups) == max(s for s, _, _ in CASES) // sp and all(len(results) == sp for results in groups)
    tol = dict(rtol=1e-5, atol=1e-5)
    for results in groups:  # every group of sp ranks, on the same inputs
        got = {name: torch.cat([r[name] for r in results], dim=dim)
               for name, dim in (("out", 1), ("dq", 2), ("dk", 2), ("dv", 2))}
        torch.testing.assert_close(got["out"], ref.detach(), **tol)
        torch.testing.assert_close(got["dq"], q.grad, **tol)
        torch.testing.assert_close(got["dk"], k.grad, **tol)
        torch.testing.assert_close(got["dv"], v.grad, **tol)
        if oracle:
            deepspeed_out = torch.cat([r["deepspeed_out"] for r in results], dim=1)  # (b, s, h*d)
            torch.testing.assert_close(deepspeed_out.reshape(ref.shape), ref.detach(), **tol)


def test_all_to_all_is_identity_without_group():
    from ulysses_train.sp.all_to_all import all_to_all

    x = torch.randn(2, 4, 8, 3)
    assert all_to_all(x, None, 1, 2) is x
