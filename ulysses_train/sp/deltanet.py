"""Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) exact under Ulysses, by the same head all-to-all as
attention.

A DeltaNet mixer never passes through the attention interface. Its causal depthwise conv reads the last few
positions, and its recurrence the state of every position before, so on a rank's shard alone both would start
from zeros where the shard starts. Both are per head, though (the conv's channels are the q, k and v channels of one
head each; the recurrence of a value head reads its own key head only), so the Ulysses cut works unchanged: each rank
runs them over the whole sequence for a subset of heads.

    hidden (b, s/sp, H) -> the module's own projections on the shard
      q, k (b, s/sp, nk, dk), v (b, s/sp, nv, dv); z (b, s/sp, nv, dv) stays here;
      g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) (b, s/sp, nv), on the shard with every head
      -> [replicate key heads if nk < sp] -> all-to-all -> q, k (b, s, nk/sp or 1, dk), v (b, s, nv/sp, dv), g, beta
      -> causal conv with this rank's channels of the conv weight -> the chunked gated delta rule -> (b, s, nv/sp, dv)
      -> all-to-all -> (b, s/sp, nv, dv) -> the gated norm with z -> out_proj

Why g and beta are made before the all-to-all, and the norm after it: both are elementwise per position and head,
so they give the same numbers on either side, and on the shard they need the whole `A_log`, `dt_bias` and norm
weight rather than this rank's slice of them; z never moves.

Packed documents (`--packing`) restart both the conv and the recurrence at each document, as if each ran alone
(transformers' torch fallback ignores the `cu_seqlens` its layer passes, so plain transformers on a packed row lets
the state flow across documents; the reference is each document run alone). The document lengths are the
attention's (`UlyssesAttention.doc_lengths`, set per batch):
- the conv: FLA's takes the documents as `cu_seqlens`; with the modeling file's, each document's channels get K-1
  zeros in front of them, the whole batch as one row, then the module's own kernel, then the inserted positions
  dropped: every output is the one its document alone gives, bit for bit;
- the recurrence: FLA's kernel takes the documents as `cu_seqlens` (the batch flattened to one row); the torch
  rule runs document by document.

The conv's and the rule's kernels are the run's `--linear_kernel` (linear_kernel.py: FLA's on CUDA, the rule through
our op so checkpointing can keep its output; or the modeling file's conv and torch rule), so the mixer is installed on
every DeltaNet layer, at SP=1 and unpacked too (the all-to-alls are then the identity, and Qwen3.5's conv reads its
`in_proj_qkv` output as it is: q, k and v travel joined, in the conv's channel order, from the projection or the
all-to-all to the conv).

Head blocks are contiguous, as in attention.py: rank r holds value heads [r*nv/sp, (r+1)*nv/sp). transformers
gives value head j the key head j // (nv/nk) (`repeat_interleave` in its gated delta rule), so these value heads
read key heads [r*nk/sp, (r+1)*nk/sp) when sp divides nk, or the one key head r // (sp/nk) when nk divides sp, which
is replicated sp/nk times before the all-to-all (the rule of attention's KV heads). Gradients: each rank's slice of
the conv weight gets the gradient of its heads over the whole sequence, zeros elsewhere, so the sum over the SP
group (what the trainer's reduction makes) is the whole weight's gradient; a replicated key head's two ranks each
add the part of its own value heads.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .all_to_all import all_to_all, group_size
from .linear_kernel import LinearKernel

# what the SP forward reads from a transformers DeltaNet module, and from its modeling file
MODULE_ATTRIBUTES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv1d",
                     "activation",
                     "A_log", "dt_bias", "norm", "out_proj")
LAYOUTS = {"qkv, z, b, a": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # Qwen3.5
           "qkvz, ba": ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")}  # Qwen3-Next
KERNELS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")


def layout_of(module: nn.Module) -> str:
    """Which projections the module has, or a TypeError naming what is missing and the transformers version."""
    missing = [a for a in MODULE_ATTRIBUTES if not hasattr(module, a)]
    layout = next((name for name, attrs in LAYOUTS.items() if all(hasattr(module, a) for a in attrs)), None)
    source = sys.modules.get(type(module).__module__)
    missing += [f"{type(module).__module__}.{k}" for k in KERNELS if not hasattr(source, k)]
    if missing or layout is None:
        import transformers

        what = ", ".join(missing) or "none of the known in-projections (" + "; ".join(LAYOUTS) + ")"
        raise TypeError(f"{type(module).__name__} of transformers {transformers.__version__} lacks {what}: the "
                        f"sequence-parallel DeltaNet mixer (sp/deltanet.py) does not know this version's layer")
    return layout


def rank_heads(nk: int, nv: int, sp: int, rank: int) -> tuple[range, range]:
    """(key heads, value heads) of `rank`, as the all-to-all cuts them (the module docstring's rule)."""
    if nv % sp or (nk % sp and sp % nk):
        raise ValueError(f"{nk} key and {nv} value heads cannot be cut for sp={sp} (sp/support.py checks this)")
    values = range(rank * nv // sp, (rank + 1) * nv // sp)
    if nk % sp == 0:
        return range(rank * nk // sp, (rank + 1) * nk // sp), values
    first = rank // (sp // nk)
    return range(first, first + 1), values


def _project(self, hidden: torch.Tensor):
    """The module's in-projections on the shard: q, k (b, s/sp, nk, dk), v and z (b, s/sp, nv, dv), b and a
    (b, s/sp, nv), in transformers' channel order (that of the conv weight); and q, k, v joined as the conv reads
    them (b, s/sp, 2 nk dk + nv dv) where the projection writes them so (Qwen3.5's `in_proj_qkv`), else None."""
    batch, length, _ = hidden.shape
    if self._sp_layout == "qkvz, ba":
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
        return q, k, v, z, b, a, None
    qkv = self.in_proj_qkv(hidden)
    q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    heads = (batch, length, -1)
    return (q.reshape(*heads, self.head_k_dim), k.reshape(*heads, self.head_k_dim),
            v.reshape(*heads, self.head_v_dim), self.in_proj_z(hidden).reshape(*heads, self.head_v_dim),
            self.in_proj_b(hidden), self.in_proj_a(hidden), qkv)


def heads_to_sequence(parts: list[torch.Tensor], group) -> torch.Tensor:
    """(b, s/sp, h_i, d_i) each -> (b, s, W): this rank's block of heads of every part (h_i/sp of them) over the
    whole sequence, joined in the parts' order along the last dimension, in one all-to-all (every part's block for
    rank j travels in one message to rank j, one collective rather than one per tensor)."""
    sp = group_size(group)
    batch, length = parts[0].shape[:2]
    blocks = [p.reshape(batch, length, sp, -1) for p in parts]  # (b, s/sp, sp, h_i/sp * d_i)
    gathered = all_to_all(torch.cat(blocks, dim=-1), group, scatter_dim=2, gather_dim=1)  # (b, s, 1, W)
    return gathered.reshape(batch, length * sp, -1)


def _conv_channels(self, keys: range, values: range) -> torch.Tensor:
    """Indices of this rank's channels in the conv over [q | k | v]: its key heads' q and k, its value heads' v."""
    dk, dv = self.head_k_dim, self.head_v_dim
    q = torch.arange(keys.start * dk, keys.stop * dk)
    v = torch.arange(values.start * dv, values.stop * dv) + 2 * self.key_dim
    return torch.cat([q, q + self.key_dim, v]).to(self.conv1d.weight.device)


def document_starts(doc_lengths: list[list[int]], length: int) -> torch.Tensor:
    """Where each document starts in the batch flattened to one row, (n_docs,) int64: row r's documents at
    r * length + their offsets. Zero-length documents are dropped."""
    starts = []
    for row, lengths in enumerate(doc_lengths):
        if sum(lengths) != length:
            raise ValueError(f"doc_lengths of row {row} cover {sum(lengths)} positions, the sequence has {length}")
        offset = row * length
        for n in lengths:
            if n:
                starts.append(offset)
            offset += n
    return torch.tensor(starts, dtype=torch.long)


def _conv_by_document(conv, mixed: torch.Tensor, weight, bias, activation, starts: torch.Tensor) -> torch.Tensor:
    """The causal conv of each document alone: K-1 zeros before every document, one row, the module's kernel, the
    inserted positions dropped. mixed (b, C, s) -> (b, C, s)."""
    batch, channels, length = mixed.shape
    pad = weight.shape[-1] - 1
    flat = mixed.transpose(0, 1).reshape(channels, batch * length)  # (C, b*s)
    # position i of the flat row moves right by pad for every document starting at or before it
    shift = torch.zeros(batch * length, dtype=torch.long)
    shift[starts] = pad
    where = (torch.arange(batch * length) + shift.cumsum(0)).to(mixed.device)
    spread = flat.new_zeros(channels, batch * length + pad * len(starts)).index_copy(1, where, flat)
    out = conv(spread.unsqueeze(0), weight, bias, activation=activation)[0].index_select(1, where)  # (C, b*s)
    return out.reshape(channels, batch, length).transpose(0, 1)


def _document_bounds(starts: torch.Tensor, total: int) -> torch.Tensor:
    """The documents' start offsets and the flattened batch's length: FLA's `cu_seqlens` (int64, on the CPU)."""
    return torch.cat([starts, torch.tensor([total])])


def _rule_by_document(kernel: LinearKernel, rule, q, k, v, g, beta, starts: torch.Tensor) -> torch.Tensor:
    """The gated delta rule restarting at every document: q, k (b, s, nk, dk), v (b, s, nv, dv), g, beta (b, s, nv)
    -> (b, s, nv, dv). FLA's kernel in one call over the flattened batch; the torch rule per document."""
    batch, length = q.shape[:2]
    flat = [x.reshape(1, batch * length, *x.shape[2:]) for x in (q, k, v, g, beta)]
    bounds = _document_bounds(starts, batch * length)
    options = dict(initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    if kernel.takes_documents:
        out, _ = rule(*flat[:3], g=flat[3], beta=flat[4], cu_seqlens=bounds.to(q.device), **options)
    else:
        pieces = [rule(*(x[:, a:b] for x in flat[:3]), g=flat[3][:, a:b], beta=flat[4][:, a:b], **options)[0]
                  for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        out = torch.cat(pieces, dim=1)
    return out.reshape(batch, length, *out.shape[2:])


def _conv(self, mixed: torch.Tensor, weight, bias, starts: Optional[torch.Tensor]) -> torch.Tensor:
    """The causal depthwise conv over this rank's channels, (b, s, C_r) -> (b, s, C_r): FLA's where the run's linear
    kernel has it (restarting at `cu_seqlens`), else the modeling file's (each document alone: _conv_by_document)."""
    fla_conv = self._sp_kernel.conv(self.activation)
    batch, length, channels = mixed.shape
    if fla_conv is not None:
        if starts is None:
            return fla_conv(mixed, weight, bias, self.activation)
        bounds = _document_bounds(starts, batch * length).to(mixed.device)
        out = fla_conv(mixed.reshape(1, batch * length, channels), weight, bias, self.activation, bounds)
        return out.reshape(batch, length, channels)
    kernels = sys.modules[type(self).__module__]
    mixed = mixed.transpose(1, 2)  # (b, C_r, s), the modeling file's layout
    if starts is None:
        mixed = kernels.causal_conv1d_fn(mixed, weight, bias, activation=self.activation)
    else:
        mixed = _conv_by_document(kernels.causal_conv1d_fn, mixed, weight, bias, self.activation, starts)
    return mixed.transpose(1, 2)


def _local_mixer(self, mixed: torch.Tensor, key_heads: int, g, beta, keys: range, values: range,
                 doc_lengths: Optional[list[list[int]]] = None) -> torch.Tensor:
    """The causal conv and the gated delta rule over the whole sequence for this rank's heads, both of the run's
    --linear_kernel (linear_kernel.py); with packed documents each restarts at every document. mixed: q, k, v
    joined (b, s, C_r = 2 key_heads dk + nv_r dv), in the order of this rank's conv channels; g and beta
    (b, s, nv_r) -> (b, s, nv_r, dv)."""
    channels = _conv_channels(self, keys, values)
    weight = self.conv1d.weight.squeeze(1)[channels]  # (C_r, K): this rank's channels, its gradient's too
    bias = None if self.conv1d.bias is None else self.conv1d.bias[channels]
    batch, length = mixed.shape[:2]
    starts = None if doc_lengths is None else document_starts(doc_lengths, length)
    mixed = _conv(self, mixed, weight, bias, starts)
    key_width = key_heads * self.head_k_dim
    q, k, v = torch.split(mixed, [key_width, key_width, mixed.shape[2] - 2 * key_width], dim=-1)
    q, k = (x.reshape(batch, length, -1, self.head_k_dim) for x in (q, k))
    v = v.reshape(batch, length, -1, self.head_v_dim)
    rule = self._sp_kernel.rule(self)
    if not self._sp_kernel.grouped_values and q.shape[2] != v.shape[2]:  # value head j reads key head j // group
        q, k = (x.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for x in (q, k))
    if starts is not None:
        return _rule_by_document(self._sp_kernel, rule, q, k, v, g, beta, starts)
    out, _ = rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=True)
    return out


def sp_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
    """The DeltaNet mixer's forward under Ulysses (the module docstring); hidden (b, s/sp, H) -> (b, s/sp, H)."""
    if cache is not None or kwargs.get("cache_params") is not None:
        raise NotImplementedError("the sequence-parallel DeltaNet mixer trains: no cache (use_cache=False)")
    if attention_mask is not None:
        raise NotImplementedError("padding masks are not supported: pad at the end with labels -100 instead")
    group, sp = self._sp_group, group_size(self._sp_group)
    documents = self._sp_documents() if self._sp_documents is not None else None  # the attention, or gone
    doc_lengths = None if documents is None else documents.doc_lengths  # (b,) lists of global lengths
    q, k, v, z, b, a, qkv = _project(self, hidden_states)  # (b, s/sp, heads, d)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (b, s/sp, nv), fp32 as transformers
    if self.num_k_heads < sp:  # nk divides sp (support.py): each key head to sp/nk consecutive ranks
        q, k = (x.repeat_interleave(sp // self.num_k_heads, dim=2) for x in (q, k))
    keys, values = rank_heads(self.num_k_heads, self.num_v_heads, sp, self._sp_rank)
    # q, k, v (b, s/sp, heads, d) -> joined (b, s, C_r) in this rank's conv channel order; at SP=1 the projection's
    # own output where it is already so (no copy); g and beta in fp32 (beta's cast there and back is exact)
    mixed = qkv if sp == 1 and qkv is not None else heads_to_sequence([q, k, v], group)
    g, beta = heads_to_sequence([torch.stack([g, beta.float()], dim=-1)], group).unflatten(-1, (-1, 2)).unbind(-1)
    out = _local_mixer(self, mixed, len(keys), g, beta.to(b.dtype), keys, values, doc_lengths)  # (b, s, nv/sp, dv)
    out = all_to_all(out, group, scatter_dim=1, gather_dim=2)  # (b, s/sp, nv, dv)
    batch, length = hidden_states.shape[:2]
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch, length, -1))


def is_deltanet(module: nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet")
