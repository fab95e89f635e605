"""One record per model family the trainer runs, in the order of docs/models.md's table.

Each record is checked against plain transformers in tests/distributed/test_frontier_families.py,
tests/distributed/test_model_families.py and tests/distributed/test_model_equivalence.py, its sizes in
tests/unit/test_geometry.py, and its fields against the tiny model of tests/models.py in tests/unit/test_families.py."""

from __future__ import annotations

from .record import FamilyRecord

_MOE = ("moe_intermediate_size", "num_experts", "num_experts_per_tok")  # Qwen's routed experts
_DELTANET = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
             "linear_conv_kernel_dim")
_LOCAL_EXPERTS = ("num_local_experts", "num_experts_per_tok")  # GPT-OSS's and Llama 4's experts
_GATED_DELTANET = dict(ring=False, sharded_mixers=frozenset({"linear_attention"}), gated_query=True, qk_norm="head")

RECORDS = (
    FamilyRecord("llama", "Llama", "full attention", estimate_measured=True),
    FamilyRecord("qwen2", "Qwen2 / Qwen2.5", "full attention", qkv_bias=True),
    FamilyRecord("qwen3", "Qwen3", "full attention", qk_norm="head", estimate_measured=True),
    FamilyRecord("qwen3_moe", "Qwen3-MoE", "full attention, sparse MoE", qk_norm="head", router_aux_loss=True,
                 size_keys=_MOE, estimate_measured=True),
    FamilyRecord("mistral", "Mistral", "sliding window when `sliding_window` is set", ring=False,
                 window_from_config=True),
    FamilyRecord("gemma2", "Gemma 2", "sliding window, attention logit softcap, final logit softcap",
                 kernels="FA4, FA2 (SDPA on CPU)", ring=False, attention_softcap=True, hidden_norms=4),
    FamilyRecord("gemma3_text", "Gemma 3 (text)", "sliding window on 5 of 6 layers", ring=False, qk_norm="head",
                 hidden_norms=4, estimate_measured=True),
    FamilyRecord("gemma4_text", "Gemma 4 (text)", "sliding window, wider global heads, shared-KV layers",
                 kernels="SDPA (FA4, FA2 where no head is over 256 wide)", ring=False, qk_norm="head",
                 hidden_norms=4, mlp="dense_beside_experts", per_layer_input=True,
                 size_keys=("global_head_dim", "moe_intermediate_size", "num_experts")),
    FamilyRecord("olmo3", "OLMo 3", "sliding window on 3 of 4 layers", ring=False, qk_norm="wide",
                 estimate_measured=True),
    FamilyRecord("gpt_oss", "GPT-OSS", "sliding window, attention sinks, sparse MoE", kernels="FA4, SDPA",
                 ring=False, sinks=True, router_aux_loss=True, packed_row_mixes_documents=True,
                 mlp="biased_experts", size_keys=_LOCAL_EXPERTS),
    FamilyRecord("llama4_text", "Llama 4 (text)", "chunked attention, NoPE layers with temperature tuning, MoE",
                 ring=False, mlp="moe_layers", size_keys=("attention_chunk_size",) + _LOCAL_EXPERTS),
    FamilyRecord("smollm3", "SmolLM3", "NoPE layers"),
    FamilyRecord("qwen3_5_text", "Qwen3.5 (text)", "Gated DeltaNet layers, gated attention", **_GATED_DELTANET,
                 size_keys=_DELTANET, estimate_measured=True),
    FamilyRecord("qwen3_5_moe_text", "Qwen3.5-MoE (text)", "Gated DeltaNet layers, gated attention, MoE",
                 **_GATED_DELTANET, router_aux_loss=True, size_keys=_DELTANET + _MOE),
    FamilyRecord("qwen3_next", "Qwen3-Next", "Gated DeltaNet layers, gated attention, MoE", **_GATED_DELTANET,
                 router_aux_loss=True, size_keys=_DELTANET + _MOE),
)
