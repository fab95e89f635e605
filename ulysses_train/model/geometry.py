"""The sizes of a model that memory, time and the lever policy depend on, read from its transformers config.

Every decoder layer is counted on its own (`layer_shapes`), because the families the trainer runs mix layers:
sliding-window and full layers (Gemma 2/3/4, OLMo 3, GPT-OSS, Mistral), chunked and NoPE layers (Llama 4), Gated
DeltaNet and gated-attention layers (Qwen3.5, Qwen3-Next), wider global heads and KV-shared layers (Gemma 4), dense
and MoE layers interleaved (Llama 4). The scalar keys summarise the layers for the memory model, which plans for the
peak: widths are the largest layer's (`heads`, `kv`, `head_dim` are the widest attention layer's), `layer_params` is
the largest layer (what ZeRO-3 gathers), `params` is the exact total and `matmul_params` the mean per layer.

Sparse MoE layers count every expert's weights in the parameters, and for what one token computes and keeps only
the experts it goes to (and a shared expert where there is one): `inter` is then experts per token x the expert's
width (+ the shared expert's). Which layers attend how comes from the trainer's own support table (sp/support.py),
so the planner and the trainer never disagree on it: `attn_spans` holds one `Span` per layer. What a family's
modeling file adds that its config does not say (a gated query, q and k norms, Gemma's four norms a layer, sinks, the
kind of MLP block) is its record's (ulysses_train/families/).

Checked against `sum(p.numel())` of models built from tiny configs of every family (tests/unit/test_geometry.py).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from ..families import FAMILIES
from ..sp.support import layer_mixers


class Span(NamedTuple):
    """What a layer's token mixer reaches: `full` causal attention, a sliding `window` of `size` keys (itself
    included), causal attention within `chunk`s of `size` positions, or a layer that does not attend at all (its
    layer type, e.g. `linear_attention`)."""

    kind: str
    size: Optional[int] = None

    @property
    def attention(self) -> bool:
        return self.kind in ("full", "window", "chunk")


class LayerShape(NamedTuple):
    """One decoder layer: its span, its attention heads (0 for a layer that does not attend), its parameters and
    what one token multiplies through it."""

    span: Span
    heads: int
    kv: int
    head_dim: int
    params: int
    matmul_params: int  # the token mixer's projections and the MLP's share a token goes through
    mlp_matmul_params: int
    inter: int  # intermediate width a token goes through (its experts' and the shared expert's in a MoE)
    moe: bool
    # the outputs of the token mixer's input projections, per token, that --keep_projections keeps
    # (levers/projections.py): q, k, v where the layer has them, a DeltaNet layer's q, k, v, z, b, a; 0 with biases
    input_projection_width: int = 0

    @property
    def attn_width(self) -> int:
        return self.heads * self.head_dim


def _span(mixer) -> Span:
    if not mixer.attention:
        return Span(mixer.kind)
    if mixer.window:
        return Span("window", mixer.window)
    return Span("chunk", mixer.chunk) if mixer.chunk else Span("full")


def _layer_config(config, index: int):
    """Layer `index`'s view of a heterogeneous config (Gemma 4's global layers: their own head_dim, KV heads)."""
    per_layer = getattr(config, "per_layer_config", None)
    return per_layer[index] if per_layer is not None else config


def _kv_shared(config, index: int) -> bool:
    """Gemma 4's last layers reuse an earlier layer's k and v and have no k, v projections of their own."""
    modes = getattr(config, "kv_sharing_modes", None) if getattr(config, "num_kv_shared_layers", 0) else None
    return bool(modes) and modes[index] == "reuse"


def _attention(config, index: int) -> tuple[int, int, int, int, int, int]:
    """(parameters, matmul parameters, heads, KV heads, head_dim, the width of its q, k and v projections' outputs
    or 0 where they have biases) of layer `index`'s attention."""
    lc, h, family = _layer_config(config, index), config.hidden_size, FAMILIES[config.model_type]
    q = config.num_attention_heads
    d = getattr(lc, "head_dim", None) or h // q
    kv = getattr(lc, "num_key_value_heads", None) or q
    q_out = q * d * (2 if family.gated_query else 1)
    # Gemma 4: KV-shared layers have neither k nor v; with attention_k_eq_v the global layers' v is their k
    k_eq_v = getattr(config, "attention_k_eq_v", False) and config.layer_types[index] != "sliding_attention"
    kv_out = 0 if _kv_shared(config, index) else kv * d * (1 if k_eq_v else 2)
    matmul = h * (q_out + kv_out) + q * d * h
    if family.qkv_bias:
        bias = q_out + kv_out
    else:
        bias = q_out + kv_out + h if getattr(config, "attention_bias", False) else 0
    if family.qk_norm == "head":
        norms = d + (d if kv_out else 0)
    else:
        norms = q * d + kv * d if family.qk_norm == "wide" else 0
    sinks = q if family.sinks else 0  # one learned logit per head
    return matmul + bias + norms + sinks, matmul, q, kv, d, 0 if bias else q_out + kv_out


