"""Ring attention over the ring group: exact causal attention with the sequence split instead of the heads.

Layout (zigzag): the sequence of one SP group is cut into 2R chunks of c tokens (R = ring size); ring rank i holds
chunks i and 2R-1-i, in that order (sharding.py gives each rank its part of them, and the Ulysses all-to-all in
front of the ring gathers the pair). Each rank keeps its queries; the K/V blocks go round the ring, one step
each, by point-to-point sends to the next rank that overlap the kernel on the block in hand (double buffered).
At step t rank i holds the block of rank src = i - t and its queries see, before documents:

    src == i    its own block, causal (the pair is in position order: chunk i before chunk 2R-1-i)
    src <  i    the first chunk of the block (chunk src) with every query row: wholly in the past
    src >  i    the whole block with the second chunk's query rows (chunk 2R-1-i comes after both)

so every rank does the same work at every step (c x 2c after the first). Partial outputs merge in fp32 through
their log-sum-exps. The backward passes the K/V blocks round again with their dK/dV accumulators (fp32), which
return to their owner after R sends; each block's share comes from the kernel's backward given the *merged*
output and log-sum-exp.

Packing: `doc_ids` (b, s) numbers the document of every position of the whole sequence (every rank of an SP group
holds the whole batch, so a block's documents are known without sending them). A query row sees a key only in its
own document: each (query part, key part) above becomes one kernel call per document present in both, causal for
the diagonal block. Documents are contiguous, so within a rank's pair of chunks each document is one run of rows.

The forward is a registered op (`ulysses::ring_fwd`) returning (out, lse), like FA4's (fa4_op.py): selective
checkpointing keeps its outputs (`--attn_recompute never`: the recompute neither runs the kernels nor sends
anything) and the offload moves them to the host. The process group cannot be an op argument; the op takes the
index of its `RingAttention` in `RINGS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .block_kernels import BlockKernel, block_kernel
from .sharding import block_positions
from .weak_group import WeakGroup


@dataclass(frozen=True)
class Tile:
    """One kernel call of a ring step: batch rows, this rank's query rows, the block's key rows."""

    rows: slice
    q: slice
    k: slice
    causal: bool


def _runs(ids: Tensor, offset: int) -> dict[int, tuple[int, int]]:
    """document id -> (first, end) rows of its run in `ids` (non-decreasing), shifted by `offset`."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    runs, start = {}, offset
    for doc, n in zip(values.tolist(), counts.tolist()):
        runs[doc] = (start, start + n)
        start += n
    return runs


def step_tiles(me: int, src: int, chunk: int, docs_q: Optional[Tensor] = None,
               docs_k: Optional[Tensor] = None) -> list[Tile]:
    """The kernel calls of rank `me` on the block of rank `src` (see the module docstring). `docs_q`, `docs_k`:
    (b, 2 chunk) document ids of this rank's rows and of the block's rows, when packing."""
    if src == me:
        q_part, k_part, causal = slice(0, 2 * chunk), slice(0, 2 * chunk), True
    elif src < me:
        q_part, k_part, causal = slice(0, 2 * chunk), slice(0, chunk), False
    else:
        q_part, k_part, causal = slice(chunk, 2 * chunk), slice(0, 2 * chunk), False
    if docs_q is None:
        return [Tile(slice(None), q_part, k_part, causal)]
    tiles = []
    for b in range(docs_q.shape[0]):
        keys = _runs(docs_k[b, k_part], k_part.start)
        for doc, (q0, q1) in _runs(docs_q[b, q_part], q_part.start).items():
            if doc in keys:
                k0, k1 = keys[doc]
                tiles.append(Tile(slice(b, b + 1), slice(q0, q1), slice(k0, k1), causal))
    return tiles


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Folds one block's (out, lse) into the running ones, in place: out (b, n, h, d) and lse (b, h, n) in fp32.
    Rows the running lse has not seen yet are -inf, and take the block's values (exp(-inf) = 0)."""
    new = torch.logaddexp(lse, block_lse)
    old_weight = torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)  # (b, n, h, 1)
    block_weight = torch.exp(block_lse - new).transpose(1, 2).unsqueeze(-1)
    out.mul_(old_weight).add_(block_out.to(out.dtype) * block_weight)
    lse.copy_(new)


