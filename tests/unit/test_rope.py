"""YaRN plumbing: factor, theta and pretrained length come from the model config; contradictions are errors."""

import pytest
import torch

from ulysses_train.errors import ConfigError
from ulysses_train.levers.rope import configure_rope
from ulysses_train.model.build import load_model_config


def test_yarn_on_qwen3_4b_preset_reads_theta_and_length():
    config = load_model_config(None, "qwen3-4b")
    final = configure_rope(config, "yarn", seq_len=131072)
    assert final == {"rope_type": "yarn", "rope_theta": 1_000_000, "factor": 131072 / 40960,
                     "original_max_position_embeddings": 40960}
    assert config.rope_parameters == final and config.max_position_embeddings == 131072


def test_yarn_changes_the_rotary_frequencies_and_scale():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from tests.models import tiny_config

    plain = tiny_config("qwen3")
    yarn = tiny_config("qwen3")
    configure_rope(yarn, "yarn", seq_len=4 * plain.max_position_embeddings)
    x = torch.zeros(1, 4, 8)
    pos = torch.tensor([[0, 100, 1000, 2000]])
    cos_plain, _ = Qwen3RotaryEmbedding(plain)(x, pos)
    cos_yarn, _ = Qwen3RotaryEmbedding(yarn)(x, pos)
    assert not torch.allclose(cos_plain, cos_yarn)
    assert cos_yarn[0, 0].max() > 1.0  # YaRN's attention factor 0.1 ln(4) + 1 scales cos/sin


def test_contradictions_and_misuse_are_errors():
    config = load_model_config(None, "qwen3-4b")
    with pytest.raises(ConfigError, match="--rope_theta 10000.0 contradicts the model's rope_theta 1000000"):
        configure_rope(config, "yarn", 131072, theta=10000.0)
    with pytest.raises(ConfigError, match="--rope_original_max_positions 32768 contradicts"):
        configure_rope(config, "yarn", 131072, original=32768)
    with pytest.raises(ConfigError, match="--rope_factor needs --rope_scaling yarn"):
        configure_rope(config, "none", 131072, factor=2.0)
    assert configure_rope(config, "yarn", 131072, theta=1e6, original=40960, factor=8.0)["factor"] == 8.0
