"""A tiny HF model under ZeRO-3 and Ulysses SP gives the loss and every parameter's gradient of one process.

Reference: the same weights in a plain (non-DeepSpeed) model with transformers' own SDPA attention and its own
loss (labels shifted inside the model, mean over the sequence), computed in the same test. fp32 on CPU; the
sharded run sums the same terms in a different order (chunked loss, reduce-scatter), so we allow 1e-5 relative
and 1e-6 absolute (gradients here are ~1e-3..1e-1).

Both fused loss kernels (`--loss_kernel`: ours and Liger-Kernel's, the latter through Triton's interpreter on the
CPU) run in the same launch, one after the other on the same weights, at SP=4 (Qwen3, whose head is tied to the
embedding) and SP=2 (Llama, untied), the head partitioned by ZeRO-3; SP=1 runs both in this process.
Each rank imports Liger (seconds), so the other cases run ours alone. The cases of one SP size run one after the
other in one launch."""

import pytest
import torch

from tests.model_runs import sharded_run, transformers_reference
from tests.models import tiny_config
from tests.multiprocess import run_distributed


def _liger_runs() -> bool:
    """liger-kernel installed, and Triton able to run here (on the CPU: its interpreter, conftest)."""
    from ulysses_train.levers.fused_kernels import kernels_run_on
    from ulysses_train.levers.loss import liger_installed

    return liger_installed() and kernels_run_on(torch.device("cpu"))


BOTH = ("ours", "liger")


CASES = [  # family, sp, loss, ZeRO stage, reduce_scatter, tiled MLP, lean norms, loss kernels
    ("qwen3", 2, "fused", 3, True, True, True, ("ours",)),
    ("qwen3", 4, "fused", 3, True, False, False, BOTH),  # Liger's loss: tied head at SP=4, untied at SP=2 (llama)
    ("qwen3", 2, "plain", 3, True, False, False, ("ours",)),
    ("llama", 2, "fused", 3, True, False, False, BOTH),
    # DeepSpeed averages differently on each of these reduction paths
    ("qwen3", 2, "fused", 3, False, False, False, ("ours",)),
    ("llama", 2, "fused", 2, True, False, True, ("ours",)),
]


def _arguments(family, sp, loss_kind, stage, reduce_scatter, tiled, lean, kernels):
    """sharded_run's arguments (after rank and world) for a case of CASES."""
    if "liger" in kernels and not _liger_runs():
        kernels = ("ours",)  # liger-kernel missing (it comes with the package on Linux): ours is still checked
    return family, 17 * sp + len(family) + stage, loss_kind, stage, reduce_scatter, tiled, "float32", lean, kernels


def _sharded_cases(rank, world, cases):
    """sharded_run for each argument tuple, one after the other in this process."""
    return [sharded_run(rank, world, *arguments) for arguments in cases]


@pytest.fixture(scope="module")
def sharded():
    """{case: every rank's result} for CASES: one launch per SP size, its cases run one after the other."""
    results = {}
    for sp in sorted({case[1] for case in CASES}):
        cases = [case for case in CASES if case[1] == sp]
        per_rank = run_distributed(_sharded_cases, sp, [_arguments(*case) for case in cases], use_deepspeed=True)
        for i, case in enumerate(cases):
            results[case] = [rank_results[i] for rank_results in per_rank]
    return results


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case[:7])) + "-" + "+".join(case[7]))
def test_sharded_model_matches_single_process(case, sharded):
    family, seed, loss_kind, *_, kernels = _arguments(*case)
    _, _, ref_loss, ref_grads = transformers_reference(family, seed, loss_kind)
    results = sharded[case]
    assert len(results) == case[1]
    for by_kernel in results:
        assert by_kernel.keys() == set(kernels)
        for kernel, (loss, grads) in by_kernel.items():
            assert loss == pytest.approx(ref_loss, rel=1e-5), kernel
            assert grads.keys() == ref_grads.keys()
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{kernel}, {name}: {m}")


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # tied head, untied head
def test_both_loss_kernels_at_sp1_match_transformers(family):
    """SP=1 in this process, without DeepSpeed: the loss head with each kernel, as the trainer installs it, against
    transformers' own loss and gradients on the same weights (tolerances as above)."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.levers.loss import CausalLMWithSPLoss, global_token_count
    from ulysses_train.model.surgery import install_loss_head
    from ulysses_train.sp.attention import register_ulysses_attention
    from ulysses_train.sp.sharding import shard_sequence

    if not _liger_runs():
        pytest.skip("liger-kernel is not installed, or Triton cannot run it here")
    state, ids, ref_loss, ref_grads = transformers_reference(family, 5, "fused")
    register_ulysses_attention(None, "sdpa")
    shard = shard_sequence(ids, 1, 0)
    for kernel in BOTH:
        model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="ulysses")
        model.load_state_dict(state)
        assert install_loss_head(model, fused=True, chunk_size=7, kernel=kernel).kernel == kernel
        loss = CausalLMWithSPLoss(model)(shard["input_ids"], shard["position_ids"], shard["labels"],
                                         global_token_count(shard["labels"], None))
        loss.backward()
        assert loss.item() == pytest.approx(ref_loss, rel=1e-5), kernel
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{kernel}, {name}: {m}")
