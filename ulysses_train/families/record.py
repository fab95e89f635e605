"""What the trainer knows about one model family that the family's transformers config does not say.

Everything a config states (its layer types, windows, chunk sizes, NoPE layers, heads per layer, expert counts) is
read from the config where it is used; what a modeling file does with it (whether q_proj also emits a gate, which
norms a layer has, whether its attention takes sinks) is not in the config, so each family's record holds it. The
norms, rotaries and MLPs our levers replace are not recorded: model/matching.py decides them by probing what each
module computes (tests/unit/test_surgery.py pins the counts per family).
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_KERNELS = "FA4, FA2, SDPA"

# the kinds of MLP block model/geometry.py counts (`FamilyRecord.mlp`)
MLP_KINDS = ("dense", "biased_experts", "moe_layers", "dense_beside_experts")


@dataclass(frozen=True)
class FamilyRecord:
    """One model family the trainer has made exact (a row of docs/models.md's table, tests/unit/test_families.py)."""

    model_type: str
    """transformers' `model_type` of the family's text decoder (a key of CONFIG_MAPPING)."""

    name: str
    """The family's name as the table of docs/models.md shows it."""

    features: str
    """What its layers do beyond full causal attention, for the table ("full attention" when nothing)."""

    kernels: str = ALL_KERNELS
    """The attention kernels that run it exactly, for the table (tests/unit/test_support.py checks each claim)."""

    ring: bool = True
    """Exact under --ring_size > 1 too; False: the support check refuses a ring (windows, sinks, recurrences)."""

    sequence_parallel: bool = True
    """Exact under --sp_size > 1; False: SP=1 only (the planner tries no larger SP)."""

    packing: bool = True
    """Exact with --packing; False: packing is refused (a recurrence would run across documents)."""

    window_from_config: bool = False
    """The config has no `layer_types`: every layer slides when `sliding_window` is set (Mistral)."""

    sinks: bool = False
    """Every attention layer has a learned per-head logit in its softmax denominator (GPT-OSS's `sinks`): one
    parameter per head, and a kernel that takes them."""

    attention_softcap: bool = False
    """Its attention applies the config's `attn_logit_softcapping` to the scores (Gemma 2; Gemma 3's config carries
    the key, its attention does not use it)."""

    sharded_mixers: frozenset = frozenset()
    """Layer types that are not attention whose mixer the trainer runs exactly under Ulysses and with packing
    ({"linear_attention"}: the Gated DeltaNet mixer of sp/deltanet.py)."""

    router_aux_loss: bool = False
    """Its MoE router's load-balancing loss (`output_router_logits`) is added over the whole sequence
    (levers/loss.py: router_aux_share); refused in an MoE family without it."""

    packed_row_mixes_documents: bool = False
    """Plain transformers lets a packed row's documents attend each other (GPT-OSS's mask ignores the restarting
    positions), so a packed reference (--verify, the tests) runs each document alone."""

    gated_query: bool = False
    """q_proj also emits the per-head output gate (gated attention): twice the query width."""

    qk_norm: str = ""
    """How q and k are normalised: "" not at all, "head" per head (one weight of head_dim each), "wide" across all
    heads (weights of heads x head_dim and KV heads x head_dim: OLMo 3)."""

    qkv_bias: bool = False
    """q, k and v always have biases and the output projection none (Qwen2), whatever `attention_bias` says; else
    all four have them when the config's `attention_bias` is set."""

    hidden_norms: int = 2
    """RMSNorms of hidden width a token passes through per layer (Gemma normalises each sublayer's output too: 4)."""

    mlp: str = "dense"
    """The MLP block, as model/geometry.py counts it: "dense" a gated MLP, or routed experts where the config
    declares `num_experts` (every `decoder_sparse_step` layer but `mlp_only_layers`, with a shared expert where set);
    "biased_experts" `num_local_experts` experts with biases and a biased router in every layer (GPT-OSS);
    "moe_layers" routed experts and a shared one in `moe_layers`, dense MLPs of `intermediate_size_mlp` between
    (Llama 4); "dense_beside_experts" a dense MLP (double-wide on KV-shared layers with `use_double_wide_mlp`) with
    an expert block beside it under `enable_moe_block` (Gemma 4)."""

    per_layer_input: bool = False
    """Each layer gates in a per-layer embedding of `hidden_size_per_layer_input` (Gemma 4)."""

    size_keys: tuple = ()
    """Config keys beyond every family's (layers, widths, heads, vocabulary, length, window) that hold a count or a
    length of this family: model/config_check.py refuses one that is not a positive whole number."""

    estimate_measured: bool = False
    """The planner's memory estimate is measured for it (on the H200 within 6%, docs/memory.md): only then does the
    lever policy spend memory on the estimate's word (levers/policy.py: KEEP_PLAN_FRACTION, UNTILE_PLAN_FRACTION)."""

    def __post_init__(self):
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"{self.model_type}: mlp {self.mlp!r} is not one of {MLP_KINDS}")
        if self.qk_norm not in ("", "head", "wide"):
            raise ValueError(f"{self.model_type}: qk_norm {self.qk_norm!r} is not '', 'head' or 'wide'")
