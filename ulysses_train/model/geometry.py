"""The sizes of a model that memory, time and the lever policy depend on, read from its transformers config.

Sparse MoE layers (Qwen3-MoE: every layer's MLP is `num_experts` SwiGLU experts of `moe_intermediate_size`, a
token going to `num_experts_per_tok` of them) count every expert's weights in the parameters, and for what one
token computes and keeps only the experts it goes to: `inter` is then experts per token x the expert's width."""

from __future__ import annotations


def geometry(config) -> dict:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    h, i, v, layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    qk_norm = 2 * head_dim if config.model_type.startswith("qwen3") else 0  # Qwen3 normalises q and k per head
    attention = h * head_dim * (2 * heads + 2 * kv)
    experts = getattr(config, "num_experts", 0) or 0
    if experts:  # every layer sparse (decoder_sparse_step 1, no mlp_only_layers: the presets' and Qwen3-MoE's)
        per_token = config.num_experts_per_tok
        expert_inter = config.moe_intermediate_size
        mlp = experts * 3 * h * expert_inter + h * experts  # the experts and the router
        mlp_per_token = per_token * 3 * h * expert_inter + h * experts
        i = per_token * expert_inter
    else:
        per_token, mlp = 1, 3 * h * i
        mlp_per_token = mlp
    layer_params = attention + mlp + 2 * h + qk_norm
    embed = v * h * (1 if config.tie_word_embeddings else 2)
    return dict(hidden=h, inter=i, vocab=v, layers=layers, heads=heads, kv=kv, head_dim=head_dim,
                qk_norm=bool(qk_norm),
                attn_width=heads * head_dim, kv_width=kv * head_dim, layer_params=layer_params,
                params=layers * layer_params + embed + h,
                # what one token multiplies through per layer (all of a dense layer; its experts' share of a MoE)
                matmul_params=attention + mlp_per_token, mlp_matmul_params=mlp_per_token,
                experts=experts, experts_per_token=per_token)
