"""The support check (sp/support.py): every family the trainer runs is listed with what it can do, and every run
that would not be exact is refused before anything is built, with a message naming the layer type and what would
work. The table of supported models in docs/models.md is the check's own, so it cannot drift."""

import os
import subprocess

import pytest
import torch
from transformers import AutoConfig

from tests.models import FRONTIER, FRONTIER_TYPES, LINEAR, TINY, any_tiny_config
from ulysses_train.errors import ConfigError
from ulysses_train.sp.support import FAMILIES, check_support, layer_mixers, supported_models_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
TESTED = {**{t: t for t in TINY}, **{t: t for t in FRONTIER if t not in FRONTIER_TYPES}, **{t: t for t in LINEAR}}


def _refused(config, **run) -> str:
    with pytest.raises(ConfigError) as e:
        check_support(config, **run)
    return str(e.value)


def test_every_listed_family_has_a_tested_tiny_config():
    """A family in the table is one the equivalence tests run."""
    assert set(FAMILIES) <= set(TESTED)


@pytest.mark.parametrize("model_type", sorted(TESTED))
def test_the_table_says_what_the_check_does(model_type):
    """Each family's claims (SP, ring, packing, kernels) are what check_support accepts and refuses."""
    family, config = FAMILIES[model_type], any_tiny_config(model_type)
    if model_type == "mistral":
        config = any_tiny_config("mistral_window")  # its window is what the table speaks of
    sp_ok = family.sequence_parallel
    for sp in (2, 4):
        if sp_ok:
            check_support(config, sp_size=sp)
        else:
            assert "--sp_size 1 works" in _refused(config, sp_size=sp)
    check_support(config, sp_size=1)
    if family.ring and sp_ok:
        check_support(config, sp_size=4, ring_size=2)
    else:  # refused for its ring, or already for its SP
        assert ("--ring_size" if sp_ok else "--sp_size 1 works") in _refused(config, sp_size=4, ring_size=2)
    if family.packing:
        check_support(config, packing=True)
    else:
        assert "drop --packing" in _refused(config, packing=True)
    for kernel, name in (("flash_attn_4", "FA4"), ("flash_attn", "FA2"), ("sdpa", "SDPA")):
        runs = name in family.kernels.replace("(SDPA on CPU)", "")
        if runs:
            check_support(config, kernel=kernel, device_type="cuda")
        else:
            assert "--attn_kernel" in _refused(config, kernel=kernel, device_type="cuda")


def test_the_models_page_table_is_the_checks_own_and_the_readme_names_every_family():
    page = open(os.path.join(ROOT, "docs", "models.md")).read()
    assert supported_models_table() in page, ("regenerate the table of docs/models.md: "
                                              "python -m ulysses_train.sp.support")
    readme = open(os.path.join(ROOT, "README.md")).read()
    listed = readme[readme.index("## Supported models"):].split("\n## ", 1)[0]
    missing = [model_type for model_type in FAMILIES if f"`{model_type}`" not in listed]
    assert not missing, f"families missing from the README's supported models: {missing}"


def test_deltanet_layers_of_a_family_that_does_not_build_them_are_refused_at_any_size():
    """Gated DeltaNet layers are built by Qwen3.5 and Qwen3-Next's modeling files: OLMo 3's builds full attention for
    a layer listed as `linear_attention` (its config has none of the mixer's sizes), so such a config is refused
    at SP=1 too, naming what it lacks; Qwen3.5's runs under SP."""
    config = any_tiny_config("olmo3")
    config.layer_types = ["linear_attention", "full_attention"]
    for sp in (1, 2):
        message = _refused(config, sp_size=sp)
        assert "model type 'olmo3': layer 0 is of type 'linear_attention', which its modeling file does not build " \
               "(its config has no linear_num_value_heads)" in message
    check_support(any_tiny_config("qwen3_5_text"), sp_size=2)


