"""What a decoder layer that is not checkpointed (`--checkpoint_layers N` leaves the last layers so) keeps for its
backward, per rank: the memory estimate's term for those layers (levers/memory.py) and the saving the time model books
for them (levers/time_model.py: no recompute).

Counted op by op through a Qwen3/Llama layer as transformers runs it under our levers, in elements per token of the
rank (b bytes each, the activation dtype):

| tensor | elements | saved by |
|---|---|---|
| layer input x | H | the input norm (lean or fused: its input and one fp32 number per row) |
| normed x | H | q, k, v projections |
| q, k before their norms (Qwen3) | A + KV | the q and k norms |
| q, k, v as the kernel gets them | A + 2 KV' | the attention kernel (KV' = KV heads after replication for sp > KV) |
| attention output | A | the kernel (its output, with an fp32 log-sum-exp per head) and the output projection; with
  sp > 1 the all-to-all makes a second copy (+A) |
| h = x + attention | H | the post-attention norm |
| normed h | H | gate and up projections (and the tiled MLP, which saves nothing else) |
| MLP | 4 I: gate, silu(gate), up, product; 3 I with the fused SwiGLU (no silu(gate)); 0 with the tiled MLP | silu, the
  product, the down projection |

plus per row fp32: the four norms' (2 + heads + KV heads) and the log-sum-exp (heads). Without the lean norms each
norm also keeps an fp32 copy of its input (4 bytes per element: 2H + A + KV). Rotary saves only cos and sin, shared
by all layers. Checked on CPU by counting every allocation alive after a forward (tests/unit/test_plan.py), with and
without the lean norms, the fused kernels and the tiled MLP; on the GPU against partial-checkpointing peaks
(docs/memory.md).

Gemma also normalises the attention's and the MLP's outputs before adding them (four hidden norms, `norms` in the
geometry): each extra norm keeps its H-wide input and a row statistic, so the hidden-width terms are (2 + norms) H,
checked on CPU the same way for Gemma 3. A Gated DeltaNet layer (Qwen3.5, Qwen3-Next) is counted by hand through
transformers' layer and not yet checked against allocations: x and the normed x, the fused q, k, v projection's
output, the convolution's output and its SiLU (3 x (2 key + value) wide), the output gate z, the recurrence's
output and its gated norm (3 x value), then h, the normed h and the MLP as above.
"""

from __future__ import annotations


def _kernel_kv_width(g: dict, levers, sp: int) -> int:
    """Width of k (and of v) as the attention kernel gets them: KV heads replicated up to sp (sp/attention.py), or
    copied to every query head without native GQA."""
    return max(g["kv"], sp) * g["head_dim"] if levers.gqa_native else g["attn_width"]


def _linear_attention(span) -> bool:
    return span is not None and not span.attention


def kept_layer_bytes(g: dict, tokens: int, act_bytes: int, levers, sp: int = 1, span=None) -> float:
    """Bytes one rank keeps for the backward of one layer that is not checkpointed, `tokens` tokens on the rank;
    `span` (model/geometry.py): the layer's, for a Gated DeltaNet layer (default: an attention layer)."""
    mlp = 0 if levers.tiled_mlp else (3 if levers.fused_kernels else 4) * g["inter"]
    hidden = (2 + g["norms"]) * g["hidden"]  # x and h, and each hidden norm's input
    if _linear_attention(span):
        d = g["linear_attn"]
        elements = hidden + 3 * d["conv_width"] + 3 * d["value_width"] + mlp
        normed = g["norms"] * g["hidden"]
        row_floats = g["norms"] + d["value_heads"]
    else:
        kernel_kv = _kernel_kv_width(g, levers, sp)
        qk_norm = g["attn_width"] + g["kv_width"] if g["qk_norm"] else 0
        out = g["attn_width"] * (2 if sp > 1 else 1)
        elements = hidden + qk_norm + g["attn_width"] + 2 * kernel_kv + out + mlp
        normed = g["norms"] * g["hidden"] + qk_norm
        row_floats = g["norms"] + (g["heads"] + g["kv"]) * g["qk_norm"] + g["heads"]  # norms' rows, log-sum-exp
    norm_copies = 0 if levers.lean_norm else normed  # transformers' norms keep an fp32 copy of their input
    return tokens * (elements * act_bytes + 4 * (row_floats + norm_copies))


def uncheckpointed_backward_bytes(g: dict, tokens: int, act_bytes: int, levers, sp: int = 1,
                                 tile_tokens: int = 16384, span=None) -> float:
    """Bytes an uncheckpointed layer's backward allocates on top of what it keeps: the gradients of its hidden
    states (in and out), and the larger of attention's (dq, dk, dv as the kernel gets them, and an fp32 dq
    accumulator) and the MLP's (the product's, gate's and up's gradients, one tile at a time with the tiled MLP;
    silu(gate)'s too without the fused SwiGLU). A DeltaNet layer's mixer: the gradients of its projections' outputs
    (q, k, v and z) and of its recurrence's output (a guess by the same count). No recompute: that is the layer
    working set of a checkpointed layer, which runs only after every uncheckpointed layer has freed its
    activations."""
    if _linear_attention(span):
        d = g["linear_attn"]
        mixer = tokens * (d["conv_width"] + 2 * d["value_width"]) * act_bytes
    else:
        kernel_kv = _kernel_kv_width(g, levers, sp)
        mixer = tokens * ((g["attn_width"] + 2 * kernel_kv) * act_bytes + g["attn_width"] * 4)
    mlp_rows = min(tokens, tile_tokens) if levers.tiled_mlp else tokens
    mlp = (3 if levers.fused_kernels else 4) * mlp_rows * g["inter"] * act_bytes
    return 2 * tokens * g["hidden"] * act_bytes + max(mixer, mlp)
