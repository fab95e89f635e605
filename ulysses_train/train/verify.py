"""`--verify`: is this run exact? One step of the run as configured, against plain transformers.

The trainer is built exactly as the flags say (SP and DP sizes, ZeRO stage, every lever, the attention kernel, the
dtype, `--model` or a preset), runs the forward and backward of its first step at `--verify_seq_len` tokens and
stops before the optimizer step. Rank 0 then gathers the engine's weights and the gradient of every parameter and
runs a single-process reference on the same weights and tokens: plain transformers (`AutoModelForCausalLM`,
SDPA attention, none of our levers), once in fp32 (the cross-entropy of its logits in fp64: the reference stands for
the exact gradient) and once in the run's dtype (its own loss).

Why the run's dtype matters: bf16 is never equal to fp32, so a fixed tolerance either hides a real fault (the
bf16 rotary frequencies once cost 25 times transformers' own bf16 error) or fails runs that are as exact as bf16
allows. The question is whether we are as close to fp32 as transformers itself is in bf16: each error of ours,
measured against the fp32 reference, must be at most twice transformers' bf16 error of the same kind, and is never
held below `BF16_FLOOR` (a scalar such as the loss can land near the truth by chance). An fp32 run must agree with
the fp32 reference to `FP32_LIMIT`.

A model with Gated DeltaNet layers is the exception among fp32 runs: the gradients of its decay's parameters
(`A_log`, `dt_bias`) reach the loss through exponentials of cumulative sums of the decay, and move by up to 1e-4 when
only the rounding of the projections before them changes, in transformers itself. There the truth is an fp64
reference (transformers' recurrence and its loss still run in fp32 inside it), and an fp32 run is held, like a bf16
one, to twice transformers' own fp32 error, never below `FP32_LIMIT`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..data.sources import trainable_tokens
from ..errors import ConfigError
from ..sp.sharding import IGNORE_INDEX, shift_labels
from .faults import NonFiniteError
from .loop import accumulate
from .trainer import verify_folder

BF16_FLOOR = 2.0**-15  # ~3e-5 relative: the least error a bf16 statistic is held to (times 2)
FP32_LIMIT = 1e-4  # relative: reduction order, chunked loss and partitioned gradients in fp32
STATS = ("loss", "grad_norm", "grad_median", "grad_max")
LABELS = {"loss": "loss", "grad_norm": "grad norm", "grad_median": "per-tensor grad, median",
          "grad_max": "per-tensor grad, max"}


@dataclass
class Errors:
    """Relative errors of one run against the fp32 reference."""

    loss: float
    grad_norm: float
    grad_median: float
    grad_max: float
    worst_tensor: str


def grad_norm(grads: dict) -> float:
    return math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))


def relative_errors(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> Errors:
    per_tensor = {}
    for name, ref in ref_grads.items():
        norm = ref.norm().item()
        if norm > 0:
            per_tensor[name] = (grads[name] - ref).norm().item() / norm
    norm, ref_norm = grad_norm(grads), grad_norm(ref_grads)
    worst = max(per_tensor, key=per_tensor.get)
    return Errors(abs(loss - ref_loss) / abs(ref_loss), abs(norm - ref_norm) / ref_norm,
                  statistics.median(per_tensor.values()), per_tensor[worst], worst)


def limits(dtype: torch.dtype, transformers_errors: Optional[Errors]) -> dict:
    if transformers_errors is None:
        return {k: FP32_LIMIT for k in STATS}
    floor = FP32_LIMIT / 2 if dtype == torch.float32 else BF16_FLOOR
    return {k: 2 * max(getattr(transformers_errors, k), floor) for k in STATS}


def truth_dtype(dtype: torch.dtype, layers) -> torch.dtype:
    """The reference's dtype errors are measured against: fp32, or fp64 for an fp32 run of a model with layers that
    are not attention (the module docstring says why)."""
    return torch.float64 if dtype == torch.float32 and any(not m.attention for m in layers) else torch.float32


# ---------------------------------------------------------------- the reference


@contextlib.contextmanager
def _without_zero3():
    """transformers builds inside `zero.Init` while an HfDeepSpeedConfig for ZeRO-3 lives; the reference must not."""
    from transformers.integrations import deepspeed as hf_ds

    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


REFERENCE_FP32_ATTENTION = "sdpa_all_heads"


def _sdpa_all_heads(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention (its `sdpa_attention_forward`) with the KV heads copied to every query head, as
    transformers itself does whenever a mask is given. Why: for grouped KV heads transformers asks SDPA for
    `enable_gqa`, which in fp32 on CUDA no fused kernel takes, so PyTorch falls back to the math kernel that holds
    every (s x s) score: 137 GB at 32k tokens for 32 heads. The fp32 reference uses this; the reference in the run's
    dtype uses transformers' "sdpa" as it is."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=is_causal)
    return out.transpose(1, 2).contiguous(), None


def _register_reference_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REFERENCE_FP32_ATTENTION, _sdpa_all_heads)
    AttentionMaskInterface.register(REFERENCE_FP32_ATTENTION, sdpa_mask)


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers: initialise, only slower
        return contextlib.nullcontext()
    return no_init_weights()


def _supports_sdpa(model_config) -> bool:
    """Whether transformers runs this family with SDPA (the families whose attention SDPA cannot express do not)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)], "_supports_sdpa", True)


