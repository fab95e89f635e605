"""model/geometry.py against the models transformers builds: the parameter count of a tiny config of every family the
trainer runs equals `sum(p.numel())` of the model exactly, each layer's span is what the support table says, and
the presets (the published checkpoints' text models) build and come out at their published sizes."""

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from ulysses_train.model.build import PRESETS, load_model_config
from ulysses_train.model.geometry import Span, geometry

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
ALTERNATING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)
DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
W, F, C, L = Span("window", 8), Span("full"), Span("chunk", 8), Span("linear_attention")

# model_type -> (config, the spans of its four layers); each exercises what its family adds to the count
FAMILIES = {
    "qwen3": (BASE, [F] * 4),
    "llama": (dict(BASE, attention_bias=True, mlp_bias=True), [F] * 4),
    "qwen2": ({k: v for k, v in BASE.items() if k != "head_dim"}, [F] * 4),  # biases on q, k, v
    "mistral": (dict(BASE, sliding_window=8), [W] * 4),
    "qwen3_moe": (dict(BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24), [F] * 4),
    "gemma2": (dict(BASE, **ALTERNATING), [W, F] * 2),  # four norms a layer
    "gemma3_text": (dict(BASE, **ALTERNATING), [W, F] * 2),  # and q, k norms per head
    "olmo3": (dict(BASE, sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"]), [W] * 3 + [F]),
    "smollm3": (dict(BASE, no_rope_layers=[1, 1, 1, 0]), [F] * 4),
    # sinks, biases everywhere, experts with biases and a biased router
    "gpt_oss": (dict(BASE, **ALTERNATING, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
                [W, F] * 2),
    # MoE (routed + shared expert) in every other layer, dense MLPs of intermediate_size_mlp between
    "llama4_text": (dict(BASE, attention_chunk_size=8, intermediate_size=32, intermediate_size_mlp=128,
                         num_local_experts=3, num_experts_per_tok=1, interleave_moe_layer_step=2), [C] * 3 + [F]),
    "qwen3_5_text": (dict(BASE, **DELTANET), [L] * 3 + [F]),
    "qwen3_5_moe_text": (dict(BASE, **DELTANET, **QWEN_MOE), [L] * 3 + [F]),
    "qwen3_next": (dict(BASE, **DELTANET, **QWEN_MOE, mlp_only_layers=[1]), [L] * 3 + [F]),
    # global layers with their own head_dim and k = v, the last two sharing KV (no k, v; double-wide MLPs),
    # per-layer embeddings, and a MoE block beside every MLP
    "gemma4_text": (dict(BASE, **ALTERNATING, global_head_dim=32, attention_k_eq_v=True, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=50, num_kv_shared_layers=2, use_double_wide_mlp=True,
                         enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24),
                    [W, F] * 2),
}


def _built_params(config) -> int:
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameters_equal_the_built_model_exactly(family):
    values, spans = FAMILIES[family]
    config = AutoConfig.for_model(family, **values)
    g = geometry(config)
    assert g["params"] == _built_params(config)
    assert g["attn_spans"] == spans and len(g["layer_shapes"]) == 4
    assert g["layer_params"] == max(s.params for s in g["layer_shapes"])


def test_gemma4_global_kv_heads():
    """Gemma 4's global layers with KV heads of their own (the published 26B and 31B): counted per layer."""
    values = dict(FAMILIES["gemma4_text"][0], num_global_key_value_heads=1, num_kv_shared_layers=0)
    config = AutoConfig.for_model("gemma4_text", **values)
    g = geometry(config)
    assert g["params"] == _built_params(config)
    assert [s.kv for s in g["layer_shapes"]] == [2, 1, 2, 1]


def test_summary_of_unlike_layers():
    """The scalar keys of a model whose layers differ are the largest layer's (memory plans for the peak), the
    parameters exact, the matmul parameters the mean; DeltaNet layers have no heads and their sizes are kept."""
    gemma4 = geometry(AutoConfig.for_model("gemma4_text", **FAMILIES["gemma4_text"][0]))
    assert (gemma4["heads"], gemma4["head_dim"], gemma4["attn_width"]) == (4, 32, 128)  # the global layers
    assert gemma4["kv_width"] == 2 * 32  # the global layers' two KV heads of 32 (their k is their v)
    qwen35 = geometry(AutoConfig.for_model("qwen3_5_text", **FAMILIES["qwen3_5_text"][0]))
    shapes = qwen35["layer_shapes"]
    assert [s.heads for s in shapes] == [0, 0, 0, 4] and qwen35["heads"] == 4
    assert qwen35["linear_attn"] == dict(value_heads=4, key_head_dim=8, value_head_dim=12, conv_width=2 * 16 + 48,
                                         value_width=48, conv_kernel=4)
    assert qwen35["matmul_params"] == pytest.approx(sum(s.matmul_params for s in shapes) / 4)
    # gated attention: q_proj emits the query and its gate
    assert shapes[3].matmul_params - shapes[3].mlp_matmul_params == 64 * (2 * 64 + 2 * 32) + 64 * 64
    llama4 = geometry(AutoConfig.for_model("llama4_text", **FAMILIES["llama4_text"][0]))
    assert [s.moe for s in llama4["layer_shapes"]] == [False, True] * 2
    assert llama4["inter"] == 128 and llama4["experts"] == 3  # the dense layers' MLP is the widest


# preset -> (published parameters of its text model, relative tolerance), each with where the number comes from
PUBLISHED = {
    # Keras Hub's gemma3_4b_text / gemma3_12b_text counts, whose embeddings have 64 rows fewer than the hub
    # checkpoint's 262,208 (the image tokens): 64 x hidden apart
    "gemma3-4b": (3_880_099_328 + 64 * 2560, 0),
    "gemma3-12b": (11_765_788_416 + 64 * 3840, 0),
    "gpt-oss-20b": (20.91e9, 0.002),  # OpenAI's model card: 20.91B in all, 3.61B active
    "olmo3-7b": (7_298_011_136, 0),  # the hub's safetensors count of allenai/Olmo-3-1025-7B
    # the named sizes (the hub's counts add the vision tower and the multi-token-prediction layer)
    "qwen3.5-9b": (9e9, 0.02),
    "qwen3.5-27b": (27e9, 0.02),
    "qwen3.5-35b-a3b": (35e9, 0.02),
    "qwen3-next-80b-a3b": (80e9, 0.02),
}


def test_every_published_preset_is_checked():
    assert set(PUBLISHED) <= set(PRESETS) and set(PRESETS) - set(PUBLISHED) <= {"tiny", "qwen3-0.6b", "qwen3-4b",
                                                                               "qwen3-8b", "qwen3-30b-a3b"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_builds_its_text_config_at_its_published_size(name):
    published, tolerance = PUBLISHED[name]
    config = AutoConfig.for_model(**PRESETS[name])
    assert config.model_type in {"gemma3_text", "gpt_oss", "olmo3", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
    assert config.to_dict() == load_model_config(None, name).to_dict()  # loading twice gives the same config
    g = geometry(config)
    assert g["params"] == pytest.approx(published, rel=tolerance, abs=0)
    assert g["matmul_params"] * g["layers"] < g["params"]


def test_preset_spans_follow_the_published_layer_patterns():
    spans = {name: geometry(load_model_config(None, name))["attn_spans"] for name in PUBLISHED}
    assert spans["gemma3-4b"] == ([Span("window", 1024)] * 5 + [F]) * 5 + [Span("window", 1024)] * 4
    assert spans["gpt-oss-20b"] == [Span("window", 128), F] * 12
    assert spans["olmo3-7b"] == ([Span("window", 4096)] * 3 + [F]) * 8
    assert spans["qwen3.5-9b"] == ([L] * 3 + [F]) * 8 and spans["qwen3-next-80b-a3b"] == ([L] * 3 + [F]) * 12


def test_a_stray_num_experts_in_a_dense_family_counts_a_dense_model():
    """transformers builds Gemma 2 dense whatever `num_experts` its config.json holds (the probe suite drew
    `num_experts: 1`, which made the geometry look for experts the family does not have)."""
    from transformers import AutoConfig

    from ulysses_train.model.geometry import geometry

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=300)
    assert geometry(AutoConfig.for_model("gemma2", num_experts=1, **shape)) == \
        geometry(AutoConfig.for_model("gemma2", **shape))
