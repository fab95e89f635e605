"""DPO's reference log-probs: computed once per dataset by a forward pass under SP (a progress bar on rank 0),
cached beside the token store; --eval_dataset's pairs get theirs in the same pass.

The reference is the policy's initial weights (full fine-tuning: the weights the run starts from, before any
checkpoint is loaded, so a resumed run's reference is still its start). Every pair's two sequence log-probs (the
sums over each side's scored tokens, fp64) are computed by the trainer's own engine, forward only, at the run's row
length under SP (the rows split over the DP groups, as evaluation splits them), and stored as

    <token store>/reference/<key>.npy   (pairs, 2) float64: chosen, rejected
    <token store>/reference/<key>.json  what keyed it, and how long it took

The key is a digest of the reference weights themselves (every parameter, gathered under ZeRO-3: name, shape,
dtype and an exact integer checksum of its bits, computed on the device), the model config (rotary scaling and the
like change the forward) and --max_length / --max_prompt_length / --truncation (they change the pairs); the token
store's folder already keys the data, tokenizer and template. A second run on the same data and weights (another
SP size, --packing or not, a resume) reads the file; any other weights compute their own.

The pass streams into the cache: every twentieth of its micro-batches (PARTIAL_FLUSHES), rank 0 writes what the
ranks have computed so far to `<key>.partial.npz` (the values and which pairs are done), so a pass stopped by a
crash, a kill or a preemption goes on from there when the run starts again (any SP or DP layout: the pairs done
are recorded, not the micro-batches), and the finished table replaces it.

Each checkpoint keeps the tables too (`<checkpoint>/reference/<key>.npy`): a resume whose data cache is gone (another
machine, a cleaned cache) reads them there, under the same key, instead of computing them again.

A separate reference model (`--ref_model`, full fine-tuning only): its weights are swapped into the model for the
reference pass (`reference_weights`) and the policy's put back after it, bit for bit: no second model is held on the
GPUs, and the key is that model's digest like any other.

Adapters (LoRA): the reference is the base model with the adapters off. `reference_context(model)` is the one
place that says how the reference forward runs; with PEFT's `disable_adapter()` on the model it switches the
adapters off, so the same pass (and an on-the-fly reference at any step) computes the base model's log-probs,
and `reference_parameters(model)` leaves the adapters' weights out of the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ...data.pair_packing import preference_batch
from ...levers.preference_loss import PreferenceObjective
from ..process.faults import inject_in_reference
from ..step.shards import shard_batch
from .pairs import shard_segments

REFERENCE_FORMAT = 1  # bump when what is computed or how it is keyed changes
_PRIME = 2**31 - 1
_CHUNK = 1 << 22  # elements per checksum chunk: an int64 index of 32 MB


def reference_context(model):
    """How the reference forward runs on `model`: as it is (full fine-tuning, before the first step), or with its
    adapters switched off where the model has them (PEFT's `disable_adapter()`)."""
    disable = getattr(model, "disable_adapter", None)
    return disable() if callable(disable) else contextlib.nullcontext()


def reference_parameters(model):
    """The (name, parameter) pairs the reference is a function of: every parameter but adapters' (LoRA's `lora_`)."""
    return [(n, p) for n, p in model.named_parameters() if "lora_" not in n]


def _checksum(t: torch.Tensor) -> tuple[int, int]:
    """Two exact checksums of a tensor's bits, each sum_i (bits_i mod p + 1) x h(i) mod p (p = 2^31 - 1, h two
    index hashes): integer arithmetic on the tensor's device, so the same bits give the same numbers anywhere."""
    flat = t.detach().flatten()
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    totals = [0, 0]
    for start in range(0, len(bits), _CHUNK):
        chunk = bits[start:start + _CHUNK].to(torch.int64) % _PRIME + 1
        index = torch.arange(start, start + len(chunk), dtype=torch.int64, device=t.device)
        for k, (a, b) in enumerate(((48271, 11), (69621, 7919))):
            totals[k] = (totals[k] + int(((chunk * ((index * a + b) % _PRIME)) % _PRIME).sum())) % _PRIME
    return totals[0], totals[1]


def weights_digest(named_parameters) -> str:
    """A digest of the parameters' names, shapes, dtypes and bits (collective under ZeRO-3: each is gathered)."""
    from deepspeed import zero

    digest = hashlib.sha256()
    for name, param in named_parameters:
        gathered = zero.GatheredParameters([param]) if hasattr(param, "ds_id") else contextlib.nullcontext()
        with gathered:
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{_checksum(param.data)}".encode())
    return digest.hexdigest()


def reference_key(run, samples, weights: str) -> tuple[str, dict]:
    """The cache key of `samples`' reference log-probs under the weights whose digest is `weights`."""
    model = run.module.model
    settings = {"format": REFERENCE_FORMAT, "weights": weights,
                "model_config": model.config.to_json_string(use_diff=False),
                "max_length": samples.max_length, "max_prompt_length": samples.max_prompt_length,
                "truncation": samples.truncation, "pairs": samples.num_pairs}
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16], settings


