"""`--profile_memory STEPS`: where the memory of the first STEPS steps went, as a picture stacked by category.

Writes under `<output_dir>/memory/` (rank 0):
* `memory.png`: live tensor memory over the profiled steps (x: operations in order), stacked by category;
* `memory.json`: the same series, and the peak of each category;
* `snapshot.pickle` on CUDA: PyTorch's own allocator history, without stack traces (see `MemoryProfiler.start`;
  drag it onto https://pytorch.org/memory_viz).

Why our own tracker beside PyTorch's: the CUDA snapshot knows allocations and stack frames but not what a tensor is
for, and exists on CUDA only. A dispatch mode sees every tensor an op creates and the phase we are in, so it can
file each allocation under what the planner (docs/memory.md) calls it, on any device (tests run it on CPU):

    model states     alive before the first profiled step (weights, ZeRO partitions, optimizer states made at init)
    optimizer        created in the optimizer step and alive after it (Adam states made on the first step)
    checkpoints      created in the forward and still alive when the forward ends (saved layer inputs, kept
                     attention outputs, what the loss keeps), unless offloaded to the host
    activations      created in the forward and freed before it ends (layer temporaries, gathered ZeRO-3 weights)
    recomputed layer created while a checkpointed layer re-runs its forward in the backward
    loss             created by the fused loss head
    gradients        created in the backward outside recompute (weight gradients, activation gradients)
    other            the rest (optimizer temporaries, collectives' buffers)
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .phases import wrap_phases

CATEGORIES = ("model states", "optimizer", "checkpoints", "activations", "recomputed layer", "loss", "gradients",
              "other")


class MemoryTimeline(TorchDispatchMode):
    """Records, for each storage an op creates on `device_type`, when it was made, when freed, its size, its phase."""

    def __init__(self, device_type: str, baseline_bytes: int = 0):
        super().__init__()
        self.device_type = device_type
        self.baseline = baseline_bytes
        self.phase = "other"
        self.clock = 0  # operations seen
        self.blocks: list[list] = []  # [made, freed or None, bytes, phase, forward index]
        self.forward_ends: list[int] = []  # clock at the end of each forward
        self._alive: dict[int, int] = {}  # storage data_ptr -> block index

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous
            if phase == "forward":
                self.forward_ends.append(self.clock)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.clock += 1
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # views and in-place ops make no memory
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or key in self._alive:
            return
        phase = "recomputed layer" if self.phase == "backward" and _in_recompute() else self.phase
        self._alive[key] = len(self.blocks)
        self.blocks.append([self.clock, None, nbytes, phase, len(self.forward_ends)])
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        index = self._alive.pop(key, None)
        if index is not None:
            self.clock += 1  # a free is an event too: a tensor made and dropped between two ops still shows
            self.blocks[index][1] = self.clock

    def live_bytes(self) -> int:
        """Bytes of the storages made under this mode that are still alive (the baseline not included)."""
        return sum(nbytes for _, freed, nbytes, _, _ in self.blocks if freed is None)

    def category(self, block: list) -> str:
        made, freed, _, phase, forward = block
        if phase == "forward":
            end = self.forward_ends[forward] if forward < len(self.forward_ends) else None
            return "checkpoints" if end is None or freed is None or freed > end else "activations"
        if phase == "optimizer":
            return "optimizer" if freed is None else "other"
        if phase == "backward":
            return "gradients"
        return phase if phase in CATEGORIES else "other"

    def series(self, points: int = 600) -> dict:
        """Live bytes per category over time: the exact sweep over every allocation and free, kept at `points` bins
        (each bin shows its moment of highest total, so no spike is lost), and the exact peak of each category."""
        events = []  # (time, change in bytes, category); frees sort before allocations at the same time
        for block in self.blocks:
            made, freed, nbytes, _, _ = block
            category = self.category(block)
            events.append((made, 1, nbytes, category))
            if freed is not None:
                events.append((freed, 0, -nbytes, category))
        events.sort(key=lambda e: (e[0], e[1]))
        live = dict.fromkeys(CATEGORIES, 0)
        live["model states"] = self.baseline
        peaks = dict(live)
        width = max(self.clock, 1) / points
        bins: dict[int, tuple] = {}
        for time, _, change, category in events:
            live[category] += change
            peaks[category] = max(peaks[category], live[category])
            total, b = sum(live.values()), min(int(time / width), points - 1)
            if b not in bins or total >= bins[b][0]:
                bins[b] = (total, time, dict(live))
        ticks = sorted(bins)
        return {"ops": [bins[b][1] for b in ticks], "bytes": {c: [bins[b][2][c] for b in ticks] for c in CATEGORIES},
                "peaks": peaks}


def _in_recompute() -> bool:
    """True while a checkpointed layer re-runs its forward inside the backward (grad enabled, in a graph task)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def plot(path: str, series: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2**30
    shown = [c for c in CATEGORIES if max(series["bytes"][c], default=0) > 0]
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.stackplot(series["ops"], [[v / gib for v in series["bytes"][c]] for c in shown], labels=shown, alpha=0.85)
    ax.set_xlabel("operations (in order; forward, loss, backward with recompute, optimizer step per step)")
    ax.set_ylabel("live tensor memory (GiB)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    ax.margins(x=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class MemoryProfiler:
    """Wires a MemoryTimeline (and, on CUDA, PyTorch's allocator history) into a trainer for its first steps."""

    def __init__(self, trainer, steps: int, out_dir: str):
        self.trainer, self.steps, self.out_dir = trainer, steps, out_dir
        self.cuda = trainer.device.type == "cuda"
        self.timeline: Optional[MemoryTimeline] = None

    def start(self) -> None:
        engine = self.trainer.engine
        baseline = _live_storage_bytes(engine, self.trainer.device.type)
        self.timeline = MemoryTimeline(self.trainer.device.type, baseline)
        wrap_phases(engine, self.trainer.module.model.get_output_embeddings(), self._phase)
        if self.cuda:
            # Allocations and frees only, no stack traces: capturing Python tracebacks while a checkpointed layer
            # recomputes inside the backward breaks autograd.Function.apply in torch 2.11 ("returned NULL without
            # setting an exception", pytorch/pytorch#179536; seen on the H200 with DeepSpeed's ZeRO-3 linear and
            # TiledMLP). Our picture names the tensors; the snapshot still shows every block over time.
            torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=1_000_000)
        self.timeline.__enter__()

    def _phase(self, phase: str):
        return self.timeline.in_phase(phase) if self.timeline is not None else contextlib.nullcontext()

    def stop(self, write: bool) -> Optional[dict]:
        timeline, self.timeline = self.timeline, None
        if timeline is None:  # stopped already
            return None
        timeline.__exit__(None, None, None)
        if write:
            os.makedirs(self.out_dir, exist_ok=True)
        if self.cuda:
            if write:
                torch.cuda.memory._dump_snapshot(os.path.join(self.out_dir, "snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if not write:
            return None
        series = timeline.series()
        peaks = {c: v / 2**30 for c, v in series.pop("peaks").items()}
        total = [sum(v[i] for v in series["bytes"].values()) for i in range(len(series["ops"]))]
        summary = {"steps": self.steps, "peak_total_gib": max(total) / 2**30, "peak_gib": peaks,
                   "device_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None}
        with open(os.path.join(self.out_dir, "memory.json"), "w") as f:
            json.dump(dict(summary, series=series), f)
        base = self.trainer.cfg.base
        plot(os.path.join(self.out_dir, "memory.png"), series,
             f"{base.model or base.model_config}, {self.trainer.seq_len:,} tokens, sp {self.trainer.groups.sp_size}: "
             f"{self.steps} step(s), rank 0")
        return summary


class ProfileFirstSteps:
    """`--profile_memory N` as a hook of the training loop: records from the first step the loop runs, writes the
    picture and a summary line after N steps, or when the loop stops earlier (an error, SIGTERM)."""

    def __init__(self, trainer, steps: int, write: Callable[[str], None]):
        self.trainer, self.steps, self.write = trainer, steps, write
        self.profiler: Optional[MemoryProfiler] = None
        self.first: Optional[int] = None

    def __enter__(self):
        return self

    def before_step(self, step: int) -> None:
        if self.steps and self.first is None:
            self.first = step
            out = os.path.join(self.trainer.cfg.output.output_dir, "memory")
            self.profiler = MemoryProfiler(self.trainer, self.steps, out)
            self.profiler.start()

    def after_step(self, step: int) -> None:
        if self.profiler is not None and step == self.first + self.steps - 1:
            self._finish()

    def __exit__(self, *exc) -> None:
        if self.profiler is not None:  # stopped early: still leave the recording
            self._finish()

    def _finish(self) -> None:
        profiler, self.profiler = self.profiler, None  # not again on exit if writing the picture fails
        summary = profiler.stop(write=self.trainer.rank == 0)
        if summary:
            top = sorted(summary["peak_gib"].items(), key=lambda kv: -kv[1])[:4]
            self.write(f"memory profile: peak {summary['peak_total_gib']:.2f} GiB of tensors ("
                       + ", ".join(f"{k} {v:.2f}" for k, v in top) + f") -> {profiler.out_dir}")


def _live_storage_bytes(engine, device_type: str) -> int:
    """Bytes of the distinct storages the engine holds before profiling: weights (or ZeRO partitions), gradient
    buffers and optimizer states that exist already. Every tensor an optimizer object holds in an attribute (or a
    list, tuple or dict of them) counts, so DeepSpeed's flat buffers are found whatever their names
    (`grad_partitions_flat_buffer`, `lp_param_buffer`, bucket buffers, ...): missing ZeRO-3's gradient partition
    once left 2 bytes per parameter out of the H200 picture."""
    tensors = list(engine.module.parameters()) + list(engine.module.buffers())
    tensors += [getattr(p, "ds_tensor", None) for p in engine.module.parameters()]
    optimizer = getattr(engine, "optimizer", None)
    for obj in (optimizer, getattr(optimizer, "optimizer", None)):
        if obj is None:
            continue
        for state in getattr(obj, "state", {}).values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for value in vars(obj).values():
            tensors += _tensors_in(value)
            for bucket in value.values() if isinstance(value, dict) else ():
                tensors += _tensors_in(getattr(bucket, "buffer", None))  # DeepSpeed's reduce buckets
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == device_type and t.untyped_storage().nbytes():
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _tensors_in(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, torch.Tensor)]
    return []
