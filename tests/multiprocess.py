"""Run a function on N CPU processes with the gloo backend (what CI has), and collect each rank's return value."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import traceback

import torch.multiprocessing as mp

from ulysses_train.train.process.launcher import free_port


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args, use_deepspeed: bool, backend: str):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    from ulysses_train.sp.groups import disable_deepspeed_shm_allreduce, init_distributed

    disable_deepspeed_shm_allreduce()  # also for DeepSpeed wrapping an existing process group later
    try:
        if use_deepspeed:
            init_distributed(backend)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        dist.barrier()  # no rank leaves while another still talks to it
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        code = 0
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        code = 1
    # Leave without tearing the process groups down: gloo's teardown of sub-groups now and then aborts the process
    # ("terminate called without an active exception") after all the work is done and written, which made tests
    # flaky. The result (or the error) is already on disk; the exit code says which.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_distributed(fn, world: int, *args, use_deepspeed: bool = False, backend: str = "gloo") -> list:
    """fn(rank, world, *args) on `world` processes; returns the list of results. A failing rank fails the call.
    With backend="nccl" rank r runs on cuda:r; results should be moved to the CPU by fn."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(_worker, args=(world, free_port(), out_dir, fn, args, use_deepspeed, backend), nprocs=world,
                     join=True)
        except Exception as e:
            errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
            raise AssertionError("a rank failed:\n" + "\n".join(errors)) from e
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def summed_over(group, loss, model) -> tuple[float, dict]:
    """Back-propagates this rank's share of `loss`, then sums the loss and every parameter's gradient over `group`
    (a parameter no token reached, such as an expert no token chose, counts as zeros): the whole sequence's."""
    import torch
    import torch.distributed as dist

    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad, group=group)
        grads[name] = grad
    return total.item(), grads
