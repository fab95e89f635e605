"""Model presets and construction.

Under ZeRO-3 the model is built inside DeepSpeed's `zero.Init` (through transformers' `HfDeepSpeedConfig`, which the
caller keeps alive), so every parameter is partitioned as it is created and an 8B model is never whole on one rank.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch

from ..sp.attention import ATTN_NAME
from .buffers import restore_fp32_buffers
from ..errors import ConfigError
from ..paths import local_or_hub

_QWEN3 = dict(model_type="qwen3", rms_norm_eps=1e-6, head_dim=128, attention_bias=False, attention_dropout=0.0,
              hidden_act="silu", rope_theta=1_000_000, max_position_embeddings=40960, vocab_size=151936)

PRESETS: dict[str, dict] = {
    # small enough to train on a laptop CPU in a minute; vocab 512 covers the byte tokenizer (256 + specials)
    "tiny": dict(_QWEN3, vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=8192,
                 tie_word_embeddings=True),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(_QWEN3, model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, tie_word_embeddings=False),
}


def load_model_config(model: Optional[str], model_config: Optional[str], num_layers: Optional[int] = None):
    """The transformers config of --model, or of --model_config (preset name or JSON path); tiny by default, cut to
    --num_layers. Whatever keeps it from loading is a ConfigError naming the flag."""
    from transformers import AutoConfig

    if model:
        local_or_hub("model", model)
        try:
            config = AutoConfig.from_pretrained(model)
        except (OSError, ValueError) as e:  # no such hub id, no or unreadable config.json, unknown model_type
            raise ConfigError(f"--model {model}: {str(e).strip()}") from None
    else:
        name = model_config or "tiny"
        if name in PRESETS:
            values = dict(PRESETS[name])
        elif os.path.isfile(name):
            with open(name) as f:
                values = json.load(f)
        else:
            raise ConfigError(f"--model_config {name}: not a preset ({', '.join(PRESETS)}) nor a config.json file")
        if "model_type" not in values:
            raise ConfigError(f"--model_config {name}: the config has no model_type")
        config = AutoConfig.for_model(**values)
    if num_layers is not None:
        depth = config.num_hidden_layers
        if not 1 <= num_layers <= depth:  # more layers than the model has would be built and index past its lists
            raise ConfigError(f"--num_layers {num_layers}: {model or model_config or 'tiny'} has {depth} layers; "
                              f"give 1 to {depth}")
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:num_layers]
    return config


def build_model(config, model: Optional[str], dtype: torch.dtype, log: Callable[[str], None] = lambda _: None):
    """Instantiates the causal LM with Ulysses attention, its buffers as plain transformers makes them (see
    buffers.py). Call while an HfDeepSpeedConfig for ZeRO-3 is alive."""
    from transformers import AutoModelForCausalLM

    if model:
        built = AutoModelForCausalLM.from_pretrained(model, config=config, dtype=dtype, attn_implementation=ATTN_NAME)
    else:
        built = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_NAME)
    report = restore_fp32_buffers(built, dtype)
    if report.restored or report.unchecked:
        log(f"buffers: {report.describe()}")
    return built


def attention_heads(config) -> tuple[int, int]:
    q = config.num_attention_heads
    return q, getattr(config, "num_key_value_heads", None) or q
