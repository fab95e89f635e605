"""benchmarks/phases.py files each profiled GPU kernel by what launched it (the table of the step-time breakdown),
and times the engine's phases; both checked here without a GPU (the kernels' names are the ones CUDA reports)."""

import pytest

from benchmarks.phases import PhaseTimer, kernel_category


@pytest.mark.parametrize("kernel,ancestors,expected", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32", ["aten::mm", "aten::linear"], "matmul"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN", ["aten::addmm"], "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0",
     ["aten::_scaled_dot_product_cudnn_attention", "aten::scaled_dot_product_attention"], "attention_fwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_knob_3",
     ["aten::_scaled_dot_product_cudnn_attention_backward",
      "autograd::engine::evaluate_function: ScaledDotProductCudnnAttentionBackward0"], "attention_bwd"),
    ("flash_fwd_kernel", ["flash_attn::_flash_attn_forward"], "attention_fwd"),
    ("ncclDevKernel_SendRecv", ["c10d::alltoall_base_", "all_to_all"], "all_to_all"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", ["c10d::_reduce_scatter_base_"], "collective"),
    ("Memcpy DtoH (Device -> Pinned)", ["aten::copy_"], "copy_host"),
    ("Memcpy HtoD (Pinned -> Device)", ["aten::copy_", "aten::_to_copy"], "copy_host"),
    # the kept attention output's copy to the host is launched inside the attention op's dispatch
    ("Memcpy DtoH (Device -> Pinned)", ["aten::copy_", "aten::_scaled_dot_product_cudnn_attention"], "copy_host"),
    ("vectorized_elementwise_kernel", ["aten::mul", "ulysses/loss"], "loss"),
    ("multi_tensor_apply_kernel", ["aten::_fused_adamw_", "ulysses/optimizer_step"], "optimizer"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", ["aten::mm", "ulysses/loss"], "loss"),  # the head's matmuls are the loss
    ("triton_red_fused_rms_norm", ["aten::mean"], "other"),
    # FA4's kernels by name, wherever the profiler linked their launch
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at", ["aten::mm"],
     "attention_bwd"),
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at", ["ulysses/loss"],
     "attention_fwd"),
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at",
     ["ulysses::fa4_fwd"], "attention_fwd"),
])
def test_kernel_categories(kernel, ancestors, expected):
    assert kernel_category(kernel, ancestors) == expected


def test_phase_timer_wraps_the_engine(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []

    class Engine:
        def forward(self, x):
            calls.append("forward")
            return x

        def backward(self, loss):
            calls.append("backward")

        def step(self):
            calls.append("step")

    engine = Engine()
    timer = PhaseTimer(engine)
    for _ in range(2):
        engine.backward(engine.forward(1))
        engine.step()
    assert calls == ["forward", "backward", "step"] * 2
    assert len(timer.times) == 2 and set(timer.times[0]) == {"forward", "backward", "step"}


def test_busy_seconds_is_the_union_of_intervals():
    from benchmarks.phases import busy_seconds

    # nanoseconds: [0, 4) and [2, 6) overlap into [0, 6); [10, 11) is apart; [1, 3) lies inside
    assert busy_seconds([(10, 11), (0, 4), (2, 6), (1, 3)]) == 7e-9
    assert busy_seconds([]) == 0.0


def test_each_kernel_is_counted_once_and_ranked():
    """Kernels come from the GPU events (each once), ancestors from the launching op's correlation id."""
    from benchmarks.phases import categorise_kernels

    launchers = {1: ["aten::mm", "ulysses/loss"], 2: ["aten::mul"],
                 3: ["aten::_cudnn_attention_forward", "aten::_scaled_dot_product_cudnn_attention"]}
    kernels = [("gemm_a", 3e-4, 1), ("elementwise", 1e-4, 2), ("elementwise", 1e-4, 2), ("elementwise", 1e-4, 2),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 5e-4, 3), ("orphan", 1e-5, 99)]
    result = categorise_kernels(kernels, launchers)
    assert result["categories"] == pytest.approx({"loss": 3e-4, "other": 3.1e-4, "attention_fwd": 5e-4})
    assert result["top"][0] == ["attention_fwd", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 1, 5e-4]
    assert ["other", "elementwise", 3, 3e-4] in result["top"]


def test_a_run_stopped_before_the_profiled_step_reports_no_kernels_and_raises_nothing(capsys):
    """A benchmark cut short (a time limit's SIGTERM) before the profiled step ends with its other results, not
    with the profiler's error about events it never recorded."""
    from types import SimpleNamespace

    from benchmarks.phases import profile_one_step

    trainer = SimpleNamespace(engine=SimpleNamespace(step=lambda: None))
    with profile_one_step(trainer, 3, None) as result:
        trainer.engine.step()  # one step of three: the run stops here
    assert result == {} and "step 3 was not reached" in capsys.readouterr().out
