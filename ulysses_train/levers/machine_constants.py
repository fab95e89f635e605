"""A machine's rates and bandwidths for the step-time model (time_model.py): the attention kernels' rates and the
shares they run at on windows and wide heads, the elementwise kernels' costs, and `Constants`, whose defaults are
one H200 fitted to the steps measured in docs/results (docs/time.md says how each was fitted), or a machine's own
from `python -m ulysses_train.plan --calibrate FILE` (tools/calibrate.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Optional

KERNELS = ("flash_attn_4", "sdpa", "flash_attn")


@dataclass(frozen=True)
class AttentionRates:
    """A causal attention kernel's rates, TFLOP/s, counting 2 x tokens^2 x heads x head_dim per forward (the causal
    half of the score and value products) and 2.5 times that per backward; and what the same kernel reaches, as a
    share of those rates, on a sliding-window mask (over the query-key pairs its tiles compute, `kernel_window_pairs`)
    and at heads wider than 128 (1.0: not measured, the causal rate)."""

    fwd: float
    bwd: float
    window: float = 1.0
    wide_heads: float = 1.0


@dataclass(frozen=True)
class ElementwiseCosts:
    """Seconds per token per element of width, forward and backward: RMSNorms (width: hidden twice, and the q and k
    heads in Qwen3), rotary (q and k heads), SwiGLU product (intermediate)."""

    norm_fwd: float
    norm_bwd: float
    rotary_fwd: float
    rotary_bwd: float
    swiglu_fwd: float
    swiglu_bwd: float


# benchmarks/kernel_bench.py on the H200 at 131k tokens (docs/results/kernels_fused_vs_eager.json): each op's time
# over tokens x its width; eager = the lean RMSNorm in PyTorch ops, transformers' rotary, silu(gate) * up
H200_FUSED = ElementwiseCosts(norm_fwd=1.2e-12, norm_bwd=2.9e-12, rotary_fwd=1.2e-12, rotary_bwd=3.9e-12,
                              swiglu_fwd=1.45e-12, swiglu_bwd=2.35e-12)
H200_EAGER = ElementwiseCosts(norm_fwd=13.3e-12, norm_bwd=29.5e-12, rotary_fwd=26.8e-12, rotary_bwd=15.4e-12,
                              swiglu_fwd=2.4e-12, swiglu_bwd=4.2e-12)


# FA4 (flash_attn.cute 4.0.0b36) on the H200 (SM90) with a sliding window: causal=True plus window_size_left
# resolves to its `local` mask, which runs at this share of the causal rates over the pairs its tiles compute
# (`kernel_window_pairs`). Fitted on the one windowed step at head_dim 128, OLMo-3-7B at 65,536 tokens (24 of 32
# layers with a 4,096-key window; docs/results/windowed_current.json), every other term of that step as fitted
# on Qwen3: 0.50 leaves it at -0.2%. A local row is short (33 key tiles a query tile there, 66 query tiles a key
# tile in the backward, against 256-512 for a causal row at 64k) with masked tiles at both ends; the share is an
# effective rate, not yet split by a kernel profile (benchmarks/windowed_rows.sh records one).
FA4_WINDOW_SHARE = 0.50
# FA4 on SM90 at head_dim 256 (Gemma 2/3): its tiles shrink to 128 x 80 forward (128 x 64 local) and 64 x 48 in the
# backward (its 64 KB dQ staging buffer leaves no room for wider key tiles), against 128 x 128 and 64 x 128 at 128,
# the head_dim its causal rates are measured at. Fitted on Gemma-3-4B's two steps (65,536 and 131,072 tokens; 5
# global layers of 34, whose attention grows 4x between them where the rest grows 2x), FA4_WINDOW_SHARE held: 0.67
# puts them at -1.4% and +0.9%.
FA4_WIDE_HEAD_SHARE = 0.67
# cuDNN's SDPA on the H200 at head_dim 256 (Qwen3.5's 8 attention layers), against its rates at 128. Fitted with
# the first `deltanet_elementwise` on Qwen3.5-9B's two full-depth steps (65,536 and 131,072 tokens, where the
# attention grows 4x and the rest 2x): both within 0.5%, where one rate for every head size left them at +2.2% and
# -2.3% (and the rows before the fused gated norm at +2.5% and -2.3%, the same lean).
SDPA_WIDE_HEAD_SHARE = 0.79


def _h200_attention() -> dict:
    # FA4: the in-step profiles (659-661 forward, 595-608 backward) and benchmarks/attn_bench.py (668, 599-613).
    # cuDNN (what SDPA picks on the H200): the benchmark gives 554-602 and 518-538; in steps, fitted, 95% of the
    # middle of that (the steps at 704k and 1M tokens, and every cuDNN step at 64k-131k, ran slower than the
    # benchmark's one layer call). SDPA's FA2 backend: ~325 measured alone, not in a step.
    return {"flash_attn_4": AttentionRates(fwd=660.0, bwd=600.0, window=FA4_WINDOW_SHARE,
                                           wide_heads=FA4_WIDE_HEAD_SHARE),
            "sdpa": AttentionRates(fwd=546.0, bwd=504.0, wide_heads=SDPA_WIDE_HEAD_SHARE),
            "flash_attn": AttentionRates(fwd=325.0, bwd=325.0)}


@dataclass(frozen=True)
class Constants:
    """A machine's rates and bandwidths. The defaults are one H200 in an 8-GPU NVLink 4 node with 400 Gb/s
    InfiniBand per GPU, fitted to the measured steps where those exist (docs/time.md) and set from the hardware's
    published figures where they do not (said per field)."""

    name: str = "H200 (defaults fitted to docs/results)"
    """Where the constants come from."""
    matmul_tflops: float = 725.0
    """bf16 TFLOP/s the layers' linear layers reach in a step: fitted on the profiled matmul kernels against the
    ceiling measured beside them (docs/benchmarks.md, "Where the time of a step goes")."""
    moe_matmul_efficiency: float = 0.5
    """Share of `matmul_tflops` that MoE experts reach (transformers runs them one expert at a time, with a gather
    and a scatter of the tokens): not measured, an assumption."""
    attention: dict = field(default_factory=_h200_attention)
    """Kernel name (--attn_kernel) -> AttentionRates."""
    linear_attention_tflops: float = 64.0
    """A Gated DeltaNet layer's recurrence (Qwen3.5, Qwen3-Next: FLA's chunked gated delta rule, the op whose
    outputs `--linear_recompute never` keeps), forward, over the FLOPs `_deltanet_flops` counts; the backward 2.5x
    its FLOPs at the same rate. Fitted on Qwen3.5-9B at 65,536 tokens on one H200 (docs/benchmarks.md): the step
    with the rule recomputed against the one with its outputs kept is one forward of it in 24 layers, 0.10 s. Far
    below the matmul ceiling: FLA's kernels are bound by the chunk's small products and the state's traffic."""
    deltanet_elementwise: float = 1.0e-11
    """Seconds per token and conv channel (2 x key width + value width) of a Gated DeltaNet layer's forward work
    around the recurrence: FLA's causal conv, the q, k, v layout (under SP: the all-to-all's concatenation), FLA's
    L2 norm of q and k, the gates; the backward twice it. It runs in the recompute whether the rule's outputs are
    kept or not. Fitted on Qwen3.5-9B at 16 of its 32 layers, 65,536 tokens, one H100, with the mixer that hands the
    projection's own q, k, v output to the conv (docs/time.md, "Windows, chunks and linear layers"), the
    recurrence's rate held; the full-depth H200 steps of the mixer that still copied them fitted 1.9e-11."""
    loss_tflops: float = 350.0
    """The fused loss, over 6 x tokens x vocabulary x hidden: fitted on its time in the profiled steps
    (docs/benchmarks.md, "Where the time of a step goes"; alone: "Fused loss chunk size"). Our kernel
    (--loss_kernel ours)."""
    liger_loss_tflops: float = 540.0
    """Liger-Kernel's fused linear cross-entropy (--loss_kernel liger, the CUDA default), the same FLOPs: fitted to
    the steps it shortened against ours (docs/benchmarks.md, "One H200 against TRL": the `_liger` and `_ours` rows;
    alone: "Kernels: ours against Liger-Kernel and eager PyTorch")."""
    fused: ElementwiseCosts = H200_FUSED
    """Our Triton norms, rotary and SwiGLU (--fused_kernels)."""
    eager: ElementwiseCosts = H200_EAGER
    """The PyTorch ops they replace."""
    eager_in_step: float = 0.75
    """What the eager ops take inside a step against their cost alone: the step's saving with the fused kernels
    over the ops' difference alone (docs/benchmarks.md, "Our fused kernels against the ops they replace"); fitted
    on the eager steps."""
    hbm_tb_s: float = 3.0
    """Bandwidth of plain copies and adds (residual adds, the all-to-all's layout copies, k and v copied to every
    head, a MoE's token gathers), TB/s; H200 HBM3e is 4.8 peak."""
    adam_gb_s: float = 660.0
    """DeepSpeed's fused Adam on the GPU, bytes of states read and written per second (14 bytes per parameter with
    bf16 states, 28 with fp32 masters): fitted on the profiled optimizer step (docs/benchmarks.md, "Where the time
    of a step goes")."""
    cpu_adam_params_per_s: float = 1.72e9
    """DeepSpeed's CPU Adam on one host (all its cores), parameters per second: fitted on the run with the optimizer
    states in host memory (docs/benchmarks.md, "Optimizer states in host memory")."""
    pcie_gb_s: float = 55.0
    """Host <-> GPU copies of the offload, per GPU and direction, GB/s: fitted on the profiled host copies
    (docs/benchmarks.md, "Where the time of a step goes"; PCIe 5 x16)."""
    host_gb_s: float = 400.0
    """Host memory bandwidth one node's GPUs share for the offload, GB/s (not measured: 8 x PCIe 5, about what two
    sockets of DDR5 give)."""
    nvlink_gb_s: float = 300.0
    """All-to-all and ZeRO-3 collectives inside a node, bytes each GPU sends per second, GB/s: two thirds of NVLink
    4's 450 per direction, what NCCL's all-to-all is commonly reported to reach. Not measured here: the two-GPU
    runs spend under 2% of their step in it, too little to pin it (`--calibrate` under torchrun measures it)."""
    network_gb_s: float = 45.0
    """The same between nodes, per GPU (one 400 Gb/s InfiniBand NIC per GPU: 50 GB/s; not measured)."""
    gpus_per_node: int = 8
    """GPUs sharing a node's NVLink and host."""
    step_overhead_s: float = 0.05
    """Per step: the engine's bookkeeping, gradient norm, the loss's all-reduce; fitted."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, values: dict) -> "Constants":
        values = {k: v for k, v in values.items() if k != "measured"}  # calibrate.py's note of what it measured
        if "attention" in values:
            values["attention"] = {k: AttentionRates(**v) for k, v in values["attention"].items()}
        for name in ("fused", "eager"):
            if name in values:
                values[name] = ElementwiseCosts(**values[name])
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown constants: {', '.join(sorted(unknown))}")
        return cls(**values)

    @classmethod
    def load(cls, path: Optional[str]) -> "Constants":
        if path is None:
            return cls()
        with open(path) as f:
            return cls.from_json(json.load(f))
