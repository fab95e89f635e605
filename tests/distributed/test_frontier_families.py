"""Families beyond full attention under Ulysses SP equal plain transformers: sliding windows (Gemma 3 and 4, OLMo 3,
windowed Mistral, GPT-OSS), attention sinks (GPT-OSS), attention and final logit softcaps (Gemma 2), chunked
attention with NoPE layers and their temperature tuning (Llama 4 text), NoPE layers (SmolLM3), Gemma 4's wider
global heads and shared-KV layers, and the MoE routers' load-balancing loss over the whole sequence (Qwen3-MoE and
GPT-OSS with `output_router_logits`: transformers adds it to its loss, and so must ours). The window (8) and the chunks
(8) are shorter than each rank's shard, so every rank's queries reach keys another rank projected.

Reference: transformers' eager attention (the only one every family supports) on the same weights, fp32, one
process, computed in the same test, with the whole sequence and, packed, with position ids restarting at each
document (transformers then keeps the documents apart itself, and cuts Llama 4's chunks from each document's
start). GPT-OSS's own packed row lets documents see each other (transformers' mask for it ignores the restarting
positions), so its packed reference runs each document alone, which is what packing means. Each rank runs our attention
("ulysses", SDPA kernel), our fused loss head, and back-propagates its share; the sum of the ranks' gradients must equal
the reference's. One launch per SP size runs every family, packed and not."""

import pytest
import torch

from tests.models import FRONTIER, frontier_config, perturb_sinks
from tests.multiprocess import run_distributed, summed_over

SEQ = 48
DOCS = [20, 28]  # the packed case: two documents, the boundary inside rank 0's shard at SP=2
SP4 = ["gemma4_text", "gpt_oss", "llama4_text", "gpt_oss_balanced"]  # 8 query heads; Gemma 4's 2 global KV heads
# replicated at SP=4. The routers' load-balancing loss of GPT-OSS is over the whole row, which transformers' packed
# GPT-OSS row is not (PACKED_ALONE): it runs unpacked only
UNPACKED_ONLY = {"gpt_oss_balanced"}


def _positions(packed: bool) -> torch.Tensor:
    if not packed:
        return torch.arange(SEQ)[None]
    return torch.cat([torch.arange(n) for n in DOCS])[None]


PACKED_ALONE = {"gpt_oss"}  # transformers' packed row is not the documents apart: the reference runs each alone


def _reference_loss(model, ids, packed: bool, alone: bool):
    """The mean over every target of the row (each document's last token predicts the next one's first, as the
    trainer's shifted labels do), as transformers computes it: on the packed row, or each document alone."""
    if not (packed and alone):
        return model(input_ids=ids, position_ids=_positions(packed), labels=ids).loss
    logits = torch.cat([model(input_ids=ids[:, a:a + n]).logits for a, n in zip((0, DOCS[0]), DOCS)], dim=1)
    return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])


def _reference(name: str, seed: int, packed: bool):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(frontier_config(name), attn_implementation="eager")
    perturb_sinks(model, seed)
    ids = torch.randint(3, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    loss = _reference_loss(model, ids, packed, name in PACKED_ALONE)
    loss.backward()
    return model.state_dict(), ids, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _sharded(rank, world, cases):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.model.surgery import install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.sharding import shard_sequence

    group = dist.new_group(list(range(world)))
    attention = register_ulysses_attention(group, "sdpa")
    results = {}
    for name, seed, packed in cases:
        state, ids, _, _ = _reference(name, seed, packed)
        model = AutoModelForCausalLM.from_config(frontier_config(name), attn_implementation="ulysses")
        model.load_state_dict(state)
        install_loss_head(model, fused=True, chunk_size=16)
        shard = shard_sequence(ids, world, rank, position_ids=_positions(packed))
        attention.doc_lengths = [DOCS] if packed else None
        loss = CausalLMWithSPLoss(model, group)(shard["input_ids"], shard["position_ids"], shard["labels"],
                                                global_token_count(shard["labels"], group))
        results[(name, packed)] = summed_over(group, loss, model)
    return results


def _precise(name: str, state, ids, packed: bool) -> dict:
    """transformers' gradients in fp64 on the same weights and tokens: the truth a near-miss is measured against."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(frontier_config(name), attn_implementation="eager",
                                             experts_implementation="eager").double()  # grouped_mm takes no fp64
    model.load_state_dict(state)
    _reference_loss(model, ids, packed, name in PACKED_ALONE).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _relative(grad, ref) -> float:
    return ((grad.double() - ref.double()).norm() / ref.double().norm()).item() if ref.norm() > 0 else grad.norm()


def _check(results, cases):
    """Each gradient within 1e-5 of transformers' fp32 one; or, where fp32 rounding alone reaches that (a norm's
    weight summed over every position, on some CPUs), within twice transformers' own fp32 error against fp64, as
    --verify holds a run (a cut in the wrong place is orders of magnitude further)."""
    for name, seed, packed in cases:
        state, ids, ref_loss, ref_grads = _reference(name, seed, packed)
        precise = None
        for by_case in results:
            loss, grads = by_case[(name, packed)]
            assert loss == pytest.approx(ref_loss, rel=1e-5), (name, packed)
            for pname, ref in ref_grads.items():  # per tensor, as --verify measures: fp32 sums in another order
                error = _relative(grads[pname], ref)
                if error > 1e-5:
                    precise = precise or _precise(name, state, ids, packed)
                    limit = 2 * max(_relative(ref, precise[pname]), 1e-5)
                    error = _relative(grads[pname], precise[pname])
                    assert error <= limit, (f"{name} (packed {packed}), {pname}: {error:.2e} from fp64 "
                                            f"(limit {limit:.2e})")


def test_every_frontier_family_at_sp2_matches_transformers_packed_and_not():
    cases = [(name, 3 + i, packed) for i, name in enumerate(FRONTIER) for packed in (False, True)
             if not (packed and name in UNPACKED_ONLY)]
    _check(run_distributed(_sharded, 2, cases), cases)


def test_frontier_families_at_sp4_with_replicated_kv_heads_match_transformers():
    cases = [(name, 11 + i, False) for i, name in enumerate(SP4)]
    _check(run_distributed(_sharded, 4, cases), cases)


def test_verify_passes_for_every_frontier_family_at_sp2(tmp_path):
    """`--verify` (the trainer as configured, ZeRO-3, every lever the policy picks, against plain transformers) at
    SP=2 for each family, one trainer after another in one launch."""
    from tests.verify_runs import verify_settings

    settings = []
    for name in FRONTIER:
        path = tmp_path / f"{name}.json"
        path.write_text(frontier_config(name).to_json_string())
        settings.append(["--model_config", str(path), "--sp_size", "2", "--verify_seq_len", "64",
                         "--ds_config", "ds_configs/zero3.json"])
    results = run_distributed(verify_settings, 2, settings, str(tmp_path), use_deepspeed=True)[0]
    for name, result in zip(FRONTIER, results):
        assert result["passed"], (name, result)
        assert "sp 2 x dp 1" in result["setup"] and result["ours"]["grad_max"] < 1e-5, name
