"""Tiny configs of several HF decoder families, for tests."""

from transformers import AutoConfig

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6, attention_dropout=0.0,
              use_cache=False)

TINY = {
    "qwen3": dict(COMMON, head_dim=8, tie_word_embeddings=True),
    "llama": dict(COMMON, tie_word_embeddings=False),
    "mistral": dict(COMMON, sliding_window=None, tie_word_embeddings=False),
    "qwen2": dict(COMMON, tie_word_embeddings=True),
    "qwen3_moe": dict(COMMON, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False),
}


def tiny_config(family: str):
    return AutoConfig.for_model(family, **TINY[family])


def qwen2_28_heads_config():
    """Qwen2.5-7B's head layout (28 query heads, 4 KV heads) at a tiny width: SP 8 needs a ring (Ulysses 4 x 2)."""
    return AutoConfig.for_model("qwen2", vocab_size=1024, hidden_size=28 * 16, intermediate_size=256,
                                num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4)


# Families beyond full attention: windows shorter than the tests' sequences, sinks, softcaps, chunks, NoPE layers.
WINDOW = 8
FRONTIER = {
    "gemma2": dict(COMMON, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"]),
    "gemma3_text": dict(COMMON, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                        layer_types=["sliding_attention", "full_attention"]),
    "gemma4_text": dict(COMMON, num_hidden_layers=4, head_dim=8, global_head_dim=16, num_global_key_value_heads=2,
                        attention_k_eq_v=True, sliding_window=WINDOW, hidden_size_per_layer_input=4,
                        vocab_size_per_layer_input=96, num_kv_shared_layers=2, eos_token_id=2, bos_token_id=1,
                        pad_token_id=0, layer_types=["sliding_attention", "full_attention"] * 2),
    "olmo3": dict(COMMON, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "mistral_window": dict(COMMON, sliding_window=WINDOW, tie_word_embeddings=False),
    "gpt_oss": dict(COMMON, head_dim=8, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=32, layer_types=["sliding_attention", "full_attention"]),
    "llama4_text": dict(COMMON, head_dim=8, attention_chunk_size=WINDOW, intermediate_size_mlp=128,
                        num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 0],
                        floor_scale=4, attn_scale=0.5, layer_types=["chunked_attention", "full_attention"],
                        pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "smollm3": dict(COMMON, no_rope_layers=[1, 0], pad_token_id=0, bos_token_id=1, eos_token_id=2),
}
# MoE routers' load-balancing loss over the whole sequence (a large coefficient, so that it shows in every gradient)
BALANCED = dict(output_router_logits=True, router_aux_loss_coef=0.5)
FRONTIER["qwen3_moe_balanced"] = dict(TINY["qwen3_moe"], **BALANCED)
FRONTIER["gpt_oss_balanced"] = dict(FRONTIER["gpt_oss"], **BALANCED)
# test name -> model_type, where they differ
FRONTIER_TYPES = {"mistral_window": "mistral", "qwen3_moe_balanced": "qwen3_moe", "gpt_oss_balanced": "gpt_oss"}


def frontier_config(name: str):
    """A tiny config of a family in FRONTIER; GPT-OSS's sinks are set non-zero by `perturb_sinks`."""
    return AutoConfig.for_model(FRONTIER_TYPES.get(name, name), **FRONTIER[name])


def perturb_sinks(model, seed: int) -> None:
    """GPT-OSS initialises its sinks to one value per layer; distinct values per head make their test meaningful."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("sinks"):
            param.data.copy_(torch.randn(param.shape, generator=g))


# Hybrids with Gated DeltaNet (`linear_attention`) layers: every fourth layer is gated full attention
LINEAR = {
    "qwen3_5_text": dict(COMMON, num_hidden_layers=4, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
                         linear_key_head_dim=8, linear_value_head_dim=8, pad_token_id=0),
    "qwen3_next": dict(COMMON, num_hidden_layers=4, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, pad_token_id=0),
    "qwen3_5_moe_text": dict(COMMON, num_hidden_layers=4, head_dim=8, linear_num_value_heads=4,
                             linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             pad_token_id=0),
}


def perturb_deltanet(model, seed: int) -> None:
    """transformers initialises `dt_bias` and the gated norm to ones; distinct values per head (and per channel) make
    a wrong slice of them, or of the conv's channels, show in the tests. `A_log` is drawn from a narrower range than
    transformers' (A in [0.01, 16]): at A near 16 the decay's cumulative sum over one 64-position chunk leaves fp32's
    normal range in the torch fallback's exponentials, and transformers' own fp32 gradients of `A_log` and `dt_bias`
    are then a few 1e-5 from what fp64 projections give, which a 1e-5 bound would take for an error of the cut."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(("dt_bias", "linear_attn.norm.weight")):
            param.data.copy_(1 + 0.5 * torch.randn(param.shape, generator=g))
        elif name.endswith("A_log"):
            param.data.copy_(torch.empty(param.shape).uniform_(0.05, 0.5, generator=g).log())


def any_tiny_config(model_type: str):
    """The tiny config of any family the tests know, by model_type (a FRONTIER name for the windowed Mistral)."""
    for table in (TINY, FRONTIER, LINEAR):
        if model_type in table:
            return AutoConfig.for_model(FRONTIER_TYPES.get(model_type, model_type), **table[model_type])
    raise KeyError(model_type)


def use_reference_deltanet_kernels(monkeypatch):
    """The gated delta rule op's kernels become its exact reference, and the mixers run their modeling file's conv
    (FLA's is CUDA's): the DeltaNet mixers' `fla` path on the CPU. Returns the op's module."""
    from ulysses_train.sp import gated_delta_op
    from ulysses_train.sp.linear_kernel import LinearKernel

    monkeypatch.setattr(gated_delta_op, "IMPL", dict(gated_delta_op.REFERENCE_IMPL))
    monkeypatch.setattr(LinearKernel, "conv", lambda self, activation: None)
    return gated_delta_op