# ---------------------------------------------------------------- the exchanges


class RingExchange:
    """Sends tensors to the next rank of the ring and receives tensors of the same shapes from the previous one,
    without waiting: `start`, then `wait` for what came in."""

    def __init__(self, group, tag: int):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.tag = group, tag
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)
        self.requests, self.incoming, self.outgoing = [], [], []

    def start(self, tensors: list[Tensor]) -> None:
        self.outgoing = tensors  # held until `wait`: the sends read them in the background
        self.incoming = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, self.tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, self.tag) for t in self.incoming]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for request in self.requests:
            request.wait()
        self.requests, self.outgoing = [], []
        return self.incoming


def ring_blocks(exchange: RingExchange, k: Tensor, v: Tensor, me: int, size: int) -> Iterator[tuple]:
    """(src, k, v) for every step: the next block is on its way while the caller works on the current one."""
    for step in range(size):
        if step + 1 < size:
            exchange.start([k, v])
        yield (me - step) % size, k, v
        if step + 1 < size:
            k, v = exchange.wait()


class GradientRing:
    """The dK/dV accumulators going round with their blocks: each rank adds its share to the accumulator of the
    block in hand (received from the previous rank) and sends it on; after the last step it arrives home."""

    def __init__(self, exchange: Optional[RingExchange]):
        self.exchange, self.in_flight = exchange, False

    def add(self, src: int, dk: Tensor, dv: Tensor) -> None:
        """This rank's share of block `src`'s gradients (the ring's order says which block that is)."""
        if self.in_flight:
            got_dk, got_dv = self.exchange.wait()
            dk += got_dk
            dv += got_dv
        self.exchange.start([dk, dv])
        self.in_flight = True

    def finish(self) -> list[Tensor]:
        return self.exchange.wait()


# ---------------------------------------------------------------- forward and backward of one rank


def _tile_docs(doc_ids: Optional[Tensor], owner: int, size: int, chunk: int) -> Optional[Tensor]:
    return None if doc_ids is None else doc_ids[:, block_positions(owner, size, chunk)]


def ring_forward(q: Tensor, blocks, me: int, size: int, scale: float, kernel: BlockKernel,
                 doc_ids: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """q (b, 2c, h, d) of ring rank `me`; `blocks` yields (src, k, v) for each step -> out (b, 2c, h, d) in q's
    dtype and lse (b, h, 2c) in fp32 (or wider)."""
    b, n, h, _ = q.shape
    chunk = n // 2
    acc = torch.promote_types(q.dtype, torch.float32)
    out = lse = None
    docs_q = _tile_docs(doc_ids, me, size, chunk)
    for src, k, v in blocks:
        for t in step_tiles(me, src, chunk, docs_q, _tile_docs(doc_ids, src, size, chunk)):
            block_out, block_lse = kernel.forward(q[t.rows, t.q], k[t.rows, t.k], v[t.rows, t.k], scale, t.causal)
            if out is None and block_out.shape == q.shape:  # the first block covers every row: nothing to merge
                out, lse = block_out.to(acc), block_lse.to(acc)
                continue
            if out is None:
                out = torch.zeros(q.shape, dtype=acc, device=q.device)
                lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
            merge(out[t.rows, t.q], lse[t.rows, :, t.q], block_out, block_lse)
    return out.to(q.dtype), lse


def ring_backward(dout: Tensor, q: Tensor, out: Tensor, lse: Tensor, blocks, grads: GradientRing, me: int,
                  size: int, scale: float, kernel: BlockKernel, doc_ids: Optional[Tensor] = None) -> Tensor:
    """dq of this rank's queries (fp32 or wider); each block's dk, dv shares go to `grads.add`."""
    chunk = q.shape[1] // 2
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = None
    docs_q = _tile_docs(doc_ids, me, size, chunk)
    for src, k, v in blocks:
        dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v))
        for t in step_tiles(me, src, chunk, docs_q, _tile_docs(doc_ids, src, size, chunk)):
            qr = (t.rows, t.q)
            block_dq, block_dk, block_dv = kernel.backward(dout[qr], q[qr], k[t.rows, t.k], v[t.rows, t.k], out[qr],
                                                           lse[t.rows, :, t.q], scale, t.causal)
            if dq is None and block_dq.shape == q.shape:  # the first block covers every row
                dq = block_dq.to(acc)
            else:
                dq = torch.zeros(q.shape, dtype=acc, device=q.device) if dq is None else dq
                dq[qr] += block_dq
            dk[t.rows, t.k] += block_dk
            dv[t.rows, t.k] += block_dv
        grads.add(src, dk, dv)
    return dq


