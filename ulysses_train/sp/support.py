"""Which model families and layers the trainer runs exactly, decided from the model's config before anything is built.

Ulysses gives each rank the whole sequence for a subset of heads, so whatever a layer does per head along the sequence
(a sliding window, a sink logit, a logit softcap, chunked attention) is the kernel's business on the gathered
sequence, and is exact. The danger is a layer that never passes through the attention interface (a Gated DeltaNet
or Mamba mixer): it would run on its rank's shard as if the sequence started there, with a normal-looking loss and
wrong gradients. So nothing is assumed: a family the trainer has not checked, a layer type it does not know, or a
feature it has not built for this run's SP, ring and kernel is a ConfigError naming what would work. The Gated DeltaNet
layers of the families whose record lists them in `sharded_mixers` run exactly under Ulysses (deltanet.py: the same
head all-to-all, the conv and the recurrence over the whole sequence for each rank's heads, both restarting at
packed documents); not yet with a ring.

What a family holds beyond its config (sinks, a softcap its attention applies, which mixers are sharded, whether it
runs under a ring) is its record's (ulysses_train/families/); everything else is read from the config.

`layer_mixers(config)` reads one `LayerMixer` per decoder layer from the config (its `layer_types`, `sliding_window`,
`attention_chunk_size`, `no_rope_layers`, softcaps, sinks, per-layer heads); `check_support` applies this run's
sizes and kernel to them. `resolve_layout` (layout.py) calls `check_support` for the trainer, `--verify`, `plan`,
the preview and `eval_positions`; the attention function (attention.py) reads the same table at run time and refuses
any argument it was not told about.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from ..families import FAMILIES, FamilyRecord, families_with
from . import dims


def supported_models_table() -> str:
    """The table of supported models in docs/models.md, made from the family records (tests/unit/test_support.py keeps
    the
    page equal)."""
    rows = ["| family | `model_type` | layers | exact under SP | ring (`--ring_size`) | packing | kernels |",
            "|---|---|---|---|---|---|---|"]
    for model_type, f in FAMILIES.items():
        rows.append(f"| {f.name} | `{model_type}` | {f.features} | {'yes' if f.sequence_parallel else 'SP=1 only'} "
                    f"| {'yes' if f.ring and f.sequence_parallel else 'refused'} | {'yes' if f.packing else 'refused'} "
                    f"| {f.kernels} |")
    return "\n".join(rows)


# layer types whose token mixer is not attention, with what they are (the refusal names them)
LINEAR_MIXERS = {"linear_attention": "Gated DeltaNet"}
# the families whose packed reference runs each document alone (train/verify/reference_model.py: documents_apart)
PACKED_ROW_MIXES_DOCUMENTS = frozenset(families_with("packed_row_mixes_documents"))


@dataclass(frozen=True)
class LayerMixer:
    """One decoder layer's token mixer, as the config describes it."""

    kind: str  # "attention", or the config's layer type for anything else ("linear_attention", ...)
    q_heads: int = 0
    kv_heads: int = 0
    window: Optional[int] = None  # keys a query sees, itself included (transformers' `sliding_window`)
    chunk: Optional[int] = None  # block-diagonal causal attention in blocks of this many positions
    sinks: bool = False  # a learned per-head logit in every row's softmax denominator (GPT-OSS's `sinks`)
    softcap: Optional[float] = None  # scores -> softcap * tanh(scores / softcap) before the softmax
    rope: bool = True  # False: a NoPE layer
    temperature_tuning: bool = False  # Llama 4's NoPE layers scale q by a function of the position

    @property
    def attention(self) -> bool:
        return self.kind == "attention"

    def describe(self) -> str:
        if not self.attention:
            return f"{self.kind} ({LINEAR_MIXERS.get(self.kind, 'not attention')})"
        parts = [f"window {self.window}" if self.window else "", f"chunks of {self.chunk}" if self.chunk else "",
                 "sinks" if self.sinks else "", f"softcap {self.softcap:g}" if self.softcap else "",
                 "" if self.rope else "NoPE"]
        return "attention" + "".join(f", {p}" for p in parts if p)


def family_of(config) -> FamilyRecord:
    """The family of `config`, or a ConfigError (one line) saying what kind of model it is and that the trainer
    will not run it."""
    model_type = config.model_type
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if getattr(config, "text_config", None) is not None:
        text_type = getattr(config.text_config, "model_type", "?")
        hint = (f"train its text model: a config of model_type {text_type!r}" if text_type in FAMILIES else
                f"its text model ({text_type}) is not supported either")
        raise ConfigError(f"model type {model_type!r} is a multimodal wrapper, which the trainer does not build: "
                          f"{hint} (--model_config with the text config, or --model with a text-only checkpoint)")
    kind = unsupported_kind(config)
    raise ConfigError(f"model type {model_type!r} is {kind}, which the trainer does not train; it trains the "
                      f"decoders of docs/models.md: {', '.join(FAMILIES)}")


