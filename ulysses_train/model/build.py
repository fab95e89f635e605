"""Model presets and construction.

Under ZeRO-3 the model is built inside DeepSpeed's `zero.Init` (through transformers' `HfDeepSpeedConfig`, which the
caller keeps alive), so every parameter is partitioned as it is created and an 8B model is never whole on one rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from typing import Callable, Optional

import torch

from ..errors import ConfigError
from ..families import FAMILIES
from ..paths import local_or_hub, looks_like_hub_id
from ..sp.attention import ATTN_NAME
from ..sp.support import family_of
from .buffers import restore_fp32_buffers
from .config_check import check_layers, check_model_config, unknown_model_type

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
    # The presets below are the text models of the published checkpoints: each one's shape is the config.json of
    # the Hugging Face hub model named in its comment (the text_config of a multimodal one), in transformers 5's
    # names (rope_parameters per layer type where the family has them); fields a config leaves out take
    # transformers' defaults, as they do when that checkpoint loads.
    # google/gemma-3-4b-pt (text_config): 5 sliding (1024) : 1 global layers, 3.88B text parameters
    "gemma3-4b": dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                      sliding_window=1024, vocab_size=262208, max_position_embeddings=131072, rms_norm_eps=1e-6,
                      hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                          "rope_theta": 1_000_000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    # google/gemma-3-12b-pt (text_config; the same text model as gemma-3-12b-it's)
    "gemma3-12b": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                       sliding_window=1024, vocab_size=262208, max_position_embeddings=131072, rms_norm_eps=1e-6,
                       hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                       rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1_000_000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    # openai/gpt-oss-20b: 32 experts (4 per token) in every layer, sliding (128) and full layers alternating
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128, layer_types=["sliding_attention",
                                                                                 "full_attention"] * 12,
                        vocab_size=201088, max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
                        swiglu_limit=7.0, tie_word_embeddings=False, output_router_logits=False,
                        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096,
                                         "rope_theta": 150_000.0}),
    # allenai/Olmo-3-1025-7B: 3 sliding (4096) : 1 full layers, no GQA; YaRN on the full layers only
    "olmo3-7b": dict(model_type="olmo3", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, sliding_window=4096,
                     layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 8, vocab_size=100278,
                     max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     pad_token_id=100277, eos_token_id=100257,
                     rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 8.0,
                                                         "original_max_position_embeddings": 8192,
                                                         "attention_factor": 1.2079441541679836, "beta_fast": 32.0,
                                                         "beta_slow": 1.0, "rope_theta": 500_000.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0}}),
    # Qwen/Qwen3.5-9B (text_config): 3 Gated DeltaNet : 1 gated attention layers (Ulysses SP and packing, no ring:
    # sp/support.py)
    "qwen3.5-9b": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel_dim=4, vocab_size=248320, max_position_embeddings=262144,
                       rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]}),
    # Qwen/Qwen3.5-27B (text_config)
    "qwen3.5-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, vocab_size=248320, max_position_embeddings=262144,
                        rms_norm_eps=1e-6, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000,
                                         "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                         "mrope_section": [11, 11, 10]}),
    # Qwen/Qwen3.5-35B-A3B (text_config): 256 experts (8 per token) and a shared expert in every layer
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=256,
                            num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
                            max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            output_router_logits=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000,
                                             "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                             "mrope_section": [11, 11, 10]}),
    # Qwen/Qwen3-Next-80B-A3B-Instruct (the -Thinking model has the same shape): 512 experts (10 per token)
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", hidden_size=2048, intermediate_size=5120,
                               num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                               num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[],
                               norm_topk_prob=True, linear_num_key_heads=16, linear_num_value_heads=32,
                               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                               vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6,
                               tie_word_embeddings=False, output_router_logits=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10_000_000,
                                                "partial_rotary_factor": 0.25}),
}


def model_config_values(name: str) -> dict:
    """The values of --model_config as given, for the resume check: a preset's, a JSON file's or a folder's
    config.json (a ConfigError naming the flag and the file if it cannot be read or does not hold a JSON object),
    or a hub id's config as transformers loads it."""
    if name in PRESETS:
        return dict(PRESETS[name])
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        return _loaded_config(name, "model_config").to_dict()
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--model_config {name} is not a readable JSON file: {type(e).__name__}: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--model_config {name} must hold a JSON object (a config.json), not a "
                          f"{type(values).__name__}")
    return values


def _json_object(path: str) -> Optional[dict]:
    """A local config.json's values (None for a hub id's, or one transformers read and this cannot)."""
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return values if isinstance(values, dict) else None


