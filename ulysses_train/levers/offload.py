"""Host offload of what checkpointed layers save (`--offload_activations`).

What a checkpointed layer saves (its inputs, and its kept attention outputs) goes to pinned host memory on a side
stream in the forward, and comes back on a side stream one layer ahead of the backward that needs it, so both
copies overlap compute. transformers' own `offload=True` copies on the compute stream and waits for each copy, and
nobody offloads selective-checkpoint caches, which is why we write this one. With kept attention outputs the GPU
holds two layers' worth of them at any time.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..sp.kernels import ATTENTION_OPS
from .projections import is_kept

OFFLOAD_MIN_BYTES = 1 << 20  # small tensors are not worth a copy


class PinnedPool:
    """Host memory for one step's offloaded tensors: registered once, handed out in order, all idle after the backward.

    Why not `torch.empty(..., pin_memory=True)`: PyTorch's caching host allocator rounds each block up to a power of
    two, so a 640 MiB checkpoint (131k tokens x 2560 x 2 bytes) pins 1 GiB: the host then holds the rounding of every
    checkpoint beside the offloaded bytes. Here pageable memory is registered with CUDA (cudaHostRegister, as torch's
    own checkpoint stager does), and what is left beyond the offloaded bytes is the process (both measured in
    docs/benchmarks.md, "Host memory of the offload"). If registering fails we fall back to torch's pinned memory.

    Why chunks filled in order rather than a buffer per size: with packed documents a kernel run per document (SDPA;
    FA4 did before it ran them in one varlen call) keeps outputs per document, whose sizes change every step while
    their sum does not. Buffers kept by size grew by a step's worth of host memory at every new packing, until the
    host's OOM killer stopped a 131k run. Here each step hands out its
    tensors in order from the same chunks, skipping a chunk whose rest is too small; a step that runs past the last
    chunk adds one. Tensors of a run whose shapes repeat land where they did the step before, in chunks of their own
    size. If a step that added a chunk leaves more than 2% of the pool unused, the pool is replaced by one chunk of
    that step's size plus 2%: the pool then holds about the largest step's bytes whatever the shapes, and registers
    memory again only when a step is larger than every step before it.
    `pin=False` gives plain host memory (what the tests exercise).

    Memory freed while still registered would stay known to CUDA: a later host allocation at the same address then
    fails its copies with "invalid argument" (seen on the H200 in a test process that built a second model after an
    offloaded one), so `release` (also run when the pool is collected) unregisters everything it registered."""

    ALIGN = 4096  # every tensor starts on a page: any dtype's alignment, and DMA-friendly
    MIN_CHUNK = 64 << 20  # a new chunk's least size: small tensors share chunks (fewer registrations)
    MARGIN = 1.02  # a pool of the largest step's bytes plus 2%: steps of packed samples differ by a little

    def __init__(self, pin: bool):
        self.pin = pin
        self.chunks: list[torch.Tensor] = []  # uint8 host buffers, filled in order every step
        self.chunk = 0  # where the next tensor goes: chunk index and byte offset in it
        self.offset = 0
        self.used = 0  # bytes handed out in this step (aligned)
        self.grew = False  # this step added a chunk
        self.bytes = 0  # all chunks
        self.registered: list[int] = []  # data pointers registered with cudaHostRegister

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        while self.chunk < len(self.chunks) and self.offset + size > self.chunks[self.chunk].numel():
            self.chunk, self.offset = self.chunk + 1, 0
        if self.chunk == len(self.chunks):
            self.chunks.append(self._new(max(size, self.MIN_CHUNK)))
            self.grew = True
        buf = self.chunks[self.chunk][self.offset:self.offset + nbytes]
        self.offset += size
        self.used += size
        return buf.view(dtype).view(shape)

    def give_back_all(self) -> None:
        """After the backward (no copy to or from the host in flight): everything is free for the next step. A step
        that added chunks and left more than 2% of the pool unused leaves one chunk of its size instead."""
        if self.grew and self.bytes > self.used * self.MARGIN:
            need = -(-int(self.used * self.MARGIN) // self.ALIGN) * self.ALIGN
            self.release()
            self.chunks = [self._new(need)]
        self.chunk = self.offset = self.used = 0
        self.grew = False

    def _new(self, nbytes: int) -> torch.Tensor:
        self.bytes += nbytes
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if not self.pin:
            return buf
        if int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)) != 0:
            warnings.warn("cudaHostRegister failed: offloaded tensors use PyTorch's pinned memory (rounded up to "
                          "powers of two) instead")
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.registered.append(buf.data_ptr())
        return buf

    def release(self) -> None:
        """Unregister and drop every buffer, after the copies in flight have finished. Idempotent."""
        if self.registered:
            torch.cuda.synchronize()
            for ptr in self.registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self.registered, self.chunks, self.bytes = [], [], 0
        self.chunk = self.offset = self.used = 0
        self.grew = False

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may be gone already, and the process frees everything anyway
            pass


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of the forward go to pinned host memory; the backward gets them back one layer ahead of use.

    Items are grouped by checkpointed layer (`start_group` before each). Backward visits the layers in reverse, so
    when the first item of layer g is needed, all of layer g is fetched and all of layer g-1 starts coming back.
    Without CUDA the copies are plain host-to-host copies: nothing is saved, but tests exercise the bookkeeping."""

    def __init__(self, min_bytes: int = OFFLOAD_MIN_BYTES):
        self.min_bytes = min_bytes
        self.groups: list[list[dict]] = [[]]
        self.cuda = torch.cuda.is_available()
        self.d2h = torch.cuda.Stream() if self.cuda else None
        self.h2d = torch.cuda.Stream() if self.cuda else None
        self.host_bytes = 0  # offloaded in the current step
        self.peak_host_bytes = 0  # the most of any finished step
        self.pool = PinnedPool(pin=self.cuda)
        super().__init__(self._pack, self._unpack)

    def start_group(self) -> None:
        if self.groups[-1]:
            self.groups.append([])

    def _pack(self, t: torch.Tensor):
        if t.is_cuda != self.cuda or t.numel() * t.element_size() < self.min_bytes:
            return t
        item = {"device": t.device, "group": len(self.groups) - 1}
        if self.cuda:
            item["host"] = self.pool.take(t.shape, t.dtype)
            self.d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.d2h):
                item["host"].copy_(t, non_blocking=True)
                t.record_stream(self.d2h)  # the allocator must not reuse t's memory before the copy is done
            item["done_d2h"] = self.d2h.record_event()
        else:  # clone, as the fetch does: selective checkpointing replays the ops it saw in the forward
            item["host"] = t.detach().clone()
        self.groups[-1].append(item)
        self.host_bytes += t.numel() * t.element_size()
        return item

    def _fetch(self, item: dict) -> None:
        if "back" in item or item.get("used"):
            return
        if not self.cuda:
            item["back"] = item["host"].clone()
            return
        self.h2d.wait_event(item["done_d2h"])
        with torch.cuda.stream(self.h2d):
            item["back"] = item["host"].to(item["device"], non_blocking=True)
            item["done_h2d"] = self.h2d.record_event()

    def _unpack(self, item):
        if isinstance(item, torch.Tensor):
            return item
        for other in self.groups[item["group"]]:  # the rest of this layer is needed in a moment
            self._fetch(other)
        if item["group"] > 0:
            for other in self.groups[item["group"] - 1]:  # the layer the backward visits next
                self._fetch(other)
        back = item.pop("back")
        item["used"] = True  # a later prefetch of this layer must not copy it again
        if self.cuda:
            torch.cuda.current_stream().wait_event(item["done_h2d"])
            back.record_stream(torch.cuda.current_stream())
        return back

    def peek(self, item) -> torch.Tensor:
        """A device copy of an offloaded tensor that leaves it to its own unpack later: the regenerating forward of
        a segment (segments.py) reads the segment's checkpoint before the first layer's recompute does. The copy is
        the one the prefetch makes (started here if it has not been), so the layer's own unpack finds it back."""
        if isinstance(item, torch.Tensor):
            return item
        self._fetch(item)
        if self.cuda:
            torch.cuda.current_stream().wait_event(item["done_h2d"])
            item["back"].record_stream(torch.cuda.current_stream())
        return item["back"]

    def reset(self) -> None:
        """After the backward: this step's host buffers are free for the next (the compute stream has waited for
        every copy back, and the next step's copies out are queued after it). Keeps the peak for the metrics."""
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.groups = [[]]  # drop this step's views first: the pool may replace its memory
        self.pool.give_back_all()
        self.host_bytes = 0


