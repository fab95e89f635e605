"""Plain attention in a few lines of torch, the references the attention kernels are checked against: causal GQA
attention, the same inside packed documents (with its gradients), and the sliding-window, sink and softcap patterns
as the families' eager code computes them."""

import torch
import torch.nn.functional as F


def causal_attention(q, k, v):
    """Single process, whole sequence: GQA by repeating KV heads, causal softmax attention.
    q (b, h, s, d), k/v (b, hkv, s, d) -> out (b, s, h, d)."""
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)  # (b, s, h, d)


def doc_ids(lengths):
    """Documents' lengths per batch row -> each token's document index, (b, s)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def masked_attention(q, k, v, docs=None, scale=0.3):
    """q (b, s, h, d), k/v (b, s, hkv, d) -> out (b, s, h, d): causal, inside documents when `docs` is given."""
    s = q.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None]
    if docs is not None:
        ids = doc_ids(docs).to(q.device)
        mask = mask & (ids[:, :, None] == ids[:, None, :])[:, None]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def masked_attention_with_grads(q, k, v, dout, docs, scale=0.3):
    """`masked_attention`'s output and dq, dk, dv for the output gradient `dout` (b, s, h, d)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = masked_attention(q, k, v, docs, scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def pattern_attention(q, k, v, docs, window, softcap, sinks, scale):
    """The attention every family's eager code computes, on the whole (b, h, s, d) row, with the documents apart:
    k/v (b, hkv, s, d), `docs` the documents' lengths, a sliding `window`, a logit `softcap` and per-head `sinks`
    (each optional) -> out (b, s, h, d)."""
    s = q.shape[2]
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs)).to(q.device)
    i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None]
    keep = (j <= i) & (doc[:, None] == doc[None])
    if window:
        keep &= j > i - window
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    return (torch.softmax(scores, dim=-1)[..., :s] @ v).transpose(1, 2)
