"""YaRN rescaling of rotary positions, with its parameters read from the model's own config.

rope_theta and the pretrained length come from the model (transformers 5 `rope_parameters`; the pretrained
length is `original_max_position_embeddings` if the model already carries one, else `max_position_embeddings`),
so nobody types them; an explicit value that contradicts the model is an error. The factor defaults to
seq_len / pretrained length. Positions are global under SP (each shard carries its global position ids), so
YaRN needs nothing more there.
"""

from __future__ import annotations

from typing import Optional

from ..errors import ConfigError

ROPE_SCALINGS = ("none", "yarn")


def configure_rope(config, mode: str, seq_len: int, factor: Optional[float] = None, theta: Optional[float] = None,
                   original: Optional[int] = None) -> dict:
    """Updates `config.rope_parameters` in place for --rope_scaling; returns the final rope parameters."""
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    params = dict(config.rope_parameters or {})
    model_theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    model_original = params.get("original_max_position_embeddings") or config.max_position_embeddings
    if theta is not None and model_theta is not None and float(theta) != float(model_theta):
        raise ConfigError(f"--rope_theta {theta} contradicts the model's rope_theta {model_theta}: "
                          f"leave --rope_theta out, it is read from the model config")
    if original is not None and int(original) != int(model_original):
        raise ConfigError(f"--rope_original_max_positions {original} contradicts the model's pretrained length "
                          f"{model_original}: leave it out, it is read from the model config")
    if mode == "none":
        if factor is not None:
            raise ConfigError("--rope_factor needs --rope_scaling yarn")
        return params
    if mode != "yarn":
        raise ConfigError(f"--rope_scaling {mode}: choose one of {', '.join(ROPE_SCALINGS)}")
    if factor is None:
        factor = max(1.0, seq_len / model_original)
    if factor < 1.0:
        raise ConfigError(f"--rope_factor {factor} must be >= 1 (it stretches the pretrained length)")
    yarn = {k: v for k, v in params.items() if k in ("partial_rotary_factor",)}
    yarn.update(rope_type="yarn", rope_theta=model_theta, factor=float(factor),
                original_max_position_embeddings=int(model_original))
    config.rope_parameters = yarn
    config.max_position_embeddings = max(int(model_original * factor), seq_len)
    return yarn