def _loaded_config(name: str, flag: str):
    """transformers' config of a config.json file, a model folder or a hub id, as `from_pretrained` reads it (so
    transformers' own saved files load: `{"__float__": "Infinity"}` values, per-layer-type rope parameters); what
    keeps it from loading is a ConfigError naming the flag."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    local_or_hub(flag, name)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as e:
        # no such hub id, no or unreadable config.json, an unknown model_type, a value of the wrong type (which
        # some of transformers' validators meet as an AttributeError: `.get` on a list given for rope_parameters)
        text = " ".join(str(e).split())
        raise ConfigError(f"--{flag} {name}: transformers refuses the config: {type(e).__name__}: "
                          f"{text[:300]}") from None


def load_model_config(model: Optional[str], model_config: Optional[str], num_layers: Optional[int] = None):
    """The transformers config of --model, or of --model_config (a preset name, a config.json, a model folder or a
    hub id); tiny by default, cut to --num_layers. A config the trainer cannot run (an unsupported family, a size
    that is not a positive number) is refused here, before anything is built, by a ConfigError naming the flag."""
    from transformers import AutoConfig

    flag, name = ("model", model) if model else ("model_config", model_config or "tiny")
    raw = None
    if model:
        raw = _json_object(os.path.join(model, "config.json"))
        if raw is not None and "model_type" in raw:
            _check_model_type(raw["model_type"], f"--model {model}")
        config = _loaded_config(model, "model")
    elif name in PRESETS:
        config = AutoConfig.for_model(**PRESETS[name])
    elif os.path.isfile(name) or os.path.isfile(os.path.join(name, "config.json")):
        raw = model_config_values(name)  # a readable JSON object, or a message saying what it holds instead
        if "model_type" not in raw:
            raise ConfigError(f"--model_config {name}: the config has no model_type")
        _check_model_type(raw["model_type"], f"--model_config {name}")
        config = _loaded_config(name, "model_config")
    else:
        if not os.path.isdir(name) and not looks_like_hub_id(name):
            raise ConfigError(f"--model_config {name}: not a preset ({', '.join(PRESETS)}), a config.json, a model "
                              f"folder nor a hub id")
        config = _loaded_config(name, "model_config")  # a hub id (or a folder without a config.json: its message)
    check_model_config(config, f"--{flag} {name}", raw)
    if num_layers is not None:
        depth = config.num_hidden_layers
        if not 1 <= num_layers <= depth:  # more layers than the model has would be built and index past its lists
            raise ConfigError(f"--num_layers {num_layers}: {name} has {depth} layers; give 1 to {depth}")
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:num_layers]
    check_layers(config, f"--{flag} {name}", num_layers)
    return config


def _check_model_type(model_type, source: str) -> None:
    """A config.json's model_type, before transformers reads its values: one transformers does not know is named
    with the families the trainer trains (transformers' own message is a paragraph about upgrading); one the
    trainer does not train is refused as the kind of model it is, judged on that type's defaults, so that no value
    of a model never to be built reaches transformers' validators (which can fail on a malformed one with a
    traceback of their own)."""
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise unknown_model_type(model_type, source)
    if model_type in FAMILIES:
        return
    try:
        defaults = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - a type without defaults is judged once loaded, as before
        return
    if getattr(defaults, "text_config", None) is not None:
        return  # a multimodal wrapper: its refusal names the text model the file holds, so it is judged loaded
    try:
        family_of(defaults)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def build_model(config, model: Optional[str], dtype: torch.dtype, log: Callable[[str], None] = lambda _: None,
                quantization=None):
    """Instantiates the causal LM with Ulysses attention, its buffers as plain transformers makes them (see
    buffers.py). Call while an HfDeepSpeedConfig for ZeRO-3 is alive. `quantization`: a transformers quantization
    config for the pretrained weights (--load_in_4bit: model/adapters.py)."""
    from transformers import AutoModelForCausalLM

    if model:
        try:
            built = AutoModelForCausalLM.from_pretrained(model, config=config, dtype=dtype,
                                                         attn_implementation=ATTN_NAME,
                                                         **quantized_loading(quantization))
        except pickle.UnpicklingError:  # torch's weights_only refusal, whose advice is to turn the protection off
            raise ConfigError(f"--model {model}: {_pickle_files(model)} holds Python objects besides tensors, which "
                              f"the trainer never unpickles (loading them could run any code); from a copy you "
                              f"trust, save the weights as safetensors (save_pretrained does by default)") from None
    else:
        built = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_NAME)
    report = restore_fp32_buffers(built, dtype)
    if report.restored or report.unchecked:
        log(f"buffers: {report.describe()}")
    return built


def _pickle_files(model: str) -> str:
    """The pickled weight files of a model folder, for the refusal (the folder itself for a hub id)."""
    if not os.path.isdir(model):
        return "its pytorch_model*.bin"
    names = sorted(f for f in os.listdir(model) if f.endswith((".bin", ".pt", ".pth")))
    return ", ".join(os.path.join(model, f) for f in names) or model


def quantized_loading(quantization) -> dict:
    """from_pretrained's arguments for --load_in_4bit: the NF4 weights quantized as they load, on this rank's GPU.
    transformers builds a quantized model outside zero.Init, and its bitsandbytes quantizer places it on the current
    device; a device_map given here would be refused while ZeRO-3's HfDeepSpeedConfig lives. deepspeed.initialize
    then partitions the NF4 words like any parameter."""
    return {} if quantization is None else {"quantization_config": quantization}


@contextlib.contextmanager
def without_zero3():
    """transformers builds inside `zero.Init` while an HfDeepSpeedConfig for ZeRO-3 lives; a model built for another
    purpose (the --verify reference, a shape count on the meta device) must not be."""
    from transformers.integrations import deepspeed as hf_ds

    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved
