"""Preference losses (DPO, SimPO, ORPO) under sequence parallelism, from hidden states without the logits.

A micro-batch holds P pairs, each as two documents of a packed row (data/pair_packing.py), split over the SP group.
The losses are functions of each sequence's log-probability, the sum over its completion's tokens of log p(token),
and no rank holds a whole sequence. So, inside the LM head's forward (as the SFT loss, levers/loss.py):

1. per-token log-probs of the rank's scored tokens, the logits made by row chunks and dropped (only scored rows go
   through the head: a long prompt costs nothing there), and of each chunk what TRL's DPOTrainer logs per token
   (the mean logit, the entropy, whether the label is the argmax: `token_stats`);
2. their sums per sequence (P x 2), all-reduced over the SP group in one call: every rank then holds every
   sequence's sums;
3. the loss of the micro-batch and its gradient with respect to each sum (autograd on P x 2 numbers; the formulas
   are TRL's, `pair_terms`), the same on every rank;
4. a second pass over the chunks takes every token's gradient in the forward, weighted by its sequence's
   dL/dsum: dL/dlogits = w (onehot - softmax), into dL/dhidden and dL/dW, which the backward only returns.

The logits are made twice (four matmuls against the SFT loss's three: the weights of step 4 are known only after
step 2's all-reduce); the peak is one chunk of logits, as for SFT. The loss is normalised over the global batch: the
pair terms are divided by the pairs of the whole optimizer step (every micro-batch, every DP rank) and ORPO's NLL by
the step's chosen completion tokens, so DeepSpeed's averaging (undone in the loop as for SFT) gives the step's mean.
Each rank returns loss / sp as its value (the SP group's values add up to the loss) and its own tokens' share of the
gradient of the whole loss (the shares add up to the gradient).

Why not Liger-Kernel's fused preference losses (liger_kernel.chunked_loss: DPO, ORPO, SimPO, CPO, KTO): they chunk
over the batch dimension, a chunk being whole chosen and rejected rows whose logits they make at once (a pair of
2 x 64k tokens of Qwen3-4B: 2 x 65,536 x 151,936 fp32 logits, 80 GB) and whose log-prob sums they take inside the
chunk before the loss. Under SP no rank holds a whole sequence: the sums need the SP group's all-reduce between the
per-token log-probs and the loss, where their chunk function has no place for one; and they take chosen and rejected
as padded batch rows, not as two documents of one packed row. What of Liger fits: its fused linear cross-entropy
with reduction="none" returns per-token losses and folds a per-token upstream gradient in its backward (recomputing
the logits there: the same four matmuls, the second pair in the backward), so it could compute steps 1 and 4 inside
our head on CUDA; ours runs on every device and keeps the SFT loss's gradient-in-the-forward, and is what runs for
every `--loss_kernel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..sp.sharding import IGNORE_INDEX
from .loss import CausalLMWithSPLoss, _at_least_fp32, backbone, router_aux_share

METHODS = ("sft", "dpo", "simpo", "orpo")
LOSS_TYPES = ("sigmoid", "ipo", "hinge")
PAIR_STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
              "logps/rejected")  # means over the pairs
# means over completion tokens, as TRL's DPOTrainer logs them: the vocabulary's mean logit on the chosen and on the
# rejected completions' tokens, the entropy of the next-token distribution on both, and how often the chosen
# completion's token is the argmax; the tokens each is a mean over
TOKEN_STATS = {"logits/chosen": "chosen", "logits/rejected": "rejected", "entropy": "both",
               "mean_token_accuracy": "chosen"}
STATS = PAIR_STATS + tuple(TOKEN_STATS)
ORPO_STATS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


@dataclass(frozen=True)
class PreferenceSpec:
    """The loss: --method, --beta, --loss_type (DPO), --simpo_gamma (SimPO)."""

    method: str
    beta: float = 0.1
    loss_type: str = "sigmoid"
    simpo_gamma: float = 0.5

    @property
    def uses_reference(self) -> bool:
        return self.method == "dpo"

    def stat_keys(self) -> tuple:
        return STATS + (ORPO_STATS if self.method == "orpo" else ())


def step_means(stats: dict, pairs: float, chosen_tokens: float, tokens: float) -> dict:
    """The sums of `PreferenceObjective.stats` over a step -> the means TRL logs: pair stats over the `pairs`, token
    stats over their tokens (`chosen_tokens` of the chosen completions, `tokens` of both), ORPO's nll_loss as it is
    (already the step's mean)."""
    over = {"chosen": chosen_tokens, "rejected": tokens - chosen_tokens, "both": tokens}
    return {k: v if k == "nll_loss" else v / max(1.0, over[TOKEN_STATS[k]] if k in TOKEN_STATS else pairs)
            for k, v in stats.items()}


def pair_stats(terms: dict, token_sums: Optional[torch.Tensor] = None, nll: Optional[torch.Tensor] = None) -> dict:
    """The sums over pairs of what TRL logs (`step_means` makes them means): from `pair_terms`' terms, the
    per-sequence sums of `token_stats` (P, 2, 3) where they were taken, and ORPO's NLL."""
    rewards, logps = terms["rewards"], terms["logps"]
    stats = {"rewards/chosen": rewards[:, 0].sum(), "rewards/rejected": rewards[:, 1].sum(),
             "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).sum(),
             "rewards/margins": (rewards[:, 0] - rewards[:, 1]).sum(), "logps/chosen": logps[:, 0].sum(),
             "logps/rejected": logps[:, 1].sum()}
    if token_sums is not None:
        t = token_sums
        stats |= {"logits/chosen": t[:, 0, 0].sum(), "logits/rejected": t[:, 1, 0].sum(),
                  "entropy": t[:, :, 1].sum(), "mean_token_accuracy": t[:, 0, 2].sum()}
    if nll is not None:
        stats |= {"nll_loss": nll.detach(), "log_odds_ratio": terms["log_odds_ratio"].sum(),
                  "log_odds_chosen": terms["log_odds_chosen"].sum()}
    return {k: float(v) for k, v in stats.items()}


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (the branch at -ln 2, as TRL's ORPO computes it)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_terms(spec: PreferenceSpec, logps: torch.Tensor, scored: torch.Tensor,
               reference: Optional[torch.Tensor] = None) -> dict:
    """Per pair: `losses` (P,), `rewards` (P, 2) and the `logps` (P, 2) TRL logs, from each side's summed log-prob
    `logps` (P, 2: chosen, rejected), its scored tokens `scored` (P, 2) and, for DPO, the reference's sums.

    dpo    TRL's DPOTrainer: delta = (chosen - ref_chosen) - (rejected - ref_rejected); sigmoid -logsigmoid(beta
           delta), hinge relu(1 - beta delta), ipo ((chosen - ref) / n_chosen - (rejected - ref) / n_rejected -
           1 / (2 beta))^2; rewards beta (logps - ref)
    simpo  TRL's CPOTrainer with loss_type="simpo" and cpo_alpha=0 (SimPO as published): the per-token means m,
           -logsigmoid(beta (m_chosen - m_rejected) - gamma); rewards beta m
    orpo   TRL's ORPOTrainer's odds ratio on the per-token means: -beta logsigmoid((m_c - m_r) - (log(1 - e^m_c)
           - log(1 - e^m_r))); rewards beta m; its NLL is added by `PreferenceObjective.loss`"""
    beta = spec.beta
    if spec.method == "dpo":
        ratios = logps - reference
        delta = ratios[:, 0] - ratios[:, 1]
        if spec.loss_type == "sigmoid":
            losses = -F.logsigmoid(beta * delta)
        elif spec.loss_type == "hinge":
            losses = torch.relu(1 - beta * delta)
        else:
            per_token = ratios / scored.clamp(min=1)
            losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
        return {"losses": losses, "rewards": beta * ratios.detach(), "logps": logps.detach()}
    means = logps / scored.clamp(min=1)
    if spec.method == "simpo":
        losses = -F.logsigmoid(beta * (means[:, 0] - means[:, 1]) - spec.simpo_gamma)
        return {"losses": losses, "rewards": beta * means.detach(), "logps": means.detach()}
    log_odds = (means[:, 0] - means[:, 1]) - (log1mexp(means[:, 0]) - log1mexp(means[:, 1]))
    ratio = F.logsigmoid(log_odds)
    return {"losses": -beta * ratio, "rewards": beta * means.detach(), "logps": means.detach(),
            "log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}


class PreferenceObjective:
    """What the LM head needs to turn one micro-batch's hidden states into its preference loss, and what it leaves
    for the loop: `stats` (sums over the micro-batch's pairs of what TRL logs) and, for the reference pass
    (`spec` None), `sums` (P, 2), each sequence's log-prob.

    segments: (b, s/sp) this rank's shard of the batch's `segments` (shifted like the labels); scored, reference:
    (P, 2); pairs_total and chosen_tokens_total: the optimizer step's pairs and chosen completion tokens (the
    normalisers)."""

    def __init__(self, spec: Optional[PreferenceSpec], segments: torch.Tensor, scored: torch.Tensor,
                 reference: Optional[torch.Tensor] = None, pairs_total: float = 1.0,
                 chosen_tokens_total: float = 1.0, sp_group=None):
        self.spec, self.segments, self.sp_group = spec, segments, sp_group
        self.scored = scored.to(torch.float64)
        self.reference = None if reference is None else reference.to(segments.device, torch.float64)
        self.pairs, self.pairs_total, self.chosen_tokens_total = len(scored), pairs_total, chosen_tokens_total
        self.sp_size = dist.get_world_size(sp_group) if sp_group is not None else 1
        self.stats: dict = {}
        self.sums: Optional[torch.Tensor] = None
        self.token_sums: Optional[torch.Tensor] = None  # (P, 2, 3): mean logit, entropy, argmax hits, summed
        if spec is not None and spec.uses_reference and reference is None:
            raise ValueError("DPO needs the reference log-probs of the batch's pairs")

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Each sequence's sum over the SP group (every rank holds a shard of every row)."""
        if self.sp_size > 1:
            partial = partial.clone()
            dist.all_reduce(partial, group=self.sp_group)
        return partial

    def loss(self, sums: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the step's loss from the sequences' sums (P, 2) fp64; records `stats`."""
        terms = pair_terms(self.spec, sums, self.scored.to(sums.device), self.reference)
        loss = terms["losses"].sum() / self.pairs_total
        nll = None
        if self.spec.method == "orpo":  # TRL's ORPO adds the chosen side's NLL, a mean over its tokens
            nll = -sums[:, 0].sum() / self.chosen_tokens_total
            loss = loss + nll
        self.stats = pair_stats(terms, self.token_sums, nll)
        return loss

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, head) -> torch.Tensor:
        """The LM head's forward (levers/loss.py: LMHeadWithLoss) for preference training: this rank's value of the
        loss (loss / sp), or with no gradient (the reference pass) zero, leaving `sums`."""
        if head.bias is not None:
            raise NotImplementedError("an LM head with a bias is not supported by the loss head")
        hidden, labels, segments = hidden.flatten(0, -2), labels.flatten(), self.segments.flatten()
        rows = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        if bool((segments[rows] < 0).any()):
            raise RuntimeError("a scored token belongs to no sequence: the segments do not match the labels")
        if self.spec is None or not (torch.is_grad_enabled() and hidden.requires_grad):
            logps, _, extras = token_logps(hidden[rows], weight, labels[rows], head.chunk_size, head.softcap,
                                           with_stats=self.spec is not None)
            self.sums = self.reduce_sums(logps, extras, segments[rows])
            return hidden.new_zeros((), dtype=torch.float32) if self.spec is None else \
                (self.loss(self.sums) / self.sp_size).float()
        if head.fused:
            return _FusedPreference.apply(hidden, weight, labels, segments, rows, self, head.chunk_size,
                                          head.softcap)
        return self._plain(hidden, weight, labels, segments, rows, head.softcap)

    def partial_sums(self, logps: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """(P, 2, ...): this rank's tokens' log-probs (k,), or any per-token values (k, m), summed per sequence, in
        fp64."""
        partial = torch.zeros((2 * self.pairs,) + logps.shape[1:], dtype=torch.float64, device=logps.device)
        return partial.index_add(0, segments, logps.to(torch.float64)).view(self.pairs, 2, *logps.shape[1:])

    def reduce_sums(self, logps: torch.Tensor, extras: Optional[torch.Tensor], segments: torch.Tensor):
        """Each sequence's log-prob (P, 2) over the SP group, and where `extras` (k, 3) are given, their sums into
        `token_sums`: one all-reduce for both."""
        if extras is None:
            return self.reduce(self.partial_sums(logps, segments).detach())
        both = self.reduce(self.partial_sums(torch.cat([logps[:, None], extras.to(logps.dtype)], dim=1), segments))
        self.token_sums = both[..., 1:]
        return both[..., 0].contiguous()

    def _plain(self, hidden, weight, labels, segments, rows, softcap) -> torch.Tensor:
        """--loss plain: the scored rows' logits in full, autograd through everything. The SP sum's gradient is the
        identity to each rank's partial sum (every rank computes the same loss from the same sums)."""
        from .loss import cap_logits

        logits = cap_logits(_at_least_fp32(hidden[rows] @ weight.t()), softcap)
        log_softmax = torch.log_softmax(logits, dim=-1)
        logps = log_softmax.gather(1, labels[rows][:, None]).squeeze(1)
        partial = self.partial_sums(logps, segments[rows])
        with torch.no_grad():
            extras = token_stats(logits.detach(), torch.logsumexp(logits.detach(), dim=-1), labels[rows])
        sums = partial + (self.reduce_sums(logps.detach(), extras, segments[rows]) - partial.detach())
        loss = self.loss(sums)
        return (loss - loss.detach() * (1 - 1 / self.sp_size)).float()  # value loss / sp, gradient of the loss


def token_stats(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, consume: bool = False):
    """(c, 3) per token, what TRL's DPOTrainer logs of it: the mean logit over the vocabulary, the entropy of the
    next-token distribution, and 1 where the label is the argmax (the first one, as TRL's `is_top1`). `consume`:
    `logits` may be overwritten (one (c, V) buffer fewer)."""
    mean, top1 = logits.mean(dim=-1), (logits.argmax(dim=-1) == labels).to(logits.dtype)
    log_p = logits.sub_(lse[:, None]) if consume else logits - lse[:, None]
    entropy = -log_p.exp().mul_(log_p).sum(dim=-1)
    return torch.stack([mean, entropy, top1], dim=1)


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                softcap: Optional[float] = None, with_stats: bool = False):
    """hidden (k, H), weight (V, H), labels (k,) all scored -> log p(label) (k,), the log-sum-exp (k,) and, with
    `with_stats`, token_stats (k, 3) (else None), in at least fp32, the logits made `chunk_size` rows at a time."""
    logps = torch.empty(len(labels), dtype=torch.promote_types(weight.dtype, torch.float32), device=hidden.device)
    lse = torch.empty_like(logps)
    stats = logps.new_empty((len(labels), 3)) if with_stats else None
    with torch.no_grad():
        for start in range(0, len(labels), chunk_size):
            end = min(start + chunk_size, len(labels))
            logits = _logits(hidden[start:end], weight, softcap)[0]
            chunk_lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, labels[start:end, None]).squeeze(1)
            logps[start:end] = picked - chunk_lse
            lse[start:end] = chunk_lse
            if stats is not None:
                stats[start:end] = token_stats(logits, chunk_lse, labels[start:end], consume=True)
            del logits
    return logps, lse, stats


def _logits(h: torch.Tensor, weight: torch.Tensor, softcap: Optional[float]):
    """(c, V) logits in at least fp32 after the final softcap, and the tanh of the softcap (None without one)."""
    logits = _at_least_fp32(h @ weight.t())
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits / softcap)
    return torch.mul(tanh, softcap, out=logits), tanh