def _read(path: str, pairs: int):
    try:
        values = np.load(path)
    except (OSError, ValueError, EOFError):
        return None
    return values if values.shape == (pairs, 2) and values.dtype == np.float64 and np.isfinite(values).all() else None


def reference_logps(run, *sources, checkpoint: Optional[str] = None) -> list[np.ndarray]:
    """(pairs, 2) float64 for each source of pairs (the training data, --eval_dataset's): every pair's reference
    log-probs, from the cache, from the `checkpoint` the run resumes (its `reference/` folder: checkpoint_arrays),
    or computed now (collective), under one swap of --ref_model's weights. Leaves `run.reference_tables`
    ({key: values}, what the checkpoints keep) and `run.reference_origins` (where each came from)."""
    run.reference_tables, run.reference_origins = {}, []
    with reference_weights(run):
        weights = weights_digest(reference_parameters(run.module.model))
        return [_cached_or_computed(run, source, weights, checkpoint) for source in sources]


def checkpoint_arrays(run) -> dict:
    """{relative path: values} of the reference tables a checkpoint keeps, so that a resume finds them without the
    data cache (and without computing them from the initial weights again)."""
    return {f"reference/{key}.npy": values for key, values in getattr(run, "reference_tables", {}).items()}


def _found(run, paths: list[str], pairs: int) -> Optional[str]:
    """The first of `paths` rank 0 reads as a table of `pairs`, agreed by every rank (they read it, or all compute)."""
    found = [next((p for p in paths if _read(p, pairs) is not None), None) if run.rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def _cached_or_computed(run, source, weights: str, checkpoint: Optional[str] = None) -> np.ndarray:
    samples = source.samples
    key, settings = reference_key(run, samples, weights)
    folder = os.path.join(samples.store.folder, "reference")
    path = os.path.join(folder, f"{key}.npy")
    kept = [os.path.join(checkpoint, "reference", f"{key}.npy")] if checkpoint else []
    found = _found(run, [path] + kept, samples.num_pairs)
    if found is not None:
        values = _read(found, samples.num_pairs)
        if values is None:
            raise RuntimeError(f"rank {run.rank} cannot read {found}, which rank 0 read: is it on a shared "
                               f"filesystem?")
        run.log(f"reference: log-probs of {int((~samples.identical).sum()):,} pairs read from {found}")
        run.reference_tables[key] = values
        run.reference_origins.append("cache" if found == path else "checkpoint")
        return values
    start = time.perf_counter()
    partial = os.path.join(folder, f"{key}.partial.npz")
    values = reference_pass(run, source, _Partial(run, partial, samples.num_pairs))
    seconds = time.perf_counter() - start
    if run.rank == 0:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{key}.{uuid.uuid4().hex}.tmp")
        with open(tmp + ".npy", "wb") as f:
            np.save(f, values)
        with open(os.path.join(folder, f"{key}.json"), "w") as f:
            json.dump({**settings, "seconds": seconds, "rows": len(samples)}, f, indent=1)
        os.replace(tmp + ".npy", path)  # atomic: a reader sees the whole file or none
        if os.path.exists(partial):
            os.remove(partial)
    dist.barrier()
    run.log(f"reference: log-probs of {int((~samples.identical).sum()):,} pairs in {len(samples):,} rows computed in "
            f"{seconds:.1f} s (forward under SP), cached in {path}")
    run.reference_tables[key] = values
    run.reference_origins.append("computed")
    return values


PARTIAL_FLUSHES = 20  # the pass writes what it has computed this many times (and once it is done)


class _Partial:
    """What an unfinished pass computed, in `<key>.partial.npz` (rank 0 writes it, atomically; every rank reads
    rank 0's): each pair's values and whether it is done. Every rank starts from the pairs done; the values
    themselves start on rank 0 only, so that the pass's all-reduce (a sum over the ranks) counts them once."""

    def __init__(self, run, path: str, pairs: int):
        self.run, self.path, self.pairs = run, path, pairs
        loaded = [self._load() if run.rank == 0 else None]
        dist.broadcast_object_list(loaded, src=0)
        self.values, self.done = loaded[0] or (np.zeros((pairs, 2)), np.zeros(pairs, dtype=bool))
        if self.done.any():
            run.log(f"reference: {int(self.done.sum()):,} of {pairs:,} pairs' log-probs read from {path} (a pass "
                    f"that stopped); computing the rest")

    def _load(self):
        try:
            with np.load(self.path) as f:
                values, done = f["values"], f["done"]
        except (OSError, ValueError, KeyError, EOFError):
            return None
        ok = values.shape == (self.pairs, 2) and done.shape == (self.pairs,) and np.isfinite(values).all()
        return (values.astype(np.float64), done.astype(bool)) if ok else None

    def write(self, values: torch.Tensor, done: torch.Tensor) -> None:
        """Rank 0 writes the all-reduced `values` (pairs, 2) and `done` (pairs,) of every rank (collective)."""
        values, done = values.clone(), done.clone()
        dist.all_reduce(values)
        dist.all_reduce(done)
        if self.run.rank == 0:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{uuid.uuid4().hex}.tmp.npz"
            np.savez(tmp, values=values.cpu().numpy(), done=done.cpu().numpy() > 0)
            os.replace(tmp, self.path)


class _Progress:
    """The reference pass's progress on rank 0 (a pass over a large dataset takes minutes): a bar on a terminal, a
    log line every tenth of the pass otherwise (--progress lines), nothing with --progress none."""

    def __init__(self, run, total: int):
        from ..step.metrics import progress_mode

        self.mode = progress_mode(run.cfg.log.progress) if run.rank == 0 else "none"
        self.run, self.total, self.done, self.start = run, total, 0, time.perf_counter()
        self.bar = None
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="reference log-probs", unit="batch", dynamic_ncols=True)

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.mode == "lines" and self.done < self.total and self.done % max(1, self.total // 10) == 0:
            self.run.log(f"reference: {self.done:,} of {self.total:,} micro-batches in "
                         f"{time.perf_counter() - self.start:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def reference_pass(run, source, partial: _Partial) -> np.ndarray:
    """The forward pass over every row of `source` (no gradient) whose pairs `partial` does not hold yet; each DP
    group takes every dp-th micro-batch. Micro-batches past the last row repeat it and are not counted, so every
    rank takes part in every collective. Writes `partial` every 1/PARTIAL_FLUSHES of the pass."""
    g, micro, samples = run.groups, run.micro, source.samples
    values = torch.zeros(samples.num_pairs, 2, dtype=torch.float64, device=run.device)
    done = torch.zeros(samples.num_pairs, dtype=torch.float64, device=run.device)
    rows = [i for i in range(len(samples)) if not partial.done[samples.pairs(i)].all()]
    kept = partial.done.copy()  # a row computed again (another packing) brings all its pairs' values anew
    kept[[p for i in rows for p in samples.pairs(i)]] = False
    if run.rank == 0:
        done += torch.from_numpy(kept.astype(np.float64)).to(run.device)
        values += torch.from_numpy(partial.values * kept[:, None]).to(run.device)
    firsts = range(0, len(rows), micro * g.dp_size)
    flush = max(1, -(-len(firsts) // PARTIAL_FLUSHES))
    progress = _Progress(run, len(firsts))
    run.engine.eval()
    try:
        with torch.no_grad(), reference_context(run.module.model):
            for n, first in enumerate(firsts, 1):
                indices = [first + g.dp_rank * micro + r for r in range(micro)]
                picked = [source.get(rows[min(i, len(rows) - 1)]) for i in indices]
                batch = preference_batch(picked)
                shard = shard_batch(run, batch)
                objective = PreferenceObjective(None, shard_segments(run, batch), batch["scored"],
                                                sp_group=g.sp_group if g.sp_size > 1 else None)
                run.engine(shard["input_ids"], shard["position_ids"], shard["labels"],
                           torch.ones((), device=run.device), objective=objective)
                counted = torch.tensor([i < len(rows) for i, row in zip(indices, picked) for _ in row.pairs])
                if g.sp_rank == 0 and counted.any():  # every rank of an SP group holds the same sums: add them once
                    ids = batch["pair_ids"][counted].to(run.device)
                    values[ids] = objective.sums[counted.to(run.device)]
                    done[ids] = 1.0
                progress.update()
                if n % flush == 0 and n < len(firsts):
                    partial.write(values, done)
                inject_in_reference(n)
    finally:
        progress.close()
        run.engine.train()
    dist.all_reduce(values)
    return values.cpu().numpy()


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's share of a parameter: its ZeRO-3 partition, or the whole tensor."""
    return param.ds_tensor if hasattr(param, "ds_tensor") else param.data


@contextlib.contextmanager
def reference_weights(run):
    """The weights the reference pass runs on: the model's own, or --ref_model's swapped in for the pass. The
    policy's weights wait on the host meanwhile (each rank its ZeRO-3 partition; replicated ones on rank 0) and go
    back afterwards, bit for bit."""
    path = run.cfg.pref.ref_model
    if not path:
        yield
        return
    _check_restorable(run.ds.get("zero_optimization", {}), path)
    params = list(run.module.model.named_parameters())
    kept = [_local(p).detach().to("cpu", copy=True) if hasattr(p, "ds_id") or run.rank == 0 else None
            for _, p in params]
    try:
        _load_reference(run, path, params)
        run.log(f"reference: --ref_model {path} in the model for the reference pass ({len(params)} tensors)")
        yield
    except BaseException:
        _put_back(params, kept)  # this rank may be alone in failing: no collective here
        raise
    if hasattr(run.engine, "empty_partition_cache"):
        # ZeRO-3 keeps its small ("persistent") parameters gathered after a traced forward: the reference's values
        # would stay in their full tensors; released, the next forward gathers them from the partitions put back
        run.engine.empty_partition_cache()
    _put_back(params, kept)
    with torch.no_grad():
        for _, param in params:
            if not hasattr(param, "ds_id"):
                dist.broadcast(param.data, src=0)


def _put_back(params: list, kept: list) -> None:
    with torch.no_grad():
        for (_, param), share in zip(params, kept):
            if share is not None:
                _local(param).copy_(share)


def _check_restorable(zero: dict, path: str) -> None:
    """The partitionings whose every copy of a weight reference_weights puts back: not ZeRO++'s secondary
    partitions (hpZ), whose copies the forward gathers from, nor parameters swapped out to NVMe."""
    from ...errors import ConfigError

    if (zero.get("zero_hpz_partition_size") or 1) > 1 or (zero.get("offload_param") or {}).get("device") == "nvme":
        raise ConfigError(f"--ref_model {path} swaps its weights into the model for the reference pass, which "
                          f"zero_hpz_partition_size > 1 and offload_param to nvme in the DeepSpeed config do not "
                          f"allow: leave those out of --ds_config")


def _load_reference(run, path: str, params: list) -> None:
    """--ref_model's weights into `params` (collective): rank 0 loads the model on its host in the run's dtype and
    each parameter goes out from there, through ZeRO-3's gather or a broadcast. Its parameters must be the policy's,
    name for name and shape for shape; anything else is a ConfigError on every rank."""
    from deepspeed import zero

    from ...errors import ConfigError

    theirs, problem = {}, [None]
    if run.rank == 0:
        try:
            theirs = pretrained_weights(path, run.dtype)
            problem[0] = _mismatch(params, theirs)
        except Exception as e:  # any failure to load, said on every rank, not a hang
            problem[0] = f"cannot load it: {type(e).__name__}: {e}"
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ConfigError(f"--ref_model {path}: {problem[0]}")
    with torch.no_grad():
        for name, param in params:
            if hasattr(param, "ds_id"):
                with zero.GatheredParameters([param], modifier_rank=0):
                    if run.rank == 0:
                        param.data.copy_(theirs[name])
            else:
                if run.rank == 0:
                    param.data.copy_(theirs[name])
                dist.broadcast(param.data, src=0)


_GEOMETRY = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def check_reference_config(path: str, model_config) -> None:
    """--ref_model's config against the model's, before either is built: a model of another architecture or shape
    is a ConfigError naming what differs (the weights' own check, `_mismatch`, runs when they are loaded)."""
    from transformers import AutoConfig

    from ...errors import ConfigError

    try:
        theirs = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--ref_model {path}: its config does not load: {str(e).strip()}") from None
    ours, theirs = model_config.get_text_config(), theirs.get_text_config()
    differ = [f"{k} {getattr(theirs, k, None)} against {getattr(ours, k, None)}" for k in _GEOMETRY
              if getattr(theirs, k, None) != getattr(ours, k, None)]
    if differ:
        raise ConfigError(f"--ref_model {path} is not a model of the policy's architecture and shape "
                          f"({'; '.join(differ[:3])}): give a reference of the same model family and size")


def pretrained_weights(path: str, dtype: torch.dtype) -> dict:
    """name -> parameter of the pretrained model at `path`, loaded on this host in `dtype` outside ZeRO-3's
    zero.Init (tied weights once, as named_parameters gives them)."""
    from transformers import AutoModelForCausalLM

    from ...model.build import without_zero3

    with without_zero3():
        return {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(path, dtype=dtype).named_parameters()}


def _mismatch(params: list, theirs: dict) -> str | None:
    """What keeps --ref_model's parameters from standing in for the policy's, or None."""
    ours = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in params}
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or extra:
        return (f"its parameters are not the model's (missing: {', '.join(missing[:3]) or 'none'}; not in the model: "
                f"{', '.join(extra[:3]) or 'none'}): give a model of --model's architecture")
    shapes = [f"{n} {tuple(theirs[n].shape)} against {ours[n]}" for n in ours if tuple(theirs[n].shape) != ours[n]]
    return f"shapes differ from the model's: {'; '.join(shapes[:3])}" if shapes else None