# ---------------------------------------------------------------- the op and its autograd

RINGS: list["RingAttention"] = []  # the op's `ring` argument indexes this


class RingAttention:
    """Ring attention over `group` with the block kernel of `--attn_kernel kernel` (resolved)."""

    def __init__(self, group, kernel: str):
        self._group, self.kernel_name = WeakGroup(group), kernel  # RINGS is global: hold the group weakly
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.index = len(RINGS)
        RINGS.append(self)

    @property
    def group(self):
        return self._group.get()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float, doc_ids: Optional[Tensor]) -> Tensor:
        """q (b, h, n, d), k/v (b, hkv, n, d): this rank's pair of chunks, after the Ulysses all-to-all ->
        out (b, n, h, d)."""
        if q.shape[2] % 2:
            raise ValueError(f"ring attention: {q.shape[2]} rows per rank is not two equal chunks")
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, n, h, d); k and v contiguous to be sent
        return torch.ops.ulysses.ring_fwd(q, k.contiguous(), v.contiguous(), doc_ids, scale, self.index)[0]

    def _kernel(self, q: Tensor) -> BlockKernel:
        return block_kernel(self.kernel_name, q.device, q.dtype)

    def forward(self, q, k, v, scale, doc_ids):
        blocks = ring_blocks(RingExchange(self.group, tag=0), k, v, self.rank, self.size)
        return ring_forward(q, blocks, self.rank, self.size, scale, self._kernel(q), doc_ids)

    def backward(self, dout, q, k, v, out, lse, scale, doc_ids):
        blocks = ring_blocks(RingExchange(self.group, tag=0), k, v, self.rank, self.size)
        grads = GradientRing(RingExchange(self.group, tag=1))
        dq = ring_backward(dout, q, out, lse, blocks, grads, self.rank, self.size, scale, self._kernel(q), doc_ids)
        dk, dv = grads.finish()  # this rank's own block, home after R sends
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("ulysses::ring_fwd", mutates_args=())
def ring_fwd(q: Tensor, k: Tensor, v: Tensor, doc_ids: Optional[Tensor], scale: float,
             ring: int) -> tuple[Tensor, Tensor]:
    return RINGS[ring].forward(q, k, v, scale, doc_ids)


@ring_fwd.register_fake
def _ring_fwd_fake(q, k, v, doc_ids, scale, ring):
    b, n, h, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty((b, h, n), dtype=torch.promote_types(q.dtype, torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, doc_ids, scale, ring = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.doc_ids, ctx.scale, ctx.ring = doc_ids, scale, ring


def _backward(ctx, dout, _dlse):  # lse is an auxiliary output: nothing differentiates through it
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = RINGS[ctx.ring].backward(dout, q, k, v, out, lse, ctx.scale, ctx.doc_ids)
    return dq, dk, dv, None, None, None


ring_fwd.register_autograd(_backward, setup_context=_setup_context)

FORWARD_OP = torch.ops.ulysses.ring_fwd.default