def test_an_unknown_family_is_refused_never_assumed_full_attention():
    config = AutoConfig.for_model("phi3", hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    message = _refused(config)
    assert ("'phi3' is a family the trainer has not made exact" in message
            and "never assumed to be full attention" in message)


def test_a_multimodal_wrapper_names_its_text_model():
    config = AutoConfig.for_model("gemma3")
    assert "train its text model: a config of model_type 'gemma3_text'" in _refused(config)


def test_an_unknown_layer_type_is_refused():
    config = any_tiny_config("olmo3")
    config.layer_types = ["sliding_attention", "mamba"]
    assert "layer 1 is of type 'mamba'" in _refused(config)


def test_more_refusals_each_name_what_would_work():
    gpt_oss, gemma2 = any_tiny_config("gpt_oss"), any_tiny_config("gemma2")
    assert "sinks have no FA2 kernel: --attn_kernel flash_attn_4 or sdpa" in _refused(gpt_oss, kernel="flash_attn")
    assert "softcap has no SDPA kernel on CUDA: --attn_kernel flash_attn (FA2) or flash_attn_4" in _refused(
        gemma2, kernel="sdpa", device_type="cuda")
    check_support(gemma2, kernel="sdpa", device_type="cpu")  # the exact explicit path
    # its load-balancing loss is built (tests/distributed/test_frontier_families.py)
    gpt_oss.output_router_logits = True
    check_support(gpt_oss, sp_size=2)
    llama4 = any_tiny_config("llama4_text")
    llama4.output_router_logits = True
    assert "set output_router_logits to false" in _refused(llama4)
    gemma3 = any_tiny_config("gemma3_text")
    gemma3.use_bidirectional_attention = True
    assert "bidirectional attention" in _refused(gemma3)
    gemma3.use_bidirectional_attention = False
    message = _refused(gemma3, sp_size=4, ring_size=2)
    assert "sliding-window attention layers (1 of 2) under --ring_size 2 are not built" in message


def test_every_layers_heads_are_checked_not_only_the_configs_first():
    """Gemma 4's global layers have their own KV heads: 2 of them replicate at SP 8; 3 can be neither split nor
    replicated at SP 2, although the sliding layers' 4 could."""
    from tests.models import FRONTIER

    assert [m.kv_heads for m in layer_mixers(any_tiny_config("gemma4_text"))] == [4, 2, 4, 2]
    check_support(any_tiny_config("gemma4_text"), sp_size=8)
    config = AutoConfig.for_model("gemma4_text", **{**FRONTIER["gemma4_text"], "num_global_key_value_heads": 3})
    with pytest.raises(ConfigError, match="3 KV heads"):
        check_support(config, sp_size=2)


def _probe_layer(config, index):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses")
    return model.model.layers[index].self_attn


def test_the_attention_refuses_arguments_its_table_does_not_account_for():
    from ulysses_train.sp.attention import UlyssesAttention, register_ulysses_attention

    register_ulysses_attention(None, "sdpa")
    attention = UlyssesAttention(None, "sdpa")
    config = any_tiny_config("olmo3")
    module = _probe_layer(config, 0)
    q = k = v = torch.zeros(1, 8, 16, 8)
    with pytest.raises(TypeError, match="passes alibi_slopes"):
        attention(module, q, k, v, None, alibi_slopes=torch.zeros(8))
    with pytest.raises(ValueError, match="sliding_window=4 to the attention, where its config says 8"):
        attention(module, q, k, v, None, sliding_window=4)
    with pytest.raises(ValueError, match="softcap=2.0"):
        attention(module, q, k, v, None, sliding_window=8, softcap=2.0)
    assert attention(module, q, k, v, None, sliding_window=8)[0].shape == (1, 16, 8, 8)


@pytest.mark.slow
def test_a_deltanet_model_whose_heads_sp_cannot_cut_stops_before_the_model_is_built(tmp_path):
    """Two ranks, --sp_size 2, 3 linear key heads (neither split nor replicated): exit 2 with the message, and no
    model or engine built (no 'params' line)."""
    config = tmp_path / "qwen35.json"
    qwen35 = any_tiny_config("qwen3_5_text")
    qwen35.linear_num_key_heads, qwen35.linear_num_value_heads = 3, 6
    config.write_text(qwen35.to_json_string())
    from tests.trainer_runs import child_env, deepspeed_launcher

    proc = subprocess.run(deepspeed_launcher(2) + ["launch/train.py", "--ds_config", "ds_configs/zero3.json",
                                                   "--model_config", str(config), "--seq_len", "64", "--steps", "1",
                                                   "--output_dir", str(tmp_path / "out")],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--sp_size 2 cannot cut the Gated DeltaNet layers' 3 linear key heads and 6 linear value heads" in \
        proc.stderr
    assert "params" not in proc.stdout and "Traceback" not in proc.stderr
    assert layer_mixers(any_tiny_config("qwen3_5_text"))[3].attention
