"""Sequence-parallel causal-LM loss, plain or fused-and-chunked.

Contract: the loss of one micro-batch is the mean over every non-ignored token of the whole sequence, across the
SP group. Each rank computes `sum of its tokens' CE / count of valid tokens in the whole SP group`; the SP ranks'
values add up to the true mean. A rank (or a whole batch) with no valid token contributes 0, never NaN.

The fused loss must (1) take its gradient in the forward, so backward never recomputes logits (TRL's chunked loss
recomputes them), (2) run inside the LM head module's own forward so that ZeRO-3 gathers the (possibly tied) head
weight and reduces its gradient, and (3) share the SP normaliser. Two kernels do (1), chosen by `--loss_kernel`
(levers/policy.py): Liger-Kernel's fused linear cross-entropy, the default on CUDA (its kernel is faster than ours:
docs/benchmarks.md, "Kernels: ours against Liger-Kernel and eager PyTorch"), and ours below, which runs everywhere (the
CPU included) and whose chunk size is `--loss_chunk_size`. Both run inside `LMHeadWithLoss.forward` for (2), and Liger's
sums (reduction "sum") are divided by our normaliser for (3).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..sp.sharding import IGNORE_INDEX
from ..sp.weak_group import WeakGroup


def global_token_count(labels: torch.Tensor, sp_group) -> torch.Tensor:
    """Number of non-ignored labels in the whole sequence(s) of this SP group (a float tensor, no grad)."""
    count = (labels != IGNORE_INDEX).sum().to(torch.float32)
    if sp_group is not None and dist.get_world_size(sp_group) > 1:
        dist.all_reduce(count, group=sp_group)
    return count.clamp(min=1.0)


def sp_backward_scale(ds_config: dict, sp_size: int) -> int:
    """Factor by which each SP rank multiplies its loss before `engine.backward`.

    A sequence's true gradient is the *sum* of its SP ranks' contributions. DeepSpeed 0.19 divides the reduced
    gradients by `world` on ZeRO-3's reduce-scatter path (the default), but by `world / sp` on ZeRO-1/2 and on
    ZeRO-3 with `reduce_scatter: false`, where it already treats SP ranks as partial sums. The equivalence tests
    run every one of these paths, so a change in DeepSpeed shows up there."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("stage", 0) == 3 and zero.get("reduce_scatter", True):
        return sp_size
    return 1


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def cap_logits(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """Gemma's final logit softcap, `softcap * tanh(logits / softcap)`, as its causal LM applies it (None: as is)."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
    """Sum of the cross-entropy over valid labels, as log-sum-exp minus the target's logit (in at least fp32),
    after the final logit softcap where the model has one.

    Why not F.cross_entropy: on the CPU its fp32 log-softmax sums the exponentials in an order whose error grows
    with the vocabulary and leans one way (2e-5 per token at 49k ids, 10x logsumexp's), enough to move a
    confident token's gradient, softmax - 1, by a percent. Our fused loss computes the same expression."""
    logits, labels = cap_logits(_at_least_fp32(logits), softcap).flatten(0, -2), labels.flatten()
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    ce = torch.logsumexp(logits, dim=-1) - logits.gather(1, target[:, None]).squeeze(1)
    return torch.where(valid, ce, 0.0).sum()


def plain_loss(logits: torch.Tensor, labels: torch.Tensor, normalizer: torch.Tensor,
               softcap: Optional[float] = None) -> torch.Tensor:
    return cross_entropy_sum(logits, labels, softcap) / normalizer


class _FusedLinearCE(torch.autograd.Function):
    """loss = sum_t CE(h_t W^T, y_t) / normalizer, with dL/dh and dL/dW computed chunk by chunk in the forward.

    Peak extra memory: one chunk of logits (chunk x vocab, fp32) plus dW (fp32, vocab x hidden; none when the head is
    frozen, as under --use_peft); with a final logit softcap c, the logits are c tanh(z / c) and their gradient is
    multiplied by 1 - tanh^2 (one more chunk buffer)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, normalizer, chunk_size, softcap=None):
        # hidden (n, H), weight (V, H), labels (n,)
        grad_hidden = torch.empty_like(hidden)
        # accumulate dW over chunks in at least fp32: hundreds of bf16 partial sums would lose digits
        accum = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=accum, device=weight.device) if ctx.needs_input_grad[1] \
            else None
        loss = torch.zeros((), dtype=accum, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start:start + chunk_size]
            y = labels[start:start + chunk_size]
            valid = y != IGNORE_INDEX
            logits = _at_least_fp32(h @ weight.t())  # (c, V)
            tanh = None
            if softcap is not None:
                tanh = torch.tanh(logits / softcap)
                logits = torch.mul(tanh, softcap, out=logits)
            lse = torch.logsumexp(logits, dim=-1)
            target = torch.where(valid, y, 0)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            loss += torch.where(valid, lse - picked, 0.0).sum()
            # d CE / d logits = softmax - onehot(y), zero on ignored rows, scaled by 1/normalizer
            grad_logits = logits.sub_(lse[:, None]).exp_()  # in place: one (c, V) fp32 buffer
            grad_logits[torch.arange(len(y), device=y.device), target] -= 1.0
            grad_logits *= (valid.to(grad_logits.dtype) / normalizer)[:, None]
            if tanh is not None:  # d(c tanh(z / c)) / dz
                grad_logits *= tanh.square_().neg_().add_(1.0)
                del tanh
            grad_logits = grad_logits.to(hidden.dtype)
            grad_hidden[start:start + chunk_size] = grad_logits @ weight
            if grad_weight is None:  # a frozen head: no (V, H) product, no fp32 buffer
                pass
            elif grad_weight.dtype == h.dtype:
                grad_weight.addmm_(grad_logits.t(), h)
            else:
                grad_weight += grad_logits.t() @ h  # (V, H) in the compute dtype, summed in fp32
            del logits, grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None)
        return loss / normalizer

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_loss, grad_weight * grad_loss if grad_weight is not None else None, None, None,
                None, None)


def fused_linear_cross_entropy(hidden, weight, labels, normalizer, chunk_size: int = 4096,
                               softcap: Optional[float] = None) -> torch.Tensor:
    """hidden (..., H), weight (V, H), labels (...): sum of CE over valid tokens / normalizer."""
    return _FusedLinearCE.apply(hidden.flatten(0, -2), weight, labels.flatten(), normalizer, chunk_size, softcap)


def chunked_cross_entropy(hidden, weight, labels, chunk_size: int = 4096, softcap: Optional[float] = None
                          ) -> torch.Tensor:
    """Sum of the cross-entropy over valid tokens, the logits made `chunk_size` rows at a time (no gradient)."""
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    total = torch.zeros((), dtype=torch.promote_types(weight.dtype, torch.float32), device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        total += cross_entropy_sum(hidden[start:start + chunk_size] @ weight.t(), labels[start:start + chunk_size],
                                   softcap)
    return total


class LMHeadWithLoss(nn.Linear):
    """The model's LM head, able to return the loss instead of logits.

    `install_loss_head(model)` (model/surgery.py) swaps the head's class in place (same parameters, same tying), so
    that calling `lm_head(hidden, labels=..., normalizer=...)` goes through the module's `__call__`: ZeRO-3's hooks
    gather the partitioned weight for the forward and again before this module's backward. Without autograd
    (evaluation) the fused loss computes the loss alone, in the same chunks."""

    chunk_size: int = 4096
    fused: bool = True
    kernel: str = "ours"  # of the fused loss: "liger" trains on Liger-Kernel's; without autograd ours runs
    softcap: Optional[float] = None  # the model's final logit softcap (Gemma 2), applied before the loss

    def forward(self, hidden, labels=None, normalizer=None, objective=None, low_rank=()):
        """`objective`: preference training's loss of whole sequences (levers/preference_loss.py), in place of the
        cross-entropy. `low_rank`: a LoRA on this head (LoRAHeadWithLoss), as pairs (scaling x A(dropout(hidden))
        (..., r), B (V, r)): the logits become hidden W^T + sum of those products, computed as one matmul of the
        hidden states and the low-rank inputs laid side by side against W and the Bs side by side, so every kernel
        below takes it unchanged and autograd hands each piece its gradient."""
        if labels is None:  # the causal LM applies its own softcap to these
            return super().forward(hidden)
        if self.bias is not None:
            raise NotImplementedError("an LM head with a bias is not supported by the loss head")
        weight = self.weight
        if low_rank:
            hidden = torch.cat([hidden, *(h.to(hidden.dtype) for h, _ in low_rank)], dim=-1)  # (..., H + r)
            weight = torch.cat([weight, *(b.to(weight.dtype) for _, b in low_rank)], dim=1)  # (V, H + r)
        if objective is not None:
            return objective(hidden, weight, labels, self)
        if self.kernel == "liger" and hidden.requires_grad and torch.is_grad_enabled():
            return liger_linear_cross_entropy(hidden, weight, labels, normalizer, self.softcap)
        if self.fused and not torch.is_grad_enabled():
            return chunked_cross_entropy(hidden, weight, labels, self.chunk_size, self.softcap) / normalizer
        if self.fused:
            return fused_linear_cross_entropy(hidden, weight, labels, normalizer, self.chunk_size, self.softcap)
        return plain_loss(nn.functional.linear(hidden, weight), labels, normalizer, self.softcap)


def lora_head_forward(self, hidden, labels=None, normalizer=None, objective=None):
    """The forward of PEFT's LoRA layer around the LM head (`--lora_target_modules lm_head`), made able to return
    the loss: with labels, each active adapter's low-rank input is computed here (through its A module, so ZeRO-3
    gathers A) and the head's loss module (LMHeadWithLoss) adds B's term; ZeRO-3 gathers B there as an external
    parameter of that module (model/surgery.py: install_loss_head). Without labels, PEFT's own forward."""
    if labels is None:
        return type(self).__bases__[0].forward(self, hidden)
    low_rank = []
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        a = self.lora_A[name]
        x = self._cast_input_dtype(hidden, a.weight.dtype)
        low_rank.append((a(self.lora_dropout[name](x)) * self.scaling[name], self.lora_B[name].weight))
    return self.base_layer(hidden, labels=labels, normalizer=normalizer, objective=objective, low_rank=low_rank)


def backbone(model: nn.Module) -> nn.Module:
    """The causal LM's decoder stack (hidden states out, no head). `get_decoder()` names it in most families;
    Llama 4's text model returns itself there, so its `model` attribute is taken instead."""
    decoder = model.get_decoder()
    if decoder is model or decoder.get_output_embeddings() is not None:
        decoder = model.model
    return decoder


class CausalLMWithSPLoss(nn.Module):
    """One module whose forward is backbone + loss head, so the DeepSpeed engine's forward drives both.

    A MoE whose config asks for `output_router_logits` adds its router's load-balancing loss as transformers does
    (`loss + router_aux_loss_coef * aux`), with `aux` over the SP group's whole sequence (`router_aux_share`).
    `sp_group`: the ranks sharing one sequence (None: this rank alone)."""

    def __init__(self, model: nn.Module, sp_group=None):
        super().__init__()
        self.model = model
        self._sp_group = WeakGroup(sp_group)  # nothing of ours keeps a group past destroy_process_group

    @property
    def sp_group(self):
        return self._sp_group.get()

    def forward(self, input_ids, position_ids, labels, normalizer):
        # (b, s/sp) -> hidden (b, s/sp, H) -> scalar: this rank's share of the SP group's mean loss
        config = self.model.config
        balance = bool(getattr(config, "output_router_logits", False))
        out = backbone(self.model)(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                   **({"output_router_logits": True} if balance else {}))
        loss = self.model.get_output_embeddings()(out[0], labels=labels, normalizer=normalizer)
        if balance:
            # transformers adds the aux loss once per batch, and our loss is the step's token mean: weigh it by
            # this batch's share of the step's targets, as the reference weighs each batch's loss
            share = global_token_count(labels, self.sp_group) / normalizer
            aux = router_aux_share(out.router_logits, config.num_experts, config.num_experts_per_tok, self.sp_group)
            loss = loss + config.router_aux_loss_coef * share * aux
        return loss


def router_aux_share(router_logits: tuple, num_experts: int, top_k: int, sp_group=None) -> torch.Tensor:
    """This rank's share of transformers' load-balancing loss (Switch Transformer's, its `load_balancing_loss_func`)
    over the SP group's whole sequence: E x sum_e f_e P_e, with f_e the fraction of (token, layer) rows that route
    to expert e and P_e their mean router probability, both over every rank's rows. f carries no gradient, so it is
    all-reduced, and each rank keeps its own rows' part of P: the ranks' shares add up to the whole sequence's loss
    (each shard balancing only its own tokens would be a different, wrong loss). router_logits: per MoE layer
    (rows on this rank, E)."""
    counts = torch.zeros(num_experts + 1, dtype=torch.float32, device=router_logits[0].device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=counts.device)
    for layer in router_logits:
        probs = torch.softmax(layer.float(), dim=-1)  # (rows, E)
        chosen = probs.topk(top_k, dim=-1).indices
        counts[:num_experts] += torch.bincount(chosen.flatten(), minlength=num_experts).float()
        counts[num_experts] += probs.shape[0]
        prob_sum = prob_sum + probs.sum(dim=0)
    if sp_group is not None and dist.get_world_size(sp_group) > 1:
        dist.all_reduce(counts, group=sp_group)
    rows = counts[num_experts].clamp(min=1.0)
    return (counts[:num_experts] / rows * prob_sum / rows).sum() * num_experts


# ---------------------------------------------------------------- Liger-Kernel's fused loss (--loss_kernel liger)


def liger_installed() -> bool:
    """liger-kernel and Triton are installed (found, not imported: importing Liger takes seconds)."""
    return all(importlib.util.find_spec(name) is not None for name in ("liger_kernel", "triton"))


@functools.lru_cache(maxsize=None)
def _liger_loss():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy


def liger_linear_cross_entropy(hidden, weight, labels, normalizer, softcap: Optional[float] = None) -> torch.Tensor:
    """hidden (..., H), weight (V, H), labels (...): sum of CE over valid tokens / normalizer, by Liger-Kernel.

    Liger chunks the rows itself (about n / ceil(V / H) rows, rounded up to a power of two: logits of about the
    size of the hidden states, in their dtype) and, like ours, takes both gradients in the forward. The head's
    gradient is summed over the chunks in fp32 (accum_dtype), as ours is: Liger's default sums it in the weight's
    dtype, which in bf16 rounds every chunk's partial sum."""
    loss = _liger_loss()(hidden.flatten(0, -2), weight, labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="sum", accum_dtype=torch.float32, softcap=softcap)
    return loss / normalizer


def liger_check(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why Liger's loss cannot train on `device` in this process, or None: it needs CUDA (or, for tests, the CPU
    under Triton's interpreter), must import, and must agree with ours, loss and both gradients, on a small case
    with several chunks (a partial one) and ignored labels (to 1e-5 in fp32, 3e-2 relative in bf16)."""
    from .fused_check import rel_err
    from .fused_kernels import kernels_run_on

    if not liger_installed():
        return "liger-kernel is not installed (pip install liger-kernel)"
    if not kernels_run_on(device):  # Liger's kernels are Triton kernels too
        return f"it runs on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {device.type}"
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(40, 32, generator=g), torch.randn(100, 32, generator=g)
    labels = torch.randint(0, 100, (40,), generator=g)
    labels[5:17] = IGNORE_INDEX
    results = []
    try:  # Liger chunks these 40 rows by 16 (40 / ceil(100 / 32), rounded up to a power of two): 16, 16, 8
        for loss_fn in (liger_linear_cross_entropy, functools.partial(fused_linear_cross_entropy, chunk_size=16)):
            h, w = (t.to(device, dtype).clone().requires_grad_() for t in (hidden, weight))
            y = labels.to(device)
            loss = loss_fn(h, w, y, (y != IGNORE_INDEX).sum().float())
            loss.backward()
            results.append((loss.detach(), h.grad, w.grad))
    except Exception as e:  # not importable, or a kernel that does not compile or launch here
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for what, got, want in zip(("loss", "hidden's gradient", "weight's gradient"), *results):
        err = rel_err(got, want)
        if not err <= tol:  # NaN fails too
            return f"its {what} differs from ours by {err:.1e} (tolerance {tol:.0e})"
    return None
