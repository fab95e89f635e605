"""LoRA and QLoRA adapters (PEFT) on the trainer's model, exact under ZeRO-3 and Ulysses SP.

`--use_peft` (TRL's flag names: `--lora_r`, `--lora_alpha`, `--lora_dropout`, `--lora_target_modules`,
`--lora_modules_to_save`, `--load_in_4bit`) injects PEFT's LoRA layers into the transformers model in place
(`peft.inject_adapter_in_model`), after the model is built (partitioned inside `zero.Init` under ZeRO-3) and before
the levers' surgery (model/surgery.py). What that gives:

- The base weights stay frozen and partitioned as ZeRO-3 made them; the adapters are created whole on every rank
  (the same seed draws the same A) and `deepspeed.initialize` turns them into ZeRO-3 parameters like the others.
  Only trainable parameters go to the optimizer, so only they have optimizer states and master weights.
- An adapter is a replicated parameter fed by this rank's shard of the sequence: its gradient is this rank's share,
  and is summed over the SP group by the same reduce-scatter and `sp_backward_scale` as every other parameter
  (levers/loss.py). Nothing about it is special, which is the point: a LoRA-B that stayed zero would mean the sum
  is missing (tests/distributed/test_lora.py fails then).
- The levers keep working because every patch calls the projections as modules (the fused SwiGLU calls
  `self.gate_proj(x)`, which is now PEFT's LoRA layer; the rotary and norm patches touch no linear layer). A LoRA'd
  LM head goes through the fused loss with its low-rank term (levers/loss.py: `lora_head_forward`). Only
  `nn.Linear` layers (with `--load_in_4bit`, bitsandbytes' 4-bit ones) and a MoE's fused experts (PEFT's
  `ParamWrapper`, which all-linear adds on transformers 5's experts) may take adapters: a module whose weight our
  code reads directly (the DeltaNet mixers' convolution) would silently skip its adapter, so it is refused.
- `--lora_modules_to_save` trains whole modules in place, with PEFT's matching (a module whose name ends with one
  of the names: `norm` takes every RMSNorm, LongLoRA's trainable norms). PEFT keeps a trainable copy beside a
  frozen original, which under ZeRO-3 would copy partitioned parameters; training the original in place computes
  the same thing (the original is only used with the adapter disabled). With tied embeddings, PEFT's
  `ensure_weight_tying` ties the copies, which is what training the one tied weight in place does.

Checkpoints hold the trainable parameters and their optimizer states (train/checkpoints/checkpoint.py); export writes a
PEFT adapter folder or a merged model (train/checkpoints/export_model.py); `--verify` compares against plain
transformers + PEFT on the same weights (train/verify/reference_model.py). The names below map our parameters to PEFT's.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError

ALL_LINEAR = "all-linear"
ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_MODULES = "adapter_modules.json"  # which modules are LoRA'd and trained whole, for export
EMBEDDINGS = ("embed_tokens", "lm_head")  # PEFT's EMBEDDING_LAYER_NAMES: tied copies are kept tied
REGEX_CHARACTERS = frozenset("*+?()[]{}|^$\\")  # a --lora_target_modules holding one is a regular expression


def _names(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(str(v).strip() for v in value if str(v).strip())
    return tuple(v.strip() for v in str(value).split(",") if v.strip())


def parse_target_modules(value) -> dict:
    """--lora_target_modules as AdapterSpec fields. PEFT takes target_modules as a list of names or as one string,
    a regular expression matched with re.fullmatch against each module's whole name; so does this flag: a value
    with a regular expression's special characters (`.*\\.(q|v)_proj`) is one expression (its commas included),
    any other is comma-separated names, or all-linear. An empty value is refused: it once meant all-linear."""
    text = str(value if value is not None else "").strip()
    if any(c in REGEX_CHARACTERS for c in text):
        try:
            re.compile(text)
        except re.error as e:
            raise ConfigError(f"--lora_target_modules {text}: not a valid regular expression ({e}); give one (matched "
                              f"against whole module names, as PEFT does), comma-separated module names, or "
                              f"all-linear") from None
        return {"target_modules": (), "target_regex": text}
    names = _names(text)
    if not names:
        raise ConfigError("--lora_target_modules is empty: give module names (comma-separated, e.g. q_proj,v_proj), "
                          "a regular expression over whole module names, or all-linear")
    return {"target_modules": names}


@dataclass(frozen=True)
class AdapterSpec:
    """The adapter flags, checked (see train/config/train_config.py for their help)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    modules_to_save: tuple[str, ...] = ()
    load_in_4bit: bool = False
    target_regex: Optional[str] = None  # instead of target_modules: PEFT's string form (parse_target_modules)

    @classmethod
    def from_config(cls, adapters) -> Optional["AdapterSpec"]:
        """The run's adapters (its adapters group: train/config/train_config.py AdapterConfig),
        or None without --use_peft."""
        if not adapters.use_peft:
            return None
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ConfigError("--use_peft needs PEFT: pip install peft (or pip install -e \".[lora]\")")
        return cls(r=adapters.lora_r, alpha=float(adapters.lora_alpha), dropout=float(adapters.lora_dropout),
                   modules_to_save=_names(adapters.lora_modules_to_save), load_in_4bit=bool(adapters.load_in_4bit),
                   **parse_target_modules(adapters.lora_target_modules))

    @property
    def all_linear(self) -> bool:
        return self.target_regex is None and self.target_modules == (ALL_LINEAR,)

    @property
    def targets(self) -> str:
        """--lora_target_modules as given (for messages)."""
        return self.target_regex or ",".join(self.target_modules)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def lora_config(self, tied: bool = False, with_modules_to_save: bool = True, base_model: Optional[str] = None):
        """PEFT's LoraConfig of these adapters. Training injects it without `modules_to_save` (they are trained in
        place: module docstring); the reference, export and the saved adapter_config.json carry them, tied like
        the model's embeddings."""
        from peft import LoraConfig

        save = list(self.modules_to_save) if with_modules_to_save and self.modules_to_save else None
        tie = bool(save) and tied and any(name.split(".")[-1] in EMBEDDINGS for name in save)
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_regex or (ALL_LINEAR if self.all_linear
                                                               else list(self.target_modules)),
                          modules_to_save=save, ensure_weight_tying=tie, bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=base_model)