def reference_step(model_config, weights: dict, batches: list[dict], dtype: torch.dtype,
                   device: torch.device) -> tuple[float, dict, dict]:
    """Plain transformers on `weights`: the mean over every trainable token of `batches`, the gradient of that mean
    (fp32, CPU) and the model's own buffers. Gradient checkpointing bounds the memory; it recomputes the
    same ops."""
    from transformers import AutoModelForCausalLM

    # the weights are overwritten next: skip their random initialisation (19 s on the CPU for Qwen3-4B's embedding
    # alone); the buffers are computed in __init__ exactly as with it
    attention = "sdpa"
    if not _supports_sdpa(model_config):  # GPT-OSS's sinks, Gemma 2's softcap: transformers' own is eager
        attention = "eager"
    elif dtype in (torch.float32, torch.float64):
        _register_reference_attention()
        attention = REFERENCE_FP32_ATTENTION
    # fp64: transformers' grouped-matmul experts take no fp64, its eager loop does (the same sums)
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    with _without_zero3(), _no_init_weights():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(model_config), dtype=dtype,
                                                 attn_implementation=attention, **experts)
    model.tie_weights()  # part of the initialisation skipped above
    params = dict(model.named_parameters())  # tied weights once
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise RuntimeError(f"--verify: the engine's weights do not fit a plain {type(model).__name__}: missing "
                           f"{missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, param in params.items():  # one tensor at a time: no second copy of the model in host memory
            param.copy_(weights[name])
    model.to(device).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    total, counts = 0.0, [trainable_tokens(b) for b in batches]
    for batch, count in zip(batches, counts):  # the mean over every trainable token of the step, as ours
        if count == 0:  # no target: nothing to add (transformers' mean over no token would be NaN)
            continue
        inputs = {"input_ids": batch["input_ids"].to(device), "position_ids": batch["position_ids"].to(device),
                  "use_cache": False}
        if dtype == torch.float32:  # the model's own logits, the cross-entropy in fp64: see fp64_cross_entropy_sum
            out = model(**inputs)
            share = fp64_cross_entropy_sum(out.logits, shift_labels(batch["labels"]).to(device)) / max(1, sum(counts))
            if getattr(out, "aux_loss", None) is not None:  # a MoE's load-balancing loss, as transformers adds it
                share = share + model_config.router_aux_loss_coef * out.aux_loss * (count / max(1, sum(counts)))
        else:  # transformers' own loss: this batch's mean
            share = model(**inputs, labels=batch["labels"].to(device)).loss * (count / max(1, sum(counts)))
        share.backward()
        total += share.item()
    grads = {n: (p.grad.detach().float().cpu() if p.grad is not None else torch.zeros(p.shape))
             for n, p in model.named_parameters()}
    buffers = {n: b.detach().cpu() for n, b in model.named_buffers()}
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return total, grads, buffers


def _ce_fp64(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.double(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def fp64_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The fp32 reference's loss: the sum of the cross-entropy of fp32 logits (b, s, V), computed in fp64, rows
    in pieces of about 1 GiB each recomputed in the backward (no fp64 copy of every logit is kept).

    Why: the reference stands for the exact gradient. transformers' loss in fp32 is F.cross_entropy, whose CPU
    log-softmax is off by 2e-5 per token at a 49k vocabulary (levers/loss.py: cross_entropy_sum), which moved
    SmolLM2-135M's gradients by 1e-4 (the fp32 limit) while our loss was within 3e-6 of fp64."""
    from torch.utils.checkpoint import checkpoint

    logits, labels = logits.flatten(0, -2), labels.flatten()
    rows = max(1, 2**27 // logits.shape[-1])
    total = logits.new_zeros((), dtype=torch.float64)
    for start in range(0, logits.shape[0], rows):
        total = total + checkpoint(_ce_fp64, logits[start:start + rows], labels[start:start + rows],
                                   use_reentrant=False)
    return total


def buffer_mismatches(ours: dict, theirs: dict) -> list[str]:
    """Buffers of ours that differ in dtype or value from plain transformers' (e.g. rotary frequencies rounded to
    bf16): exact, so no rounding noise can hide them."""
    bad = []
    for name, want in theirs.items():
        got = ours.get(name)
        if got is None:
            bad.append(f"{name} (missing)")
        elif got.dtype != want.dtype or not torch.equal(got, want):
            bad.append(f"{name} ({str(got.dtype).removeprefix('torch.')}, plain transformers: "
                       f"{str(want.dtype).removeprefix('torch.')}{'' if got.dtype != want.dtype else ', values differ'})")
    return bad


# ---------------------------------------------------------------- our side


def _gather_weights(engine, rank: int) -> dict:
    """Every parameter of the engine's model in its own dtype, on rank 0's CPU (collective under ZeRO-3)."""
    import deepspeed

    out = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            if rank == 0:
                out[name.removeprefix("model.")] = param.data.detach().cpu().clone()
    return out


def _gather_grads(engine, rank: int) -> dict:
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, param in engine.module.named_parameters():
        grad = safe_get_full_grad(param)
        if rank == 0:
            out[name.removeprefix("model.")] = (grad.detach().float().cpu() if grad is not None
                                                else torch.zeros(param.ds_shape if hasattr(param, "ds_shape")
                                                                 else param.shape))
    return out


def our_step(trainer, step: int) -> tuple[float, dict, dict, dict, list[dict]]:
    """The engine's forward and backward of step `step + 1`, every micro-step of it, without the optimizer step.
    Returns the loss (the mean over the step's trainable tokens, as the training loop logs it), the weights,
    buffers and gradients on rank 0, and the whole batches of every DP rank (rank 0 runs the reference on all of
    them)."""
    g, rank = trainer.groups, trainer.rank
    batches = [trainer.micro_batch(step, m, dp_rank=d) for d in range(g.dp_size) for m in range(trainer.accum)]
    require_targets(trainer, batches)
    weights = _gather_weights(trainer.engine, rank)
    buffers = {n.removeprefix("model."): b.detach().cpu() for n, b in trainer.engine.module.named_buffers()}
    loss, _, skipped = accumulate(trainer, step + 1, finish=False)
    if skipped:
        raise NonFiniteError("--verify: the loss of the first step is not finite")
    loss = loss.item()
    grads = _gather_grads(trainer.engine, rank)
    return loss, weights, buffers, grads, batches


def require_targets(trainer, batches: list[dict]) -> None:
    """The checked step must train something, or there is no gradient to compare (every rank holds every batch,
    so every rank raises)."""
    if any(trainable_tokens(b) for b in batches):
        return
    raise ConfigError(f"--verify: the first step's {sum(len(b['input_ids']) for b in batches)} sequence(s) have no "
                      f"target (nothing the model is trained to write): nothing to compare; check --dataset, "
                      f"--loss_on and --chat_template, or raise --micro_batch_size / --grad_accum to take in more "
                      f"samples")


# ---------------------------------------------------------------- report


def _row(name: str, ours: float, theirs: Optional[float], limit: float) -> str:
    theirs_text = f"{theirs:>14.2e}" if theirs is not None else f"{'-':>14}"
    verdict = "ok" if ours <= limit else "FAIL"
    return f"  {name:<26}{ours:>12.2e}{theirs_text}{limit:>12.2e}  {verdict}"


def format_report(result: dict) -> str:
    ours, theirs, lim = result["ours"], result.get("transformers"), result["limits"]
    lines = [f"verify: one step of {result['tokens']:,} tokens x {result['sequences']} sequence(s) "
             f"({result['targets']:,} targets), {result['dtype']}, {result['setup']}",
             f"  reference: plain transformers {result['transformers_version']}, {result.get('reference_attention', 'SDPA')} "
             f"attention, same weights and tokens; "
             f"{result.get('truth', 'fp32')} loss {result['reference_loss']:.6f}, ours {result['loss']:.6f}",
             f"  {'error vs ' + result.get('truth', 'fp32'):<26}{'ours':>12}{'transformers':>14}{'limit':>12}"]
    for key in STATS:
        lines.append(_row(LABELS[key], ours[key], theirs[key] if theirs else None, lim[key]))
    lines.append(f"  worst tensor (ours): {ours['worst_tensor']}")
    bad = result["buffer_mismatches"]
    lines.append(f"  buffers: {result['buffers']} compared with plain transformers', "
                 + (f"{len(bad)} differ: {', '.join(bad)}" if bad else "all equal"))
    lines.append(f"  took {result['seconds']['ours']:.1f} s (our step, gathers) + {result['seconds']['reference']:.1f} s "
                 f"(reference{'s' if theirs else ''})")
    lines.append(f"verdict: {'PASS' if result['passed'] else 'FAIL'}" + (
        "" if result["passed"] else f" ({', '.join(result['failed'])} over the limit; see docs/verify.md)"))
    return "\n".join(lines)


def verify(trainer) -> int:
    """Runs the check (collective), prints the table on rank 0; returns the exit code: 0 within tolerance, 1 outside
    it."""
    return 0 if run_verify(trainer)["passed"] else 1


def run_verify(trainer) -> dict:
    """Runs the check (collective); every rank returns the result that rank 0 printed and wrote to verify.json."""
    import transformers

    cfg, rank = trainer.cfg, trainer.rank
    start = time.perf_counter()
    loss, weights, buffers, grads, batches = our_step(trainer, trainer.start_step)
    ours_s = time.perf_counter() - start
    shared = [None]
    if rank == 0:
        truth = truth_dtype(trainer.dtype, trainer.layers)
        ref_loss, ref_grads, ref_buffers = reference_step(trainer.model_config, weights, batches, truth,
                                                          trainer.device)
        ours = relative_errors(loss, grads, ref_loss, ref_grads)
        theirs = None
        if trainer.dtype != truth:  # its buffers are the ones ours must equal
            t_loss, t_grads, ref_buffers = reference_step(trainer.model_config, weights, batches, trainer.dtype,
                                                          trainer.device)
            theirs = relative_errors(t_loss, t_grads, ref_loss, ref_grads)
        lim = limits(trainer.dtype, theirs)
        failed = [LABELS[k] for k in STATS if not getattr(ours, k) <= lim[k]]
        bad_buffers = buffer_mismatches(buffers, ref_buffers)
        failed += ["buffers"] if bad_buffers else []
        result = {"tokens": batches[0]["input_ids"].shape[1], "sequences": sum(len(b["input_ids"]) for b in batches),
                  "targets": sum(trainable_tokens(b) for b in batches),
                  "dtype": str(trainer.dtype).removeprefix("torch."), "setup": trainer.describe_setup(),
                  "transformers_version": transformers.__version__,
                  "reference_attention": "SDPA" if _supports_sdpa(trainer.model_config) else "eager",
                  "loss": loss, "reference_loss": ref_loss, "truth": "fp64" if truth == torch.float64 else "fp32",
                  "grad_norm": grad_norm(grads), "reference_grad_norm": grad_norm(ref_grads),
                  "ours": asdict(ours), "transformers": asdict(theirs) if theirs else None, "limits": lim,
                  "buffers": len(ref_buffers), "buffer_mismatches": bad_buffers,
                  "seconds": {"ours": ours_s, "reference": time.perf_counter() - start - ours_s},
                  "failed": failed, "passed": not failed}
        print(format_report(result), flush=True)
        os.makedirs(verify_folder(cfg), exist_ok=True)
        with open(os.path.join(verify_folder(cfg), "verify.json"), "w") as f:
            json.dump(result, f, indent=1)
        shared = [result]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]