def _deltanet(config) -> tuple[int, int, int]:
    """(parameters, matmul parameters, the width of its input projections' outputs) of a Gated DeltaNet mixer
    (Qwen3.5 and Qwen3-Next: the same weights, fused differently): q, k, v, the output gate z and the per-head beta
    and decay a from the hidden state, a causal depthwise convolution over q, k and v, per-head dt bias and A, a
    gated RMSNorm per value head, the output."""
    h, nv = config.hidden_size, config.linear_num_value_heads
    key = config.linear_num_key_heads * config.linear_key_head_dim
    value = nv * config.linear_value_head_dim
    conv = 2 * key + value
    matmul = h * (conv + value + 2 * nv) + value * h
    inputs = conv + value + 2 * nv
    return matmul + conv * config.linear_conv_kernel_dim + 2 * nv + config.linear_value_head_dim, matmul, inputs


def linear_attention_dims(config) -> Optional[dict]:
    """The Gated DeltaNet sizes the time and memory models need, or None for a model without such layers."""
    if not hasattr(config, "linear_num_value_heads"):
        return None
    key = config.linear_num_key_heads * config.linear_key_head_dim
    value = config.linear_num_value_heads * config.linear_value_head_dim
    return dict(value_heads=config.linear_num_value_heads, key_head_dim=config.linear_key_head_dim,
                value_head_dim=config.linear_value_head_dim, conv_width=2 * key + value, value_width=value,
                conv_kernel=config.linear_conv_kernel_dim)


def _experts(h: int, experts: int, per_token: int, inter: int, shared: int = 0, biased: bool = False):
    """(parameters, matmul parameters, intermediate width per token) of a sparse MoE block: SwiGLU experts of
    `inter` (GPT-OSS's with biases), a router, and a `shared` expert that every token goes through (Qwen3-Next and
    Qwen3.5-MoE gate it with one more projection to a scalar)."""
    expert = 3 * h * inter + (2 * inter + h if biased else 0)
    router = h * experts + (experts if biased else 0)
    shared_params = 3 * h * shared + h if shared else 0
    params = experts * expert + router + shared_params
    matmul = per_token * 3 * h * inter + h * experts + shared_params
    return params, matmul, per_token * inter + shared


def _sparse(config, index: int) -> bool:
    """Qwen3-MoE and Qwen3-Next: MoE every `decoder_sparse_step` layers except `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return index not in (getattr(config, "mlp_only_layers", None) or []) and (index + 1) % step == 0


def _mlp(config, index: int) -> tuple[int, int, int, bool]:
    """(parameters, matmul parameters, intermediate width per token, sparse) of layer `index`'s MLP, a block of the
    kind its family's record names (families/record.py: `mlp`)."""
    h, kind = config.hidden_size, FAMILIES[config.model_type].mlp
    if kind == "biased_experts":
        return (*_experts(h, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                          biased=True), True)
    if kind == "moe_layers":
        if index in config.moe_layers:  # routed experts and a shared expert, both of intermediate_size
            params, matmul, inter = _experts(h, config.num_local_experts, config.num_experts_per_tok,
                                             config.intermediate_size)
            dense = 3 * h * config.intermediate_size
            return params + dense, matmul + dense, inter + config.intermediate_size, True
        return (*_dense(h, config.intermediate_size_mlp), False)
    if kind == "dense" and _declares_experts(config) and _sparse(config, index):
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        return (*_experts(h, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                          shared), True)
    inter = config.intermediate_size
    if kind == "dense_beside_experts" and config.use_double_wide_mlp and _kv_shared(config, index):
        inter *= 2
    params, matmul, width = _dense(h, inter, getattr(config, "mlp_bias", False))
    if kind == "dense_beside_experts" and config.enable_moe_block:  # experts beside the dense MLP, outputs added
        e = config.num_experts
        moe = _experts(h, e, config.top_k_experts, config.moe_intermediate_size)
        # the router's input scale and per-expert scales, and three more norms around the experts
        return params + moe[0] + h + e + 3 * h, matmul + moe[1], width + moe[2], True
    return params, matmul, width, False