# config attributes that only state-space (Mamba) layers have
_SSM_FIELDS = ("ssm_state_size", "state_size", "mamba_d_state", "mamba_d_conv", "time_step_rank", "time_step_limit",
               "mamba_expand", "layers_block_type", "hybrid_override_pattern")


def unsupported_kind(config) -> str:
    """What kind of model an unsupported config describes, for the refusal: its token mixers or its positions are
    what the trainer would get wrong, so they are named."""
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder"
    if any(getattr(config, name, None) is not None for name in _SSM_FIELDS):
        return "a state-space (Mamba) model or Mamba hybrid"
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language model"
    if not _has_causal_lm(config):
        return "not a causal LM (an encoder or another head)"
    if getattr(config, "model_type", "") in _ENCODERS:
        return "an encoder (bidirectional attention)"
    if getattr(config, "position_embedding_type", None) == "absolute" or hasattr(config, "n_positions"):
        return "a model with learned absolute positions (GPT-2 style: no rotary positions to rescale)"
    return "a family the trainer has not made exact (its layers are never assumed to be full attention)"


_ENCODERS = {"bert", "roberta", "xlm-roberta", "electra", "modernbert", "deberta", "deberta-v2", "camembert"}


def _has_causal_lm(config) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _per_layer_heads(config, index: int) -> tuple[int, int]:
    """Query and KV heads of layer `index` (Gemma 4's global layers have their own KV heads)."""
    q = config.num_attention_heads
    per_layer = getattr(config, "per_layer_config", None)
    layer = per_layer[index] if per_layer is not None else config  # a view indexed by layer (heterogeneous configs)
    try:  # a heterogeneous config refuses its own value where the layers' differ
        kv = getattr(layer, "num_key_value_heads", None)
    except (AttributeError, ValueError):
        kv = None
    return q, kv or q


def _layer_types(config, family: FamilyRecord) -> list[str]:
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        sliding = family.window_from_config and getattr(config, "sliding_window", None)
        return ["sliding_attention" if sliding else "full_attention"] * n
    if len(types) < n:
        raise ConfigError(f"the model config lists {len(types)} layer_types for {n} layers")
    return types[:n]


def layer_mixers(config) -> list[LayerMixer]:
    """One LayerMixer per decoder layer of `config`; an unknown family or layer type is a ConfigError."""
    family = family_of(config)
    no_rope = getattr(config, "no_rope_layers", None)  # 1: the layer uses rotary positions (SmolLM3, Llama 4)
    sinks = family.sinks
    softcap = getattr(config, "attn_logit_softcapping", None) if family.attention_softcap else None
    tuning = bool(getattr(config, "attn_temperature_tuning", False))
    mixers = []
    for index, layer_type in enumerate(_layer_types(config, family)):
        _check_built(config, index, layer_type)
        q, kv = _per_layer_heads(config, index)
        rope = bool(no_rope[index]) if no_rope else True
        if layer_type in ("full_attention", "sliding_attention", "chunked_attention"):
            mixers.append(LayerMixer(
                "attention", q, kv, window=config.sliding_window if layer_type == "sliding_attention" else None,
                chunk=config.attention_chunk_size if layer_type == "chunked_attention" else None, sinks=sinks,
                softcap=softcap or None, rope=rope, temperature_tuning=tuning and not rope))
        elif layer_type in LINEAR_MIXERS:
            mixers.append(LayerMixer(layer_type))
        else:
            raise ConfigError(f"model type {config.model_type!r}: layer {index} is of type {layer_type!r}, which the "
                              f"trainer does not know; it is never assumed to be full attention")
    return mixers


def _check_built(config, index: int, layer_type: str) -> None:
    """A layer type the family's modeling file builds, judged by the sizes it reads: a Gated DeltaNet mixer only
    where the config has the mixer's sizes, chunked attention only where it has `attention_chunk_size` (Llama 4),
    a sliding window only where it has `sliding_window`. Elsewhere transformers builds another layer than the type
    says (full attention, in Gemma 2 and Llama), and the trainer would plan and shard the one named."""
    needs = {"linear_attention": "linear_num_value_heads", "chunked_attention": "attention_chunk_size",
             "sliding_attention": "sliding_window"}.get(layer_type)
    if needs is None or hasattr(config, needs):
        return
    raise ConfigError(f"model type {config.model_type!r}: layer {index} is of type {layer_type!r}, which its "
                      f"modeling file does not build (its config has no {needs}): give layer_types the family's "
                      f"own types")


