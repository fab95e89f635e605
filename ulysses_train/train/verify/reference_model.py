"""The reference of `--verify`: plain transformers (`AutoModelForCausalLM`, SDPA attention, none of our levers) on
the engine's weights and the step's tokens, one process; with `--use_peft` wrapped by PEFT with the same adapters.
Its loss is the mean over every trainable token of the step, and its gradients are fp32 on the CPU under our names.

Where plain transformers on a packed row would let documents see each other (the torch DeltaNet rule ignores the
documents; GPT-OSS's mask ignores the restarting positions), each document runs alone (`forward_by_document`).
train/verify/verify.py compares our step with it; train/verify/pairs.py builds its pairs' reference on the same model.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch

from ...data.sources import trainable_tokens
from ...model.build import without_zero3
from ...model.matching import rebind_global
from ...sp.deltanet import is_deltanet
from ...sp.linear_kernel import fla_problem
from ...sp.sharding import IGNORE_INDEX, shift_labels

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


def supports_sdpa(model_config) -> bool:
    """Whether transformers runs this family with SDPA (the families whose attention SDPA cannot express do not)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)], "_supports_sdpa", True)


def reference_model(model_config, weights: dict, dtype: torch.dtype, device: torch.device, adapters=None,
                    base_model: Optional[str] = None, is_truth: bool = False):
    """Plain transformers on `weights`, in `dtype` on `device`, in training mode with gradient checkpointing (it
    bounds the memory; it recomputes the same ops). Returns the model and {our name: its name} of the parameters
    whose gradients are compared (None: every parameter, under its own name). With `adapters` (model/adapters.py:
    --use_peft) the model is PEFT's (`get_peft_model`, the same LoraConfig and modules_to_save) with our adapters'
    weights, and the names are those of the trainable parameters; with --load_in_4bit the base is quantized from
    `base_model` as ours was (the same weights give the same NF4 blocks), and the weights that are not 4-bit are
    copied. `is_truth`: the reference errors are measured against (its DeltaNet layers run the exact torch rule)."""
    from transformers import AutoModelForCausalLM

    # the weights are overwritten next: skip their random initialisation (19 s on the CPU for Qwen3-4B's embedding
    # alone); the buffers are computed in __init__ exactly as with it
    attention = "sdpa"
    if not supports_sdpa(model_config):  # GPT-OSS's sinks, Gemma 2's softcap: transformers' own is eager
        attention = "eager"
    elif dtype in (torch.float32, torch.float64):
        _register_reference_attention()
        attention = REFERENCE_FP32_ATTENTION
    # fp64: transformers' grouped-matmul experts take no fp64, its eager loop does (the same sums)
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    quantized = adapters is not None and adapters.spec.load_in_4bit
    with without_zero3(), _no_init_weights():
        if quantized:
            from ...model.adapters import quantization_config

            model = AutoModelForCausalLM.from_pretrained(base_model, config=copy.deepcopy(model_config), dtype=dtype,
                                                         attn_implementation=attention,
                                                         quantization_config=quantization_config(dtype),
                                                         device_map={"": device})
        else:
            model = AutoModelForCausalLM.from_config(copy.deepcopy(model_config), dtype=dtype,
                                                     attn_implementation=attention, **experts)
    model.tie_weights()  # part of the initialisation skipped above
    base = weights if adapters is None else _base_weights(weights)
    params = dict(model.named_parameters())  # tied weights once
    missing, unexpected = sorted(set(params) - set(base)), sorted(set(base) - set(params))
    if missing or unexpected:
        raise RuntimeError(f"--verify: the engine's weights do not fit a plain {type(model).__name__}: missing "
                           f"{missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, param in params.items():  # one tensor at a time: no second copy of the model in host memory
            if not (quantized and type(param).__name__ == "Params4bit"):
                param.copy_(base[name])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # only a model with DeltaNet layers asks about FLA: importing it (and tilelang) takes seconds
    if any(is_deltanet(m) for m in model.modules()) and (is_truth or fla_problem(device) is not None):
        use_torch_delta_rule(model)
    names = None
    if adapters is not None:
        model, names = _with_peft(model, adapters, weights)
    model.to(device).train()
    return model, names


_TORCH_RULE_CLASSES: dict[type, type] = {}


def use_torch_delta_rule(model) -> int:
    """Every Gated DeltaNet mixer of `model` computes its delta rule with its modeling file's own torch function.

    Where: the truth (the fp32 or fp64 reference errors are measured against), and any reference where FLA cannot
    run. Why: transformers binds FLA's kernel in its place at import wherever `fla` imports. FLA's Triton kernels
    take TF32 dots on fp32 inputs (its triangular solve among them), which round each operand to 10 bits of
    mantissa (5e-4 relative): through FLA the truth would not be fp32, and would cost FLA's compilation and
    autotuning in fp32 on the first use; and where FLA cannot run (on Hopper with Triton before 3.7.1 and no
    tilelang its backward raises) the trainer falls back to the same torch function (sp/linear_kernel.py). The
    reference in the run's dtype keeps FLA's kernel where it runs: plain transformers as a user has it. The
    mixer's class gets a copy of its forward reading the torch function (the module file stays as it is)."""
    import inspect
    import sys

    patched = 0
    for module in model.modules():
        if not is_deltanet(module) or type(module) in _TORCH_RULE_CLASSES.values():
            continue
        cls = type(module)
        if cls not in _TORCH_RULE_CLASSES:
            name = "torch_chunk_gated_delta_rule"
            rule = inspect.unwrap(getattr(sys.modules[cls.__module__], name))
            forward = rebind_global(cls.forward, name, rule)
            if forward is None:
                raise RuntimeError(f"--verify: the forward of {cls.__name__} cannot be given transformers' torch "
                                   f"delta rule (train/verify/reference_model.py)")
            _TORCH_RULE_CLASSES[cls] = type(f"TorchRule{cls.__name__}", (cls,),
                                            {"__module__": cls.__module__, "forward": forward})
        module.__class__ = _TORCH_RULE_CLASSES[cls]
        if callable(getattr(module, "chunk_gated_delta_rule", None)):  # releases that bind it per module
            module.chunk_gated_delta_rule = inspect.unwrap(getattr(sys.modules[cls.__module__],
                                                                   "torch_chunk_gated_delta_rule"))
        patched += 1
    return patched


def host_grad(grad: torch.Tensor) -> torch.Tensor:
    """A gradient on the host for the comparisons, in its own dtype (they widen one tensor at a time): a bf16 run's
    gradients as fp32 would double the host memory of the two gradient sets in bf16 (8B parameters: 32 GB more).
    fp64 (an fp32 run's truth for DeltaNet layers) comes as fp32, which the fp32 limit of 1e-4 does not feel."""
    dtype = torch.float32 if grad.dtype == torch.float64 else grad.dtype
    return grad.detach().to("cpu", dtype, copy=True)  # a copy on the CPU too: the engine may reuse its buffer


def reference_grads(model, names: Optional[dict]) -> dict:
    """The reference's gradients (host_grad) under our names (reference_model's `names`; None: every parameter)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    names = names or {n: n for n in dict(model.named_parameters())}
    return {ours: (host_grad(named[theirs].grad) if named[theirs].grad is not None
                   else torch.zeros(named[theirs].shape)) for ours, theirs in names.items()}


def reference_buffers(model, names: Optional[dict]) -> dict:
    """Plain transformers' buffers under its own names (those of the model PEFT wraps, when it does)."""
    plain = model.get_base_model() if names is not None else model
    return {n: b.detach().cpu() for n, b in plain.named_buffers()}


def reference_step(model_config, weights: dict, batches: list[dict], dtype: torch.dtype, device: torch.device,
                   adapters=None, base_model: Optional[str] = None, is_truth: bool = False) -> tuple[float, dict, dict]:
    """Plain transformers on `weights` (reference_model, with `adapters` PEFT's): the mean over every trainable
    token of `batches`, the gradient of that mean (host_grad) and the model's own buffers."""
    model, names = reference_model(model_config, weights, dtype, device, adapters, base_model, is_truth)
    total, counts = 0.0, [trainable_tokens(b) for b in batches]
    for batch, count in zip(batches, counts):  # the mean over every trainable token of the step, as ours
        if count == 0:  # no target: nothing to add (transformers' mean over no token would be NaN)
            continue
        inputs = {"input_ids": batch["input_ids"].to(device), "position_ids": batch["position_ids"].to(device),
                  "use_cache": False}
        docs = batch.get("docs") if documents_apart(model_config) else None
        logits, aux = forward_by_document(model, inputs, docs) if docs else _forward(model, inputs)
        if dtype == torch.float32:  # the model's own logits, the cross-entropy in fp64: see fp64_cross_entropy_sum
            share = fp64_cross_entropy_sum(logits, shift_labels(batch["labels"]).to(device)) / max(1, sum(counts))
        else:  # transformers' own loss function: this batch's mean
            share = model.loss_function(logits, batch["labels"].to(device), model_config.vocab_size)
            share = share * (count / max(1, sum(counts)))
        if aux is not None:  # a MoE's load-balancing loss, as transformers adds it
            share = share + model_config.router_aux_loss_coef * aux * (count / max(1, sum(counts)))
        share.backward()
        total += share.item()
    grads, buffers = reference_grads(model, names), reference_buffers(model, names)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return total, grads, buffers


def documents_apart(model_config) -> bool:
    """Whether plain transformers on a packed row would let documents see each other, so that its packed reference
    runs each document alone: layers that are not attention (its torch DeltaNet ignores the documents) or a family
    whose packed mask ignores the restarting positions (support.py: PACKED_ROW_MIXES_DOCUMENTS)."""
    from ...sp.support import PACKED_ROW_MIXES_DOCUMENTS, layer_mixers

    return (model_config.model_type in PACKED_ROW_MIXES_DOCUMENTS
            or any(not m.attention for m in layer_mixers(model_config)))


def _forward(model, inputs: dict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    out = model(**inputs)
    return out.logits, getattr(out, "aux_loss", None)


def forward_by_document(model, inputs: dict, docs: list[list[int]]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The logits (b, s, V) of every document of every row run alone, side by side as in the packed row, and the
    MoE load-balancing loss of all of them together (the router statistics of the whole batch, as transformers
    takes them over a row). Each document's positions restart, as the packed row's do."""
    import sys

    rows, routers = [], []
    balanced = getattr(model.config, "output_router_logits", False)
    for r, lengths in enumerate(docs):
        pieces, start = [], 0
        for n in (n for n in lengths if n):
            out = model(input_ids=inputs["input_ids"][r:r + 1, start:start + n],
                        position_ids=inputs["position_ids"][r:r + 1, start:start + n], use_cache=False)
            pieces.append(out.logits)
            if balanced:
                routers.append(out.router_logits)
            start += n
        rows.append(torch.cat(pieces, dim=1))
    aux = None
    if routers:  # per layer, the tokens of every document
        layers = tuple(torch.cat([doc[i] for doc in routers], dim=0) for i in range(len(routers[0])))
        balance = sys.modules[type(model).__module__].load_balancing_loss_func
        aux = balance(layers, model.num_experts, model.num_experts_per_tok, None)
    return torch.cat(rows, dim=0), aux


def _base_weights(weights: dict) -> dict:
    """The transformers names and values of the base model's weights among ours (adapters left out)."""
    from ...model.adapters import base_name

    return {base_name(n): w for n, w in weights.items() if base_name(n) is not None}


def _with_peft(model, adapters, weights: dict):
    """`model` wrapped by PEFT with our adapters' config, our adapters' (and trained modules') weights copied in;
    returns it and {our name: its name} of every trainable parameter."""
    from peft import get_peft_model

    from ...model.adapters import peft_name

    peft = get_peft_model(model, adapters.lora_config(), autocast_adapter_dtype=False)
    theirs = dict(peft.named_parameters(remove_duplicate=False))
    trained = {n for n, p in theirs.items() if p.requires_grad}
    names = {}
    with torch.no_grad():
        for name, value in weights.items():
            target = peft_name(name, adapters.saved_modules)
            if ".lora_" in name or target in theirs and target in trained:
                theirs[target].copy_(value)
                names[name] = target
    missed = trained - {theirs_name for theirs_name in names.values()} - _tied_aliases(theirs, names)
    if missed:
        raise RuntimeError(f"--verify: PEFT trains parameters ours does not: {sorted(missed)}")
    return peft, names


def _tied_aliases(params: dict, names: dict) -> set:
    """Names of parameters that are the same tensor as one already mapped (tied embeddings' copies)."""
    mapped = {id(params[t]) for t in names.values()}
    return {n for n, p in params.items() if id(p) in mapped}


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
