"""The sizes of a model that memory, time and the lever policy depend on, read from its transformers config."""

from __future__ import annotations


def geometry(config) -> dict:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    h, i, v, layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    qk_norm = 2 * head_dim if config.model_type.startswith("qwen3") else 0  # Qwen3 normalises q and k per head
    layer_params = h * head_dim * (2 * heads + 2 * kv) + 3 * h * i + 2 * h + qk_norm
    embed = v * h * (1 if config.tie_word_embeddings else 2)
    return dict(hidden=h, inter=i, vocab=v, layers=layers, heads=heads, kv=kv, head_dim=head_dim,
                qk_norm=bool(qk_norm),
                attn_width=heads * head_dim, kv_width=kv * head_dim, layer_params=layer_params,
                params=layers * layer_params + embed + h)
