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