def logp_gradients(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_weights: torch.Tensor,
                   lse: torch.Tensor, chunk_size: int, softcap: Optional[float] = None):
    """The gradient of sum_t w_t log p(label_t) with respect to hidden (k, H) and weight (V, H), chunk by chunk:
    dL/dlogits = w (onehot - softmax), the softmax from the first pass's log-sum-exp; dW summed in fp32."""
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                              device=weight.device)
    with torch.no_grad():
        for start in range(0, len(labels), chunk_size):
            end = min(start + chunk_size, len(labels))
            h, w = hidden[start:end], token_weights[start:end]
            logits, tanh = _logits(h, weight, softcap)
            grad = logits.sub_(lse[start:end, None]).exp_().mul_(-w[:, None])  # in place: one (c, V) buffer
            grad[torch.arange(end - start, device=h.device), labels[start:end]] += w
            if tanh is not None:  # d(c tanh(z / c)) / dz
                grad *= tanh.square_().neg_().add_(1.0)
                del tanh
            grad = grad.to(hidden.dtype)
            grad_hidden[start:end] = grad @ weight
            if grad_weight.dtype == h.dtype:
                grad_weight.addmm_(grad.t(), h)
            else:
                grad_weight += grad.t() @ h
            del logits, grad
    return grad_hidden, grad_weight


class _FusedPreference(torch.autograd.Function):
    """The preference loss of this rank's shard (module docstring, steps 1-4), both gradients taken in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, segments, rows, objective, chunk_size, softcap):
        # hidden (n, H), weight (V, H), labels and segments (n,), rows: the scored positions (k,)
        h, y = hidden.index_select(0, rows), labels[rows]
        logps, lse, extras = token_logps(h, weight, y, chunk_size, softcap, with_stats=True)  # pass 1
        sums = objective.reduce_sums(logps, extras, segments[rows])
        with torch.enable_grad():
            sums = sums.detach().requires_grad_()
            loss = objective.loss(sums)
            (grad_sums,) = torch.autograd.grad(loss, sums)
        token_weights = grad_sums.flatten()[segments[rows]].to(lse.dtype)  # dL / dlogp_t
        grad_h, grad_weight = logp_gradients(h, weight, y, token_weights, lse, chunk_size, softcap)  # pass 2
        grad_hidden = torch.zeros_like(hidden).index_copy_(0, rows, grad_h)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return (loss.detach() / objective.sp_size).float()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None, None, None


class PreferenceLMWithSPLoss(CausalLMWithSPLoss):
    """CausalLMWithSPLoss whose forward, given an `objective` (PreferenceObjective), returns the preference loss of
    the micro-batch's pairs instead of the token mean; without one it is the SFT module. A MoE's router aux loss is
    added as for SFT, weighted by the micro-batch's share of the step's pairs (TRL adds it once per batch)."""

    def forward(self, input_ids, position_ids, labels, normalizer, objective: Optional[PreferenceObjective] = None):
        if objective is None:
            return super().forward(input_ids, position_ids, labels, normalizer)
        config = self.model.config
        balance = bool(getattr(config, "output_router_logits", False)) and objective.spec is not None
        out = backbone(self.model)(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                   **({"output_router_logits": True} if balance else {}))
        loss = self.model.get_output_embeddings()(out[0], labels=labels, objective=objective)
        if balance:
            aux = router_aux_share(out.router_logits, config.num_experts, config.num_experts_per_tok, self.sp_group)
            loss = loss + config.router_aux_loss_coef * (objective.pairs / objective.pairs_total) * aux
        return loss
