"""The "ulysses" attention registration works for any full-attention HF decoder without model code changes:
Qwen3-MoE, Mistral and Qwen2 here (Qwen3 and Llama run under DeepSpeed in test_model_equivalence.py).

Plain torch.distributed (no DeepSpeed): each SP rank back-propagates its share of the loss, and the sum of the
ranks' parameter gradients (an explicit all-reduce) must equal the single-process gradients. fp32, tolerances as
in test_model_equivalence.py."""

import pytest
import torch

from tests.models import tiny_config
from tests.multiprocess import run_distributed, summed_over

SEQ = 48


def _reference(family, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="sdpa")
    ids = torch.randint(3, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return model.state_dict(), ids, out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _sharded(rank, world, family, seed):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.model.surgery import install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.sharding import shard_sequence

    state, ids, _, _ = _reference(family, seed)
    group = dist.new_group(list(range(world)))
    register_ulysses_attention(group, "sdpa")
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="ulysses")
    model.load_state_dict(state)
    install_loss_head(model, fused=True, chunk_size=16)
    shard = shard_sequence(ids, world, rank)
    loss = CausalLMWithSPLoss(model)(shard["input_ids"], shard["position_ids"], shard["labels"],
                                     global_token_count(shard["labels"], group))
    return summed_over(group, loss, model)


@pytest.mark.parametrize("family", ["qwen3_moe", "mistral", "qwen2"])
def test_family_matches_single_process(family):
    seed = len(family)
    _, _, ref_loss, ref_grads = _reference(family, seed)
    for loss, grads in run_distributed(_sharded, 2, family, seed):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
