"""The family records (ulysses_train/families/): one per supported family, each naming a transformers model type, and
each field saying what the family's tiny model (tests/models.py) holds. So a family is added by one record, its tiny
config and this test passing for it; a record that claims sinks, a gated query or DeltaNet layers its model lacks
fails here, by field, before the slower equivalence tests run."""

import inspect
import os

import pytest
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tests.models import any_tiny_config
from ulysses_train.families import FAMILIES, RECORDS
from ulysses_train.model.build import PRESETS
from ulysses_train.sp.deltanet import is_deltanet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _table_model_types() -> list[str]:
    """The `model_type` column of docs/models.md's supported-models table."""
    page = open(os.path.join(ROOT, "docs", "models.md")).read()
    rows = [line for line in page.splitlines() if line.startswith("| ") and line.count("|") == 8]
    return [row.split("|")[2].strip().strip("`") for row in rows[1:]]  # the header row's column is `model_type`


def test_every_supported_family_has_exactly_one_record():
    types = [r.model_type for r in RECORDS]
    assert len(types) == len(set(types)), "two records of one model_type"
    assert _table_model_types() == types


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_record_names_a_causal_lm_that_transformers_knows(model_type):
    assert model_type in CONFIG_MAPPING and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def test_every_preset_is_of_a_recorded_family():
    assert {name: p["model_type"] for name, p in PRESETS.items() if p["model_type"] not in FAMILIES} == {}


def _tiny(model_type: str):
    config = any_tiny_config("mistral_window" if model_type == "mistral" else model_type)  # its window set
    return config, AutoModelForCausalLM.from_config(config)


def _attention_layer(model):
    return next(layer for layer in model.model.layers if hasattr(layer, "self_attn"))


def _mlps(model):
    return [getattr(layer, "mlp", None) or layer.feed_forward for layer in model.model.layers]


def _has_experts(mlp) -> bool:
    return any("experts" in name for name, _ in mlp.named_parameters())


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_records_fields_are_what_its_tiny_model_holds(model_type):
    record, (config, model) = FAMILIES[model_type], _tiny(model_type)
    layer_types = set(getattr(config, "layer_types", None) or [])
    assert record.sharded_mixers == layer_types - {"full_attention", "sliding_attention", "chunked_attention"}
    assert ("linear_attention" in record.sharded_mixers) == any(is_deltanet(m) for m in model.modules())
    attn = _attention_layer(model).self_attn
    assert record.sinks == hasattr(attn, "sinks")
    assert record.gated_query == (attn.q_proj.out_features == 2 * config.num_attention_heads * attn.head_dim)
    norm = getattr(attn, "q_norm", None)
    width = {"": None, "head": attn.head_dim, "wide": config.num_attention_heads * attn.head_dim}[record.qk_norm]
    assert (norm.weight.numel() if norm is not None else None) == width
    assert record.qkv_bias == (attn.q_proj.bias is not None and attn.o_proj.bias is None)
    hidden_norms = [name for name, m in _attention_layer(model).named_children() if "per_layer" not in name
                    and type(m).__name__.endswith("RMSNorm") and m.weight.numel() == config.hidden_size]
    assert len(hidden_norms) == record.hidden_norms
    if record.attention_softcap:
        assert getattr(config, "attn_logit_softcapping", None)
    if record.window_from_config:
        assert not hasattr(config, "layer_types") and config.sliding_window
    if record.router_aux_loss:
        assert hasattr(config, "output_router_logits")
    assert record.per_layer_input == bool(getattr(config, "hidden_size_per_layer_input", 0))
    source = inspect.getsource(inspect.getmodule(type(config)))  # a key it takes (Gemma 4 pops global_head_dim)
    assert [key for key in record.size_keys if key not in source] == [], "size keys its config does not take"
    _check_mlp(record.mlp, config, _mlps(model))


def _check_mlp(kind: str, config, mlps) -> None:
    experts = [_has_experts(m) for m in mlps]
    # the keys that select the kinds besides Qwen's routed experts are their families' alone
    assert (kind == "moe_layers") == hasattr(config, "moe_layers")
    assert (kind == "dense_beside_experts") == hasattr(config, "enable_moe_block")
    if kind == "dense":  # routed experts exactly where the config declares them
        assert any(experts) == bool(getattr(config, "num_experts", 0))
    elif kind == "biased_experts":
        assert all(any(n.startswith("experts") and n.endswith("bias") for n, _ in m.named_parameters()) for m in mlps)
    elif kind == "moe_layers":
        assert experts == [i in config.moe_layers for i in range(len(mlps))]
    else:  # dense_beside_experts: the experts are a block beside the MLP, under enable_moe_block
        assert not any(experts)
