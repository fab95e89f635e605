"""How many modules each patch of model/surgery.py takes in each tiny family of tests/models.py (2 layers), with
every lever on: tests/unit/test_surgery.py asserts them, tests/unit/test_fused_kernels.py reads which patches apply."""

# (patch -> modules) with every lever on: norms are 2 per layer and the final one, plus q and k norms in Qwen3
EXPECTED = {
    "qwen3": {"checkpointing": 2, "loss head": 1, "RMSNorm": 9, "gated RMSNorm": 0,
              "rotary": 2, "gated MLP": 2, "tiled MLP": 2},
    "llama": {"checkpointing": 2, "loss head": 1, "RMSNorm": 5, "gated RMSNorm": 0,
              "rotary": 2, "gated MLP": 2, "tiled MLP": 2},
    "mistral": {"checkpointing": 2, "loss head": 1, "RMSNorm": 5, "gated RMSNorm": 0,
                "rotary": 2, "gated MLP": 2, "tiled MLP": 2},
    "qwen2": {"checkpointing": 2, "loss head": 1, "RMSNorm": 5, "gated RMSNorm": 0,
              "rotary": 2, "gated MLP": 2, "tiled MLP": 2},
    "qwen3_moe": {"checkpointing": 2, "loss head": 1, "RMSNorm": 9, "gated RMSNorm": 0,
                  "rotary": 2, "gated MLP": 0, "tiled MLP": 0},
    # beyond full attention (tests/models.py FRONTIER, LINEAR): Gemma's and Qwen3.5's `1 + weight` norms and OLMo 3's,
    # GPT-OSS's and Gemma 4's fp32 products are norm rules of their own (levers/lean_norm.py), Gemma's GELU-gated
    # MLPs a gated activation of the kernel; Gemma 4's two unscaled norms (no weight) and the rotary of Gemma 4,
    # GPT-OSS and Llama 4 compute something else, so transformers' ops stay; the MoE families have no dense MLP to
    # tile (Llama 4's dense layers are `feed_forward`); the gated norms are the DeltaNet layers' output norms
    "gemma2": {"checkpointing": 2, "loss head": 1, "RMSNorm": 9, "gated RMSNorm": 0,
               "rotary": 2, "gated MLP": 2, "tiled MLP": 2},
    "gemma3_text": {"checkpointing": 2, "loss head": 1, "RMSNorm": 13, "gated RMSNorm": 0,
                    "rotary": 2, "gated MLP": 2, "tiled MLP": 2},
    "gemma4_text": {"checkpointing": 4, "loss head": 1, "RMSNorm": 28, "gated RMSNorm": 0,
                    "rotary": 0, "gated MLP": 4, "tiled MLP": 4},
    "olmo3": {"checkpointing": 2, "loss head": 1, "RMSNorm": 9, "gated RMSNorm": 0,
              "rotary": 2, "gated MLP": 2, "tiled MLP": 2},
    "qwen3_5_text": {"checkpointing": 4, "loss head": 1, "RMSNorm": 11, "gated RMSNorm": 3,
                     "rotary": 1, "gated MLP": 4, "tiled MLP": 4},
    "qwen3_next": {"checkpointing": 4, "loss head": 1, "RMSNorm": 11, "gated RMSNorm": 3,
                   "rotary": 1, "gated MLP": 0, "tiled MLP": 0},
    "mistral_window": {"checkpointing": 2, "loss head": 1, "RMSNorm": 5, "gated RMSNorm": 0,
                       "rotary": 2, "gated MLP": 2, "tiled MLP": 2},
    "gpt_oss": {"checkpointing": 2, "loss head": 1, "RMSNorm": 5, "gated RMSNorm": 0,
                "rotary": 0, "gated MLP": 0, "tiled MLP": 0},
    "llama4_text": {"checkpointing": 2, "loss head": 1, "RMSNorm": 5, "gated RMSNorm": 0,
                    "rotary": 0, "gated MLP": 0, "tiled MLP": 0},
    "smollm3": {"checkpointing": 2, "loss head": 1, "RMSNorm": 5, "gated RMSNorm": 0,
                "rotary": 2, "gated MLP": 2, "tiled MLP": 2},
}
