"""End to end through launch/train.py on CPU (gloo): the trainer as users run it, under the DeepSpeed launcher,
torchrun and accelerate launch, and elsewhere as plain rank processes (no launcher's start-up to pay).

The sharded runs must reproduce the loss curve of the unsharded run with the same global batch: fp32 on CPU, the
same data, the same initial weights (zero.Init broadcasts rank 0's), so differences are reduction-order rounding
(rel 1e-4 after several optimizer steps)."""

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


def _env():
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
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    if expect_ok:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def plain_ranks(n):
    """No launcher: n ranks started as plain processes with the launcher's variables (tests/ranks.py), for tests of
    the trainer rather than of a launcher; the launchers are tested below."""
    return {"plain_ranks": n}


def deepspeed_launcher(n):
    return ["deepspeed", "--num_gpus", str(n), "--master_port", str(_port())]


def torchrun_launcher(n):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", str(_port())]


def _port():
    from ulysses_train.train.launcher import free_port

    return free_port()


def metrics(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    for i, r in enumerate(records, 1):
        assert KEYS <= r.keys() and r["step"] == i
        assert all(isinstance(r[k], (int, float)) for k in KEYS)
        assert r["num_tokens"] > 0 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_mem_gib"] > 0
    return records


def assert_same_curve(a, b):
    assert len(a) == len(b) >= 4
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-3)
        assert ra["num_tokens"] == rb["num_tokens"] and ra["lr"] == pytest.approx(rb["lr"])


def accelerate_launcher(n):
    return ["accelerate", "launch", "--num_processes", str(n), "--num_machines", "1", "--multi_gpu",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_port())]


def deepspeed_shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/deepspeed_*"))


def test_sp2_matches_single_process_under_deepspeed_torchrun_and_accelerate(tmp_path):
    shm_before = deepspeed_shm_segments()
    run([sys.executable], [], tmp_path / "single")
    ds = run(deepspeed_launcher(2), [], tmp_path / "ds_sp2")  # sp_size defaults to the ranks on the node
    assert "dp 1 x sp 2" in ds.stdout
    # --save_final (on by default): a finished run leaves its weights even without --save_steps
    assert (tmp_path / "ds_sp2" / "checkpoints" / "step_00000004" / "COMPLETE").exists()
    run(torchrun_launcher(2), ["--sp_size", "2"], tmp_path / "torchrun_sp2")
    run(accelerate_launcher(2), ["--sp_size", "2"], tmp_path / "accelerate_sp2")
    single = metrics(tmp_path / "single")
    for launcher in ("ds_sp2", "torchrun_sp2", "accelerate_sp2"):
        assert_same_curve(metrics(tmp_path / launcher), single)
    assert single[-1]["loss"] < single[0]["loss"]
    # DeepSpeed's CPU shared-memory all-reduce leaves 66 MB per rank in /dev/shm; enough runs OOM the machine
    assert deepspeed_shm_segments() <= shm_before


def test_dp2_sp2_matches_dp2_sp1_with_accumulation(tmp_path):
    args = ["--grad_accum", "2"]
    run(plain_ranks(2), args + ["--sp_size", "1"], tmp_path / "dp2_sp1")
    out = run(plain_ranks(4), args + ["--sp_size", "2"], tmp_path / "dp2_sp2")
    assert "dp 2 x sp 2" in out.stdout
    assert_same_curve(metrics(tmp_path / "dp2_sp2"), metrics(tmp_path / "dp2_sp1"))


def test_local_model_folder(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from ulysses_train.model.build import load_model_config

    folder = tmp_path / "tiny_model"
    config = load_model_config(None, "tiny")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, 512)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                            pad_token="<pad>", eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    out = run(plain_ranks(2), ["--model", str(folder), "--tensorboard"], tmp_path / "out")
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))
    assert "done: 4 steps" in out.stdout and "tokenizer TokenizersBackend" in out.stdout
    # the first step's loss is the saved model's loss on the first sample: the weights were loaded, not re-drawn
    import torch

    from ulysses_train.data.sources import SyntheticTokens

    ids = SyntheticTokens(512, 256, seed=0).sample(0)[None]
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
    assert metrics(tmp_path / "out")[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_pad_to_sp_trains_an_odd_length(tmp_path):
    run(plain_ranks(2), ["--seq_len", "255", "--pad_to_sp"], tmp_path)
    assert all(r["num_tokens"] == 254 for r in metrics(tmp_path))  # 255 tokens, 254 targets; padding ignored


def test_text_folder_with_packing_under_sp2_and_cache_hit(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    for i in range(3):
        (books / f"book{i}.txt").write_text(" ".join(["chapter", str(i), "the cat sat on the mat."] * 400))
    args = ["--dataset", str(books), "--tokenizer", "bytes", "--seq_len", "2048", "--sp_size", "2", "--packing",
            "--data_cache_dir", str(tmp_path / "cache")]
    first = run(plain_ranks(2), args, tmp_path / "first")
    assert "cache written, packing True" in first.stdout
    second = run(plain_ranks(2), args, tmp_path / "second")
    assert "cache hit, packing True" in second.stdout
    a, b = metrics(tmp_path / "first"), metrics(tmp_path / "second")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # same data, same order
    assert a[-1]["loss"] < a[0]["loss"]
