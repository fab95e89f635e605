"""The model config's own values, checked once it is loaded and before anything is built.

transformers checks a config's types, not its values: a config.json with `num_attention_heads: -8` loads and fails
later inside torch, and a top-level `rope_theta: Infinity` beside `rope_parameters` is dropped without a word. So the
trainer, `--verify`, the planner and `eval_positions` (every caller of `load_model_config`) refuse here, by field:
an unsupported family (sp/support.py: `family_of` says which kind of model it is), a size, length or window that is
not a positive whole number, and a rotary base or factor that is not a positive finite number.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

from ..errors import ConfigError
from ..families import FAMILIES, RECORDS
from ..sp.support import family_of, layer_mixers

# counts and lengths: a positive whole number where the config sets them (None: the family's own default); every
# family's own keys (its record's `size_keys`) are checked in any config, since transformers keeps a stray key
COMMON_SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "sliding_window")
POSITIVE_INTS = tuple(dict.fromkeys(COMMON_SIZES + sum((r.size_keys for r in RECORDS), ())))
# sizes that null means something for in some families: no window, the width derived from the heads, KV heads as
# many as the query heads
NULLABLE_SIZES = ("sliding_window", "head_dim", "num_key_value_heads")
# rotary parameters that must be positive and finite where they are set
POSITIVE_ROPE = ("rope_theta", "factor", "original_max_position_embeddings", "attention_factor")


def check_model_config(config, source: str, raw: Optional[dict] = None) -> None:
    """A ConfigError (one line, starting with `source`, e.g. "--model_config x.json") for the first value of
    `config` the trainer cannot run; `raw`: the config.json's own values, where there is one (transformers drops a
    top-level rope_theta when rope_parameters is there)."""
    try:
        family_of(config)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    for where, view in _views(config):
        for name in POSITIVE_INTS:
            value = _value(view, name)
            if value is not None and not _positive_int(value):
                raise ConfigError(f"{source}: {where}{name} is {value!r}; it must be a positive whole number")
    nulled = _nulled_size(config)
    if nulled is not None:
        raise ConfigError(f"{source}: {nulled[0]} is None; it must be a positive whole number (the model type's "
                          f"default is {nulled[1]!r})")
    _check_padding_token(config, source)
    theta = (raw or {}).get("rope_theta")
    for where, params in _rope_parameter_sets(config, theta):
        for key in POSITIVE_ROPE:
            value = params.get(key)
            if value is not None and not _positive_finite(value):
                raise ConfigError(f"{source}: {where}{key} is {value!r}; it must be a positive finite number")
    used = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if theta is not None and used is not None and theta != used:
        raise ConfigError(f"{source}: rope_theta {theta!r} differs from rope_parameters.rope_theta {used!r}, which "
                          f"transformers uses: give one of them")


def _check_padding_token(config, source: str) -> None:
    """The embedding's padding row must be one of its rows: transformers warns about a pad_token_id outside the
    vocabulary, then torch fails to build the embedding (SmolLM3's default, 128004, with a smaller vocabulary)."""
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if pad is None or not _positive_int(vocab):
        return
    if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < vocab:
        raise ConfigError(f"{source}: pad_token_id is {pad!r}, not a token of its {vocab:,}-token vocabulary: give "
                          f"it a token id below {vocab} or null")


def _nulled_size(config) -> Optional[tuple[str, int]]:
    """(name, default) of a size the config sets to null (JSON's null, kept by transformers as None) where its
    model type has a number by default: the model would be built without it. Not the sizes that null means "derive
    it" or "none" for in some families (the window, the head width, the KV heads)."""
    try:
        defaults = type(config)()
    except Exception:  # noqa: BLE001 - a config class without defaults: nothing to compare with
        return None
    for name in POSITIVE_INTS:
        if name in NULLABLE_SIZES:
            continue
        try:
            value = getattr(config, name, 0)  # 0: not a key of this config
        except (ValueError, RuntimeError):  # differs between layers: checked per layer above
            continue
        default = getattr(defaults, name, None)
        if value is None and isinstance(default, int):
            return name, default
    return None


def check_layers(config, source: str, cut: Optional[int] = None) -> None:
    """Every layer's type is one the trainer knows, and at least one layer attends: the memory and time models,
    the attention kernel and the sequence-parallel layout are planned from the attention layers, and a model of
    linear-attention layers only (Qwen3.5's pattern cut to fewer layers than its first full-attention one) has
    none. `cut`: the --num_layers that cut it, named when it is the cause."""
    try:
        mixers = layer_mixers(config)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    if not any(m.kind == "attention" for m in mixers):
        kinds = ", ".join(sorted({m.kind for m in mixers}))
        remedy = "give --num_layers a larger number" if cut else "give layer_types a full_attention layer"
        raise ConfigError(f"{source}{f' cut to --num_layers {cut}' if cut else ''}: none of its {len(mixers)} layers "
                          f"is an attention layer (all {kinds}), which the trainer plans its sequence parallelism "
                          f"from: {remedy}")


def unknown_model_type(model_type: str, source: str) -> ConfigError:
    """A model_type that transformers does not know: one line naming it and the families the trainer trains."""
    return ConfigError(f"{source}: model_type {model_type!r} is not a model type transformers "
                       f"knows (a typo, or a newer transformers'?); the trainer trains {', '.join(FAMILIES)}")


def _views(config) -> Iterator[tuple[str, Any]]:
    """The config, then each layer's view of it where layers differ (Gemma 4's per_layer_config)."""
    yield "", config
    per_layer = _value(config, "per_layer_config")
    if per_layer is not None:
        for index in range(config.num_hidden_layers):
            yield f"layer {index}: ", per_layer[index]


def _value(config, name: str):
    """`config.name`, or None where it is unset or differs between layers (a heterogeneous config refuses to give
    one value for them: its layers' views are checked one by one)."""
    try:
        return getattr(config, name, None)
    except (AttributeError, ValueError, RuntimeError):  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _rope_parameter_sets(config, theta) -> Iterator[tuple[str, dict[str, Any]]]:
    """(a prefix naming where, the parameters) for the top-level rope_theta and each set of rope_parameters (one, or
    one per layer type)."""
    if theta is not None:
        yield "", {"rope_theta": theta}
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params, dict):
        return
    if all(isinstance(v, dict) for v in params.values()) and params:
        for layer_type, sub in params.items():
            yield f"rope_parameters.{layer_type}.", sub
    else:
        yield "rope_parameters.", params


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