# ---------------------------------------------------------------- QLoRA


def check_4bit(device: torch.device) -> None:
    """--load_in_4bit needs CUDA and bitsandbytes: a ConfigError naming the flag otherwise."""
    import importlib.util

    if device.type != "cuda":
        raise ConfigError(f"--load_in_4bit: bitsandbytes' 4-bit (NF4) weights run on CUDA, not on {device.type}; "
                          f"drop --load_in_4bit to train LoRA on the unquantized model")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("--load_in_4bit needs bitsandbytes (pip install bitsandbytes), or drop --load_in_4bit")


def quantization_config(dtype: torch.dtype):
    """QLoRA's NF4 weights as TRL asks for them, computing in the run's dtype; stored in that dtype so that ZeRO-3
    can partition them like any other parameter (PEFT's and transformers' recipe for sharded QLoRA)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                              bnb_4bit_quant_storage=dtype, bnb_4bit_use_double_quant=False)


# ---------------------------------------------------------------- matching, as PEFT matches


def _lora_target_matches(name: str, target: str) -> bool:
    """PEFT's rule for a listed target module: the module's whole name, or its last dotted components."""
    return name == target or name.endswith("." + target)


def _saved_module_matches(name: str, target: str) -> bool:
    """PEFT's rule for modules_to_save (`_set_trainable`): the module's name ends with the string."""
    return name.endswith(target)


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return type(module).__name__ == "Linear4bit"  # bitsandbytes' (--load_in_4bit), without importing it


def _is_expert_wrapper(module: nn.Module) -> bool:
    """PEFT's LoRA on a module's 3D parameters (`ParamWrapper`: what all-linear puts on transformers' fused MoE
    experts), which adds the low-rank term to the parameter inside the module's own forward."""
    return type(module).__name__ == "ParamWrapper"


def _linear_suffixes(model: nn.Module) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _is_linear(m)})


def _example_name(model: nn.Module) -> str:
    """A linear layer's whole name, to show what a regular expression is matched against."""
    return next((name for name, m in model.named_modules() if _is_linear(m) and ".layers." in f".{name}"), "lm_head")


def _tied_embeddings(model: nn.Module) -> dict[str, str]:
    """With tied embeddings, the input embedding's module name -> the LM head's, and back; else {}."""
    inputs, head = model.get_input_embeddings(), model.get_output_embeddings()
    if (not getattr(model.config, "tie_word_embeddings", False) or inputs is None or head is None
            or getattr(inputs, "weight", None) is not getattr(head, "weight", None)):
        return {}
    names = {id(m): name for name, m in model.named_modules()}
    return {names[id(inputs)]: names[id(head)], names[id(head)]: names[id(inputs)]}


def saved_module_names(model: nn.Module, spec: AdapterSpec) -> list[str]:
    """The modules --lora_modules_to_save trains whole (PEFT's matching); each name must match one. With tied
    embeddings the LM head and the input embedding are one weight: training either trains both, and PEFT
    (`ensure_weight_tying`) trains both copies as one tensor. Both are named, so that the weight, which our model
    calls by the embedding's name, finds its PEFT name (--verify's reference, export) whichever was listed."""
    names = [name for name, _ in model.named_modules(remove_duplicate=False) if name]
    found = []
    for target in spec.modules_to_save:
        matched = [n for n in names if _saved_module_matches(n, target)]
        if not matched:
            raise ConfigError(f"--lora_modules_to_save {target}: no module of this {type(model).__name__} has a "
                              f"name ending with it (e.g. embed_tokens, lm_head, norm)")
        found += [n for n in matched if n not in found]
    tied = _tied_embeddings(model)
    return found + [tied[n] for n in found if n in tied and tied[n] not in found]


def _check_targets(model: nn.Module, spec: AdapterSpec) -> None:
    """Every listed target module (or the regular expression) matches some module, before PEFT (which only
    complains when none does)."""
    if spec.all_linear:
        return
    names = [name for name, _ in model.named_modules() if name]
    if spec.target_regex is not None:
        if not any(re.fullmatch(spec.target_regex, n) for n in names):
            raise ConfigError(f"--lora_target_modules {spec.target_regex}: a regular expression, matched as PEFT "
                              f"matches one against each module's whole name (e.g. {_example_name(model)}), and no "
                              f"module of this {type(model).__name__} matches it; or give names: "
                              f"{', '.join(_linear_suffixes(model))} (or all-linear)")
        return
    for target in spec.target_modules:
        if target == ALL_LINEAR:
            raise ConfigError("--lora_target_modules all-linear stands alone (every linear layer of the decoder); "
                              "or list module names")
        if not any(_lora_target_matches(n, target) for n in names):
            raise ConfigError(f"--lora_target_modules {target}: no module of this {type(model).__name__} is named "
                              f"so; its linear layers: {', '.join(_linear_suffixes(model))} (or all-linear)")


# ---------------------------------------------------------------- injection


@dataclass
class Adapters:
    """The adapters a run trains: the spec, the LoRA'd modules, the modules trained whole, and the counts."""

    spec: AdapterSpec
    lora_modules: list[str] = field(default_factory=list)
    saved_modules: list[str] = field(default_factory=list)
    trainable: int = 0  # parameters (elements), the tied counted once
    total: int = 0
    tied: bool = False

    def describe(self) -> str:
        return (f"LoRA r {self.spec.r} alpha {self.spec.alpha:g} dropout {self.spec.dropout:g} on "
                f"{len(self.lora_modules)} modules" + (f", {len(self.saved_modules)} trained whole" if
                                                       self.saved_modules else "")
                + (", 4-bit base" if self.spec.load_in_4bit else "")
                + f": {self.trainable / 1e6:.2f}M of {self.total / 1e6:.1f}M parameters trained")

    def lora_config(self, base_model: Optional[str] = None):
        return self.spec.lora_config(self.tied, True, base_model)


def _numel(p: torch.Tensor) -> int:
    return getattr(p, "ds_numel", p.numel())


def add_adapters(model: nn.Module, spec: AdapterSpec, input_grads: bool = True) -> Adapters:
    """Injects the LoRA layers into `model` in place, freezes everything else but --lora_modules_to_save, and (with
    `input_grads`, for gradient checkpointing) makes the input embeddings' output require grad as PEFT's
    `enable_input_require_grads` does, so that a checkpointed layer's input carries a gradient even when every
    weight before it is frozen. Errors a user can cause name the flag."""
    from peft import inject_adapter_in_model

    _check_targets(model, spec)
    saved = saved_module_names(model, spec)
    config = spec.lora_config(with_modules_to_save=False)
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as e:  # PEFT: no module matched, or a module type LoRA has no layer for
        raise ConfigError(f"--lora_target_modules {spec.targets}: {_peft_refusal(e)}") from None
    from peft.tuners.lora import LoraLayer

    lora = [name for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    for name in lora:
        base = model.get_submodule(name).get_base_layer()
        if not _is_linear(base) and not _is_expert_wrapper(model.get_submodule(name)):
            raise ConfigError(f"--lora_target_modules: {name} is a {type(base).__name__}; adapters go on linear "
                              f"layers (and a MoE's experts) only: the trainer reads some other modules' weights "
                              f"directly, which would skip an adapter")
        clash = [s for s in saved if name == s or name.startswith(s + ".")]
        if clash:
            raise ConfigError(f"{name} is both LoRA'd (--lora_target_modules) and trained whole "
                              f"(--lora_modules_to_save {clash[0]}): take it out of one of them")
    _check_rank(model, lora, spec.r)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    if tied and isinstance(head, LoraLayer):
        raise ConfigError("--lora_target_modules lm_head: this model ties its LM head to the input embedding, which "
                          "LoRA's low-rank term would untie; train it whole with --lora_modules_to_save lm_head")
    for name in saved:
        model.get_submodule(name).requires_grad_(True)
    if input_grads and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    params = {id(p): p for p in model.parameters()}.values()
    return Adapters(spec, lora, saved, sum(_numel(p) for p in params if p.requires_grad),
                    sum(_numel(p) for p in params), tied)


def _peft_refusal(error: ValueError) -> str:
    """PEFT's refusal, said without the refused module's whole printed tree (`.*` matches the model itself)."""
    text = str(error).strip()
    refused = re.match(r"Target module (\w+)\(", text)
    if refused is None:
        return text
    return (f"it matches a {refused.group(1)}, which takes no adapter: adapters go on linear layers (and a MoE's "
            f"experts); name or match only those")


def _rank_bound(module: nn.Module) -> Optional[int]:
    """The highest rank an update of this LoRA'd layer can have: min(in, out) of its weight (one expert's, for a
    MoE's experts). None for a MoE router (PEFT's ParamWrapper on a 2D weight, which all-linear adapts on
    transformers 5): its width is the number of experts (8 for Mixtral), below the default r, as PEFT trains it."""
    if _is_expert_wrapper(module):
        weight = getattr(module.get_base_layer(), module.parameter_name)
        if len(getattr(weight, "ds_shape", weight.shape)) < 3:
            return None
    return min(module.in_features, module.out_features)


def _check_rank(model: nn.Module, lora: list[str], r: int) -> None:
    """--lora_r at most every LoRA'd layer's rank bound: above it the update's rank cannot grow, and the extra ranks
    only add parameters (r 100000 on a hidden size of 128 trained 486M of them)."""
    bounds = {name: _rank_bound(model.get_submodule(name)) for name in lora}
    bounds = {name: bound for name, bound in bounds.items() if bound is not None}
    over = [name for name, bound in bounds.items() if r > bound]
    if not over:
        return
    layer = model.get_submodule(over[0])
    others = f", and of {len(over) - 1} more LoRA'd layers" if len(over) > 1 else ""
    raise ConfigError(f"--lora_r {r} is above the rank of {over[0]} ({layer.in_features} inputs, {layer.out_features} "
                      f"outputs: its update has rank {bounds[over[0]]} at most){others}; the extra ranks would only "
                      f"add parameters: give --lora_r {min(bounds.values())} or less, or leave those layers out of "
                      f"--lora_target_modules")


def randomize_lora_b(model: nn.Module, seed: int, std: float = 0.01) -> int:
    """Draws every LoRA-B (zero at initialisation) from N(0, std^2), the same on every rank, so that a check of one
    step sees non-zero gradients of A (d A = B^T (...)). Collective under ZeRO-3: rank 0's values go to every
    partition. Returns how many matrices were drawn."""
    import deepspeed
    from peft.tuners.lora import LoraLayer

    g = torch.Generator().manual_seed(seed)
    drawn = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for b in module.lora_B.values():
            with deepspeed.zero.GatheredParameters([b.weight], modifier_rank=0):
                values = torch.randn(b.weight.shape, generator=g) * std
                with torch.no_grad():
                    b.weight.copy_(values.to(b.weight.dtype))
            drawn += 1
    return drawn


# ---------------------------------------------------------------- what the planner and the time model count


def adapter_geometry(model_config, spec: AdapterSpec) -> dict:
    """The sizes LoRA changes, counted on the model built on the meta device with the adapters injected (no memory,
    the exact modules PEFT takes): trainable parameters (adapters and modules trained whole), the adapters' own,
    per decoder layer the LoRA'd linears' input and output widths (what a token reads and writes through them) and
    the base matmul weights that stay frozen, the MoE expert weights PEFT adds a low-rank product to, whether the LM
    head is trained (its gradient costs the fused loss a
    vocab x hidden fp32 buffer and a third of its FLOPs), and how many weights --load_in_4bit stores in NF4 (every
    linear layer of the decoder: bitsandbytes skips the LM head)."""
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    from .build import without_zero3

    with without_zero3(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
        adapters = add_adapters(model, spec, input_grads=False)
    head = model.get_output_embeddings()
    layers = max(1, model_config.num_hidden_layers)
    lora_in = lora_out = lora = head_lora = expert_weights = 0
    for m in model.modules():
        if not isinstance(m, LoraLayer):
            continue
        size = sum(p.numel() for d in (m.lora_A, m.lora_B) for p in d.parameters())  # its own, not a nested one's
        if m is head:
            head_lora += size
        elif _is_expert_wrapper(m):  # the low-rank product is added to the whole parameter, every forward
            lora += size
            expert_weights += getattr(m.get_base_layer(), m.parameter_name).numel()
        else:
            lora += size
            lora_in, lora_out = lora_in + m.in_features, lora_out + m.out_features
    # the decoder's base linear layers (LoRA'd or not; not the adapters' own, nor the head)
    weights = {id(m.weight): m.weight for name, m in model.named_modules()
               if _is_linear(m) and ".layers." in f".{name}." and ".lora_" not in f".{name}"}
    frozen_matmul = sum(w.numel() for w in weights.values() if not w.requires_grad)
    head_weight = head.get_base_layer().weight if isinstance(head, LoraLayer) else head.weight
    return {"trainable": adapters.trainable, "lora": lora + head_lora, "head_lora": head_lora,
            "lora_in": lora_in / layers, "lora_out": lora_out / layers, "expert_weights": expert_weights / layers,
            "frozen_matmul": frozen_matmul / layers, "matmul": sum(w.numel() for w in weights.values()) / layers,
            "head_trainable": bool(head_weight.requires_grad),
            "quantized": sum(w.numel() for w in weights.values()) if spec.load_in_4bit else 0,
            "rank": spec.r}


# ---------------------------------------------------------------- our names <-> PEFT's


def peft_name(name: str, saved_modules: list[str]) -> str:
    """A parameter's name in a PeftModel (get_peft_model with modules_to_save) from its name in our model (the
    transformers model with LoRA injected and the saved modules trained in place)."""
    module, _, leaf = name.rpartition(".")
    if module in saved_modules:
        module = f"{module}.modules_to_save.{ADAPTER_NAME}"
    return f"base_model.model.{module}.{leaf}" if module else f"base_model.model.{leaf}"


def base_name(name: str) -> Optional[str]:
    """The plain transformers name of a base weight of our model (None for an adapter's)."""
    if ".lora_" in name:
        return None
    while ".base_layer." in name:  # nested for a module with several adapted parameters (PEFT's ParamWrapper)
        name = name.replace(".base_layer.", ".")
    return name


def save_adapter_config(adapters: Adapters, folder: str, base_model: Optional[str]) -> None:
    """adapter_config.json (PEFT's own) and the module lists, beside the checkpoint's config.json."""
    adapters.lora_config(base_model).save_pretrained(folder)
    with open(os.path.join(folder, ADAPTER_MODULES), "w") as f:
        json.dump({"lora": adapters.lora_modules, "saved": adapters.saved_modules, "tied": adapters.tied}, f,
                  indent=1)
