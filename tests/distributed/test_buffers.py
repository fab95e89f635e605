"""Buffers a model creates in fp32 stay fp32, with transformers' own values, when the trainer builds the model in
bf16 under ZeRO-3.

The failing condition is forced on the CPU: transformers releases before `prevent_arange_dtype_change` (5.17, the
one on our GPU machine, among them) let `zero.Init`'s `torch.arange` wrapper turn the rotary `inv_freq` into bf16.
Newer releases guard that one call, so the tests switch the guard off, as those releases behave. The reference is
plain transformers (no DeepSpeed) building the same config: its buffers are what an exported model computes."""

import contextlib

import pytest
import torch

from tests.models import tiny_config
from tests.multiprocess import run_distributed
from ulysses_train.levers.rope import configure_rope


def _plain_buffers(config) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return {n: b.clone() for n, b in model.named_buffers()}


def _built_under_zero3(rank, world, families, yarn):
    import transformers.modeling_utils as modeling_utils
    from transformers.integrations import HfDeepSpeedConfig

    from ulysses_train.model.build import build_model
    from ulysses_train.sp.attention import register_ulysses_attention

    # what transformers < 5.2x does: no guard around torch.arange inside zero.Init
    modeling_utils.prevent_arange_dtype_change = contextlib.nullcontext
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    keep = HfDeepSpeedConfig(ds)  # noqa: F841  (transformers builds inside zero.Init while it lives)
    register_ulysses_attention(None, "sdpa")
    out = {}
    for family in families:
        config = tiny_config(family)
        if yarn:
            configure_rope(config, "yarn", seq_len=4 * config.max_position_embeddings)
        model = build_model(config, None, torch.bfloat16)
        out[family] = {n: b.cpu().clone() for n, b in model.named_buffers()}
    return out


@pytest.mark.parametrize("yarn", [False, True])
def test_buffers_keep_plain_transformers_dtype_and_values_under_zero3(yarn):
    families = ["qwen3", "llama", "mistral", "qwen2", "qwen3_moe"]
    (result,) = run_distributed(_built_under_zero3, 1, families, yarn, use_deepspeed=True)
    for family, ours in result.items():
        config = tiny_config(family)
        if yarn:
            configure_rope(config, "yarn", seq_len=4 * config.max_position_embeddings)
        plain = _plain_buffers(config)
        assert ours.keys() == plain.keys() and ours, family
        for name, want in plain.items():
            assert want.dtype == torch.float32, f"{family} {name}: plain transformers made {want.dtype}"
            assert ours[name].dtype == torch.float32, f"{family} {name} is {ours[name].dtype} under ZeRO-3"
            assert torch.equal(ours[name], want), f"{family} {name}: values differ from plain transformers'"
