"""Launching the trainer as users do (launch/train.py under python, deepspeed, torchrun or accelerate), and reading
what a run wrote: the helpers the end-to-end tests share."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
COMMON = ["--seq_len", "256", "--steps", "4", "--lr", "3e-3"]
KEYS = {"step", "loss", "grad_norm", "num_tokens", "conversations", "tokens_per_s", "step_time_s", "peak_mem_gib",
        "lr"}


def listing_names(out):
    """The step folders under an output_dir's checkpoints/, oldest first."""
    return sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_"))


def child_env():
    # ROOT first, then whatever the caller had (the GPU host puts its offline wheels on PYTHONPATH)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run(launcher, args: list, out_dir, expect_ok=True) -> subprocess.CompletedProcess:
    """launch/train.py with COMMON and `args`; `launcher` is a command prefix (deepspeed_launcher(2),
    [sys.executable], ...) or plain_ranks(n)."""
    cmd = [TRAIN] + COMMON + ["--output_dir", str(out_dir)] + args
    if isinstance(launcher, dict):
        from tests.ranks import run_ranks

        proc = run_ranks(launcher["plain_ranks"], cmd)  # every rank's exit code: all 0 for returncode 0
    else:
        cmd = launcher + cmd
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
    if expect_ok:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def plain_ranks(n):
    """No launcher: n ranks started as plain processes with the launcher's variables (tests/ranks.py), for tests of
    the trainer rather than of a launcher; the launchers are tested in test_train_e2e.py."""
    return {"plain_ranks": n}


def deepspeed_launcher(n):
    return ["deepspeed", "--num_gpus", str(n), "--master_port", str(launch_port())]


def torchrun_launcher(n):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
            str(launch_port())]


def launch_port():
    from ulysses_train.train.process.launcher import free_port

    return free_port()


def metrics(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    for i, r in enumerate(records, 1):
        assert KEYS <= r.keys() and r["step"] == i
        assert all(isinstance(r[k], (int, float)) for k in KEYS)
        assert r["num_tokens"] > 0 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_mem_gib"] > 0
    return records


def checkpoint_weights(checkpoint):
    """The consolidated fp32 weights of a checkpoint folder (the export path)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ulysses_train.train.checkpoints.checkpoint import safe_loading

    with safe_loading():
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="ds")


def assert_same_curve(a, b):
    assert len(a) == len(b) >= 4
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-3)
        assert ra["num_tokens"] == rb["num_tokens"] and ra["lr"] == pytest.approx(rb["lr"])


def accelerate_launcher(n):
    return ["accelerate", "launch", "--num_processes", str(n), "--num_machines", "1", "--multi_gpu",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(launch_port())]


def deepspeed_shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/deepspeed_*"))
