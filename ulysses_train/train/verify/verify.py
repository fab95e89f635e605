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

The gradient's norm is such a scalar too, and a far noisier one: a gradient whose rounding error has relative size e
(the whole vector's, `grad_whole`) changes its norm by e^2 / 2 through the part of the error orthogonal to it, and
by a like amount of either sign through the part along it. On the H200 (a 4-layer Qwen3-0.6B shape with LoRA, e =
1.6e-2) transformers' own bf16 norm error was 8.9e-5 with one seed and 4.2e-4 with the next, and ours 2.6e-4 and
2.1e-4: twice one draw of transformers' error fails an implementation as exact as transformers about a third of
the time. So the norm is held to twice transformers' norm error or twice transformers' e^2, whichever is larger
(`norm_noise_floor`); a wrong scale of the gradient stays a failure from about 2 e^2 (6e-4 there; the CPU tests
inject one of 2e-3), and below that an fp32 `--verify` (errors of 1e-8) is the check for it.

A model with Gated DeltaNet layers is the exception among fp32 runs: the gradients of its decay's parameters
(`A_log`, `dt_bias`) reach the loss through exponentials of cumulative sums of the decay, and move by up to 1e-4 when
only the rounding of the projections before them changes, in transformers itself. There the truth is an fp64
reference (transformers' recurrence and its loss still run in fp32 inside it), and an fp32 run is held, like a bf16
one, to twice transformers' own fp32 error, never below `FP32_LIMIT`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...data.sources import trainable_tokens
from ...errors import ConfigError
from ..process.faults import NonFiniteError
from ..run.trainer import verify_folder
from ..step.loop import accumulate
from .limits import BF16_FLOOR, FP32_LIMIT
from .pairs import PreferenceReference, format_reference_line
from .reference_model import host_grad, reference_step, supports_sdpa

STATS = ("loss", "grad_norm", "grad_whole", "grad_median", "grad_max")
LABELS = {"loss": "loss", "grad_norm": "grad norm", "grad_whole": "whole gradient",
          "grad_median": "per-tensor grad, median", "grad_max": "per-tensor grad, max"}


@dataclass
class Errors:
    """Relative errors of one run against the fp32 reference, and the two gradients' norms."""

    loss: float
    grad_norm: float
    grad_whole: float  # |g - g_ref| / |g_ref| over every parameter at once, those without a reference gradient too
    grad_median: float
    grad_max: float
    worst_tensor: str
    tensors: int = 0  # compared: every parameter whose reference gradient is not zero
    norm: float = 0.0  # |g|, over every gradient of the run's
    reference_norm: float = 0.0  # |g_ref|


PIECE = 1 << 26  # elements widened to fp64 at a time (512 MiB): the peak of a comparison, whatever the tensor's size


def squared_sums(ours: torch.Tensor, ref: torch.Tensor, device: torch.device) -> tuple[float, float, float]:
    """|ours|^2, |ref|^2 and |ours - ref|^2 in fp64, in one pass a piece at a time on `device`. The gradients wait on
    the host in their own dtype (host_grad); widening and reducing them there took most of a large cut's --verify
    (about 60 s per billion parameters on an H100 machine's host: 169 s of GPT-OSS's 188 s of references at two
    layers, 2.8B parameters); on the run's GPU what is left is mostly the copies (not yet timed there)."""
    ours, ref = ours.reshape(-1), ref.reshape(-1)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for start in range(0, ref.numel(), PIECE):
        x, y = (t[start:start + PIECE].to(device, torch.float64) for t in (ours, ref))
        sums += torch.stack([torch.dot(x, x), torch.dot(y, y), torch.dot(x - y, x - y)])
    return tuple(sums.tolist())


def grad_norm(grads: dict, device: torch.device = torch.device("cpu")) -> float:
    return math.sqrt(sum(squared_sums(g, g, device)[0] for g in grads.values()))


def relative_errors(loss: float, grads: dict, ref_loss: float, ref_grads: dict,
                    device: torch.device = torch.device("cpu")) -> Errors:
    """Our loss and gradients (`grads`) against the reference's, in fp64 on `device` (squared_sums)."""
    per_tensor, ours_sq, ref_sq, diff_sq = {}, 0.0, 0.0, 0.0
    for name, ref in ref_grads.items():
        mine, theirs, diff = squared_sums(grads[name], ref, device)
        ours_sq, ref_sq, diff_sq = ours_sq + mine, ref_sq + theirs, diff_sq + diff  # a spurious gradient counts
        if theirs > 0:
            per_tensor[name] = math.sqrt(diff / theirs)
    norm = math.sqrt(ours_sq + grad_norm({n: g for n, g in grads.items() if n not in ref_grads}, device) ** 2)
    ref_norm = math.sqrt(ref_sq)
    worst = max(per_tensor, key=per_tensor.get)
    return Errors(abs(loss - ref_loss) / abs(ref_loss), abs(norm - ref_norm) / ref_norm,
                  math.sqrt(diff_sq) / ref_norm, statistics.median(per_tensor.values()), per_tensor[worst],
                  worst, len(per_tensor), norm, ref_norm)


def limits(dtype: torch.dtype, transformers_errors: Optional[Errors]) -> dict:
    if transformers_errors is None:
        return {k: FP32_LIMIT for k in STATS}
    floor = FP32_LIMIT / 2 if dtype == torch.float32 else BF16_FLOOR
    lim = {k: 2 * max(getattr(transformers_errors, k), floor) for k in STATS}
    lim["grad_norm"] = max(lim["grad_norm"], 2 * norm_noise_floor(transformers_errors))
    return lim


def norm_noise_floor(transformers_errors: Errors) -> float:
    """How far rounding alone moves the gradient's norm when the whole gradient is off by transformers' own relative
    error e: e^2 (the module docstring says why)."""
    return transformers_errors.grad_whole**2


def truth_dtype(dtype: torch.dtype, layers) -> torch.dtype:
    """The reference's dtype errors are measured against: fp32, or fp64 for an fp32 run of a model with layers that
    are not attention (the module docstring says why)."""
    return torch.float64 if dtype == torch.float32 and any(not m.attention for m in layers) else torch.float32


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
                       f"{str(want.dtype).removeprefix('torch.')}"
                       f"{'' if got.dtype != want.dtype else ', values differ'})")
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
    """The gradient of every trained parameter (all of them, but the frozen base under --use_peft), on rank 0."""
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        grad = safe_get_full_grad(param)
        if rank == 0:
            out[name.removeprefix("model.")] = (host_grad(grad) if grad is not None
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
    if trainer.adapters is not None:  # zero B (at initialisation) would leave A without a gradient to compare
        from ...model.adapters import randomize_lora_b

        randomize_lora_b(trainer.module, trainer.cfg.data.seed + step)
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


def _peft_version() -> str:
    import peft

    return peft.__version__


def format_report(result: dict) -> str:
    ours, theirs, lim = result["ours"], result.get("transformers"), result["limits"]
    lines = [f"verify: one step of {result['tokens']:,} tokens x {result['sequences']} sequence(s) "
             f"({result['targets']:,} targets), {result['dtype']}, {result['setup']}",
             f"  reference: plain transformers {result['transformers_version']}"
             + (f" + PEFT {result['peft_version']} (LoRA-B drawn non-zero)" if result.get("peft_version") else "")
             + f", {result.get('reference_attention', 'SDPA')} "
             f"attention, same weights and tokens; "
             f"{result.get('truth', 'fp32')} loss {result['reference_loss']:.6f}, ours {result['loss']:.6f}",
             f"  {'error vs ' + result.get('truth', 'fp32'):<26}{'ours':>12}{'transformers':>14}{'limit':>12}"]
    for key in STATS:
        lines.append(_row(LABELS[key], ours[key], theirs[key] if theirs else None, lim[key]))
    lines.append(f"  worst tensor (ours): {ours['worst_tensor']}")
    if "reference_logps" in result:  # DPO (train/verify/pairs.py)
        lines.append(format_reference_line(result["reference_logps"]))
    bad = result["buffer_mismatches"]
    lines.append(f"  buffers: {result['buffers']} compared with plain transformers', "
                 + (f"{len(bad)} differ: {', '.join(bad)}" if bad else "all equal"))
    seconds = result["seconds"]
    lines.append(f"  took {seconds['ours']:.1f} s (our step, gathers) + {seconds['reference']:.1f} s "
                 f"(reference{'s' if theirs else ''}, of it {seconds['compare']:.1f} s comparing)")
    lines.append(f"verdict: {'PASS' if result['passed'] else 'FAIL'}" + (
        "" if result["passed"] else f" ({', '.join(result['failed'])} over the limit; see docs/verify.md)"))
    return "\n".join(lines)


def verify(trainer) -> int:
    """Runs the check (collective), prints the table on rank 0; returns the exit code: 0 within tolerance, 1 outside
    it."""
    return 0 if run_verify(trainer)["passed"] else 1


def _reference_for(trainer):
    """reference_step, or for preference training its counterpart on whole pairs (train/verify/pairs.py)."""
    if trainer.spec is None:
        return reference_step
    return PreferenceReference(trainer.spec, weights_are_reference=trainer.start_step == 0,
                               ref_model=trainer.cfg.pref.ref_model)


@contextlib.contextmanager
def stage(log: Callable[[str], None], what: str, seconds: dict, key: str):
    """Says what --verify does next and, when it is done, how long it took (kept in `seconds[key]` for
    verify.json): a verify of a large model spends minutes in its references, and a user should see which part the
    time goes to."""
    log(f"verify: {what} ...")
    start = time.perf_counter()
    yield
    took = time.perf_counter() - start
    seconds[key] = seconds.get(key, 0.0) + took  # a stage that comes twice (the comparisons) adds up
    log(f"verify: done in {took:.1f} s")


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch."))


def _reference_size(weights: dict, dtype: torch.dtype) -> str:
    """The reference model's size in `dtype`: it is built on the host, then moved to the run's device."""
    count = sum(w.numel() for w in weights.values())
    size = count * dtype.itemsize / 2**30
    return f"plain transformers with {count / 1e6:,.1f}M parameters ({size:,.2f} GiB), forward and backward"


def run_verify(trainer) -> dict:
    """Runs the check (collective); every rank returns the result that rank 0 printed and wrote to verify.json."""
    import transformers

    cfg, rank = trainer.cfg, trainer.rank
    start, seconds = time.perf_counter(), {}
    with stage(trainer.log, "our step: forward and backward without the optimizer step, then the weights and "
                            "gradients gathered to rank 0", seconds, "ours"):
        loss, weights, buffers, grads, batches = our_step(trainer, trainer.start_step)
    shared = [None]
    if rank == 0:
        truth = truth_dtype(trainer.dtype, trainer.layers)
        reference_step = _reference_for(trainer)
        extra = (trainer.adapters, trainer.cfg.base.model)
        with stage(trainer.log, f"{_dtype_name(truth)} reference: {_reference_size(weights, truth)}", seconds,
                   "truth_reference"):
            ref_loss, ref_grads, ref_buffers = reference_step(trainer.model_config, weights, batches, truth,
                                                              trainer.device, *extra, is_truth=True)
        compare = f"comparing {len(ref_grads)} gradients in fp64 on {trainer.device.type}"
        with stage(trainer.log, compare, seconds, "compare"):
            ours = relative_errors(loss, grads, ref_loss, ref_grads, trainer.device)
        del grads  # the host holds two gradient sets at a time, not three (a large model's are tens of GB)
        theirs = None
        if trainer.dtype != truth:  # its buffers are the ones ours must equal
            with stage(trainer.log, f"{_dtype_name(trainer.dtype)} reference (transformers' own error): "
                                    f"{_reference_size(weights, trainer.dtype)}", seconds, "dtype_reference"):
                t_loss, t_grads, ref_buffers = reference_step(trainer.model_config, weights, batches,
                                                              trainer.dtype, trainer.device, *extra)
            with stage(trainer.log, compare, seconds, "compare"):
                theirs = relative_errors(t_loss, t_grads, ref_loss, ref_grads, trainer.device)
        lim = limits(trainer.dtype, theirs)
        failed = [LABELS[k] for k in STATS if not getattr(ours, k) <= lim[k]]
        bad_buffers = buffer_mismatches(buffers, ref_buffers)
        failed += ["buffers"] if bad_buffers else []
        checks, more = reference_step.check(truth, trainer.dtype) if hasattr(reference_step, "check") else ({}, [])
        failed += more
        result = checks | {"tokens": batches[0]["input_ids"].shape[1],
                  "sequences": sum(len(b["input_ids"]) for b in batches),
                  "targets": sum(trainable_tokens(b) for b in batches),
                  "dtype": str(trainer.dtype).removeprefix("torch."), "setup": trainer.describe_setup(),
                  "transformers_version": transformers.__version__,
                  "peft_version": _peft_version() if trainer.adapters is not None else None,
                  "reference_attention": "SDPA" if supports_sdpa(trainer.model_config) else "eager",
                  "loss": loss, "reference_loss": ref_loss, "truth": _dtype_name(truth),
                  "grad_norm": ours.norm, "reference_grad_norm": ours.reference_norm,
                  "ours": asdict(ours), "transformers": asdict(theirs) if theirs else None, "limits": lim,
                  "buffers": len(ref_buffers), "buffer_mismatches": bad_buffers,
                  "seconds": seconds | {"reference": time.perf_counter() - start - seconds["ours"]},
                  "failed": failed, "passed": not failed}
        print(format_report(result), flush=True)
        os.makedirs(verify_folder(cfg), exist_ok=True)
        with open(os.path.join(verify_folder(cfg), "verify.json"), "w") as f:
            json.dump(result, f, indent=1)
        shared = [result]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]