def _count(mixers: list[LayerMixer], keep) -> str:
    return f"{sum(1 for m in mixers if keep(m))} of {len(mixers)}"


def _refusals(config, mixers: list[LayerMixer], sp_size: int, ring_size: int, kernel: str,
              device_type: str, packing: bool) -> list[str]:
    """Every reason this run cannot be exact, each naming what would work."""
    why, model = [], config.model_type
    sharded = FAMILIES[model].sharded_mixers
    for kind, n in Counter(m.kind for m in mixers if not m.attention).items():
        what = f"`{kind}` layers ({n} of {len(mixers)}, {LINEAR_MIXERS[kind]})"
        if sp_size > 1 and kind not in sharded:
            why.append(f"{what} are not sharded exactly under sequence parallelism yet (each rank would run them "
                       f"on its own shard): --sp_size 1 works")
        elif ring_size > 1:
            why.append(f"{what} under --ring_size {ring_size} are not built (the recurrence's state would have to "
                       f"pass round the ring): use --ring_size 1 (Ulysses alone)")
        if packing and kind not in sharded:
            why.append(f"{what} would carry their state across packed documents: drop --packing")
    if getattr(config, "use_bidirectional_attention", False):
        why.append("bidirectional attention (use_bidirectional_attention) is not built: the kernels are causal")
    if ring_size > 1:
        for what, keep in (("sliding-window", lambda m: m.window), ("chunked", lambda m: m.chunk),
                           ("sink", lambda m: m.sinks), ("softcapped", lambda m: m.softcap),
                           ("temperature-tuned NoPE", lambda m: m.temperature_tuning)):
            if any(keep(m) for m in mixers):
                why.append(f"{what} attention layers ({_count(mixers, keep)}) under --ring_size {ring_size} are not "
                           f"built: use --ring_size 1 (Ulysses alone)")
    if any(m.softcap for m in mixers) and kernel == "sdpa" and device_type == "cuda":
        why.append("the attention logit softcap has no SDPA kernel on CUDA: --attn_kernel flash_attn (FA2) or "
                   "flash_attn_4")
    if any(m.sinks for m in mixers) and kernel == "flash_attn":
        why.append("attention sinks have no FA2 kernel: --attn_kernel flash_attn_4 or sdpa")
    if getattr(config, "output_router_logits", False) and not FAMILIES[model].router_aux_loss:
        why.append("the MoE router's load-balancing loss (output_router_logits) is built for "
                   f"{', '.join(sorted(families_with('router_aux_loss')))} only: set output_router_logits to false in "
                   f"the model config")
    return [f"{model}: {w}" for w in why]


def check_support(config, sp_size: int = 1, ring_size: int = 1, kernel: str = "sdpa", device_type: str = "cpu",
                  packing: bool = False) -> list[LayerMixer]:
    """The layers of `config`, if this run (SP and ring sizes, resolved attention kernel, device, packing) is exact
    for every one of them; otherwise one ConfigError listing every reason. Every layer's heads are checked against
    the Ulysses degree, not only the config's first numbers."""
    mixers = layer_mixers(config)
    why = _refusals(config, mixers, sp_size, ring_size, kernel, device_type, packing)
    if why:
        raise ConfigError("this run would not be exact:\n  " + "\n  ".join(why))
    for q, kv in sorted({(m.q_heads, m.kv_heads) for m in mixers if m.attention}):
        dims.check_heads(sp_size, q, kv, ring_size)
    if any(m.kind == "linear_attention" for m in mixers):
        _check_linear_heads(config, sp_size)
    return mixers


def _check_linear_heads(config, sp_size: int) -> None:
    """The DeltaNet mixer's all-to-all (deltanet.py) splits the value heads over the SP ranks, and the key heads too,
    or replicates each key head on sp/nk ranks when their count divides sp (attention's rule for KV heads)."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    if nv % sp_size == 0 and (nk % sp_size == 0 or sp_size % nk == 0):
        return
    works = [d for d in range(1, nv + 1) if nv % d == 0 and (nk % d == 0 or d % nk == 0)]
    raise ConfigError(f"--sp_size {sp_size} cannot cut the Gated DeltaNet layers' {nk} linear key heads and {nv} "
                      f"linear value heads (linear_num_key_heads, linear_num_value_heads): the value heads must split "
                      f"over the ranks, and the key heads split or be replicated (their count dividing --sp_size); "
                      f"--sp_size {' or '.join(map(str, works))} works")


def describe_layers(mixers: list[LayerMixer]) -> str:
    """One line for the log: each kind of layer and how many."""
    return ", ".join(f"{n} x {kind}" for kind, n in Counter(m.describe() for m in mixers).items())


if __name__ == "__main__":  # the table of docs/models.md: python -m ulysses_train.sp.support
    print(supported_models_table())