class _HostCopy:
    """Stands in for a kept output (checkpointing.KeptOutput, read through `get_val`) whose tensor went to the host;
    `get_val` brings it back through the offload's prefetching unpack."""

    def __init__(self, offload: HostOffload, item):
        self.offload, self.item = offload, item

    def get_val(self, allow_cache_entry_mutation: bool = False):
        return self.offload._unpack(self.item)


class OffloadKeptOutputs(TorchDispatchMode):
    """Entered after the checkpoint's keeping mode (checkpointing.KeepOutputs), so it sees each op before that mode
    stores it: after a kept op (`ops`: an attention kernel, the gated delta rule), the stored entries holding CUDA
    tensors are swapped for host copies. Why: kept attention outputs cost `layers x s x heads x head_dim x 2` bytes;
    on the host, no GPU memory."""

    def __init__(self, keeping_mode, offload: HostOffload, ops=frozenset(ATTENTION_OPS)):
        super().__init__()
        self.storage, self.offload, self.ops = keeping_mode.storage, offload, ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_kept(func, self.ops):
            with _disable_current_modes():  # the copies themselves must not land in the checkpoint's cache
                self._offload_new_entries()
        return out

    def _offload_new_entries(self) -> None:
        for entries in self.storage.values():  # a list of outputs per op, in call order
            for idx, entry in enumerate(entries):
                entries[idx] = _offload_entry(entry, self.offload)


def _offload_entry(entry, offload: HostOffload):
    if isinstance(entry, (tuple, list)):
        return type(entry)(_offload_entry(e, offload) for e in entry)
    val = getattr(entry, "val", None)
    if not isinstance(val, torch.Tensor) or val.is_cuda != offload.cuda:
        return entry
    if val.numel() * val.element_size() < offload.min_bytes:
        return entry
    return _HostCopy(offload, offload._pack(val))