def _declares_experts(config) -> bool:
    """Whether the family's config class has routed experts (`num_experts`) and this config sets some: a stray
    `num_experts` key in a dense family's config.json builds a dense model in transformers, and is counted so."""
    fields = getattr(type(config), "__dataclass_fields__", None)
    declared = "num_experts" in fields if fields is not None else hasattr(config, "num_experts_per_tok")
    return declared and bool(getattr(config, "num_experts", 0) or 0)


def _dense(h: int, inter: int, bias: bool = False) -> tuple[int, int, int]:
    return 3 * h * inter + (2 * inter + h if bias else 0), 3 * h * inter, inter


def hidden_norms(config) -> int:
    """The RMSNorms of hidden width each token passes through in a decoder layer."""
    return FAMILIES[config.model_type].hidden_norms


def _per_layer_input(config) -> int:
    """Gemma 4's per-layer embedding width (0 without): each layer gates it in through two small projections."""
    if not FAMILIES[config.model_type].per_layer_input:
        return 0
    return getattr(config, "hidden_size_per_layer_input", 0) or 0


def _layer(config, index: int, mixer) -> LayerShape:
    span, h = _span(mixer), config.hidden_size
    if span.attention:
        mixer_params, mixer_matmul, heads, kv, head_dim, inputs = _attention(config, index)
    else:
        (mixer_params, mixer_matmul, inputs), heads, kv, head_dim = _deltanet(config), 0, 0, 0
    mlp_params, mlp_matmul, inter, moe = _mlp(config, index)
    norms = hidden_norms(config) * h
    ple = _per_layer_input(config)
    # the gate and projection of the per-layer input, its norm, and this layer's share of the model's projection
    # from the hidden state to every layer's input (a matmul each token goes through, counted at the model level)
    ple_params, ple_matmul = (2 * h * ple + h, 3 * h * ple) if ple else (0, 0)
    return LayerShape(span, heads, kv, head_dim, mixer_params + mlp_params + norms + ple_params,
                      mixer_matmul + mlp_matmul + ple_matmul, mlp_matmul, inter, moe, inputs)


def _model_params(config) -> int:
    """Embeddings, the head unless tied, the final norm, and Gemma 4's per-layer embeddings and their projection."""
    h, v = config.hidden_size, config.vocab_size
    params = v * h * (1 if config.tie_word_embeddings else 2) + h
    ple = _per_layer_input(config)
    if ple:
        width = config.num_hidden_layers * ple
        params += config.vocab_size_per_layer_input * width + h * width + ple
    return params


def _attention_summary(shapes: list[LayerShape]) -> dict:
    """The attention sizes the memory model plans with: the largest of any layer's."""
    attending = [s for s in shapes if s.heads]
    widest = max(attending, key=lambda s: s.attn_width)
    return dict(heads=widest.heads, kv=widest.kv, head_dim=widest.head_dim,
                attn_width=max(s.attn_width for s in attending), kv_width=max(s.kv * s.head_dim for s in attending))


def geometry(config) -> dict:
    shapes = [_layer(config, i, m) for i, m in enumerate(layer_mixers(config))]
    n = len(shapes)
    moe = [s for s in shapes if s.moe]
    experts = max((getattr(config, name, 0) or 0 for name in ("num_experts", "num_local_experts")), default=0)
    per_token = (getattr(config, "top_k_experts", None) or getattr(config, "num_experts_per_tok", 1)) if moe else 1
    return dict(model_type=config.model_type, hidden=config.hidden_size, inter=max(s.inter for s in shapes),
                vocab=config.vocab_size, layers=n, **_attention_summary(shapes),
                qk_norm=bool(FAMILIES[config.model_type].qk_norm),
                norms=hidden_norms(config), layer_params=max(s.params for s in shapes),
                params=sum(s.params for s in shapes) + _model_params(config),
                # what one token multiplies through per layer, on average over the layers (all of a dense layer;
                # its experts' share of a MoE)
                matmul_params=sum(s.matmul_params for s in shapes) / n,
                mlp_matmul_params=sum(s.mlp_matmul_params for s in shapes) / n,
                experts=experts if moe else 0, experts_per_token=per_token,
                attn_spans=[s.span for s in shapes], layer_shapes=shapes,
                linear_attn=linear_attention_dims(config) if any(not s.heads for s in shapes) else None)
