"""`--verify` for preference training: the run's loss and every gradient against plain transformers on whole pairs.

The reference takes each pair as TRL's DPOTrainer does: prompt + chosen and prompt + rejected as two whole
sequences through plain transformers (no packing, no SP, none of our levers; train/verify/reference_model.py builds the
model on the engine's weights), each side's log-prob the sum over its scored tokens of log_softmax(logits) (in fp64 for
the fp32 truth), and the loss of TRL's formulas (levers/preference_loss.py: `pair_terms`; tests/unit/test_preference.py
checks them against TRL's trainers on the same batch) with the step's normalisers. For DPO the reference log-probs
are the run's own cached ones (train/preference/reference_logps.py), so the check covers the policy's pass; where the
weights checked are the reference's (a run that resumes nothing), those cached log-probs are compared too, with plain
transformers' log-probs of the same sides on the same weights, and with --ref_model, always, with plain transformers' on
that model (built beside the policy's reference on rank 0's device).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...levers.preference_loss import PreferenceObjective, PreferenceSpec
from ..preference.pairs import unpack_pairs
from .limits import BF16_FLOOR, FP32_LIMIT
from .reference_model import reference_buffers, reference_grads, reference_model


def side_logp(model, ids: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum of log p(token) over the tokens `mask` marks (1) of one whole sequence `ids` (n,)."""
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
    logps = torch.log_softmax(logits.to(dtype), dim=-1).gather(1, ids[1:, None]).squeeze(1)
    return (logps * mask[1:].to(dtype)).sum()


def pair_logps(model, pairs: list, dtype: torch.dtype) -> torch.Tensor:
    """(pairs, 2) float64: each pair's chosen and rejected log-probs under `model` (unpack_pairs' pairs)."""
    device = next(model.parameters()).device
    return torch.stack([torch.stack([side_logp(model, p[f"prompt_{s}"].to(device), p[f"{s}_mask"].to(device), dtype)
                                     for s in ("chosen", "rejected")]) for p in pairs]).to(torch.float64)


class PreferenceReference:
    """verify.reference_step's counterpart for pairs: called as (model_config, weights, batches, dtype, device,
    adapters, base_model, is_truth) -> (loss, grads, buffers); `check()` then judges the cached reference log-probs."""

    def __init__(self, spec: PreferenceSpec, weights_are_reference: bool, ref_model: Optional[str] = None):
        self.spec, self.weights_are_reference, self.ref_model = spec, weights_are_reference, ref_model
        self.errors: dict = {}  # dtype name -> relative error of our cached reference log-probs

    def __call__(self, model_config, weights: dict, batches: list[dict], dtype: torch.dtype,
                 device: torch.device, adapters=None, base_model: Optional[str] = None,
                 is_truth: bool = False) -> tuple[float, dict, dict]:
        model, names = reference_model(model_config, weights, dtype, device, adapters, base_model, is_truth)
        logp_dtype = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
        frozen = self._ref_model(model_config, dtype, device, is_truth) if self.ref_model else model
        pairs = [unpack_pairs(b) for b in batches]
        pairs_total = float(sum(len(p) for p in pairs))
        chosen_total = max(1.0, float(sum(int(b["scored"][:, 0].sum()) for b in batches)))
        total, ours, theirs = 0.0, [], []
        for batch, batch_pairs in zip(batches, pairs):
            sums = pair_logps(model, batch_pairs, logp_dtype)
            objective = PreferenceObjective(self.spec, torch.empty(0, dtype=torch.long), batch["scored"],
                                            batch.get("reference"), pairs_total, chosen_total)
            loss = objective.loss(sums)
            loss.backward()
            total += loss.item()
            if batch.get("reference") is not None:
                ours.append(batch["reference"])
                if frozen is not model:
                    with torch.no_grad():
                        theirs.append(pair_logps(frozen, batch_pairs, logp_dtype).cpu())
                else:
                    theirs.append(sums.detach().cpu())
        if ours and (self.weights_are_reference or frozen is not model):
            ours, theirs = torch.cat(ours), torch.cat(theirs)
            self.errors[str(dtype).removeprefix("torch.")] = float((ours - theirs).abs().max() / theirs.abs().max())
        grads, buffers = reference_grads(model, names), reference_buffers(model, names)
        del model, frozen
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return total, grads, buffers

    def _ref_model(self, model_config, dtype: torch.dtype, device: torch.device, is_truth: bool):
        """--ref_model as plain transformers, built as the policy's reference is (its forward's config: the run's)."""
        from ..preference.reference_logps import pretrained_weights

        weights = pretrained_weights(self.ref_model, dtype)
        return reference_model(model_config, weights, dtype, device, is_truth=is_truth)[0].eval()

    def check(self, truth: torch.dtype, run_dtype: torch.dtype) -> tuple[dict, list[str]]:
        """The result's `reference_logps` entry and the failures: our cached reference log-probs against plain
        transformers' in the truth's dtype, within FP32_LIMIT for an fp32 run, for a bf16 one within twice
        transformers' own bf16 error (never below BF16_FLOOR)."""
        name = str(truth).removeprefix("torch.")
        if not self.spec.uses_reference:
            return {}, []
        if name not in self.errors:
            return {"reference_logps": {"compared": False}}, []
        err = self.errors[name]
        theirs = self.errors.get(str(run_dtype).removeprefix("torch.")) if run_dtype != truth else None
        limit = FP32_LIMIT if theirs is None else 2 * max(theirs, BF16_FLOOR)
        entry = {"compared": True, "ours": err, "transformers": theirs, "limit": limit,
                 "weights": f"--ref_model {self.ref_model}" if self.ref_model else "the same weights"}
        return {"reference_logps": entry}, ([] if err <= limit else ["reference log-probs"])


def format_reference_line(entry: dict) -> str:
    if not entry.get("compared"):
        return "  reference log-probs: not compared (the weights checked are not the reference's: a resumed step)"
    theirs = "" if entry["transformers"] is None else f", transformers' own {entry['transformers']:.2e}"
    verdict = "ok" if entry["ours"] <= entry["limit"] else "FAIL"
    return (f"  reference log-probs (cached, computed under SP) against plain transformers on "
            f"{entry.get('weights', 'the same weights')}: "
            f"{entry['ours']:.2e}{theirs}, limit {entry['limit']:.2e}  {verdict}")
