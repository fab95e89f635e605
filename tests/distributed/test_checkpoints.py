"""Checkpoints and faults, through launch/train.py on CPU with SP=2 and ZeRO-3: two ranks started as plain
processes (tests/ranks.py), and one run under the DeepSpeed launcher, which must end every rank when one fails.

Resumed runs must be bit-identical to straight runs: same data position, RNG states, optimizer and scheduler
state, and deterministic CPU arithmetic, so losses and final weights compare exactly."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.ranks import run_ranks
from tests.trainer_runs import (
    ROOT,
    TRAIN,
    checkpoint_weights,
    child_env,
    deepspeed_launcher,
    launch_port,
    metrics,
    torchrun_launcher,
)

ARGS = ["--seq_len", "128", "--steps", "6", "--save_steps", "3", "--lr", "3e-3"]
HANG_GUARD_S = 600
KILLED = -signal.SIGKILL  # the exit code of a rank that ULYSSES_TRAIN_FAULT=kill... SIGKILLs (rank 0)


def launch(out_dir, extra=(), fault=None, expect_rc=0):
    """Two ranks of launch/train.py with ARGS; every rank must exit with `expect_rc` (KILLED: rank 0 is killed and
    rank 1 fails after it)."""
    ranks = run_ranks(2, [TRAIN] + ARGS + ["--output_dir", out_dir] + list(extra),
                      env={"ULYSSES_TRAIN_FAULT": fault} if fault else None)
    if expect_rc == KILLED:  # rank 1 must fail after rank 0, not hang nor carry on
        as_expected = ranks.codes[0] == KILLED and ranks.codes[1] != 0
    else:
        as_expected = ranks.codes == [expect_rc] * 2
    assert as_expected, (ranks.codes, ranks.stdout[-3000:] + ranks.stderr[-3000:])
    return ranks


def ckpt(out_dir, step):
    return out_dir / "checkpoints" / f"step_{step:08d}"


def latest(out_dir):
    return (out_dir / "checkpoints" / "latest").read_text().strip()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A run without faults, to compare with; it also saves every 2 steps keeping the newest 2 (test_save_total_limit_
    keeps_the_newest), which changes no number."""
    out = tmp_path_factory.mktemp("straight")
    (out / "stdout.txt").write_text(launch(out, ["--save_steps", "2", "--save_total_limit", "2"]).stdout)
    return out


def assert_same_run(a, b):
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == list(range(1, 7))
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    wa, wb = checkpoint_weights(ckpt(a, 6)), checkpoint_weights(ckpt(b, 6))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _safely(read, *args):
    """What `read` returns, or the error it raised: the sequence goes on, and each test names what went wrong."""
    try:
        return read(*args)
    except Exception as e:  # noqa: BLE001
        return repr(e)


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    """One output folder through three crashes, each resumed by the next launch (four launches instead of a crash
    and a resume for each):

        1 kill        SIGKILL at the start of step 4, after step 3 was saved
        2 kill_save   --resume auto (from step 3), trains 4-6, SIGKILL in the middle of saving step 6
        3 enospc      --resume auto (from step 3), trains 4-6, saving step 6 fails as on a full disk (exit 3)
        4 resumed     --resume auto (from step 3), trains 4-6 and saves: the same run as `straight`

    Each of launches 2 to 4 resumes from the checkpoint launch 1 left; what each left is read as it ends."""
    out = tmp_path_factory.mktemp("crashes") / "run"
    r = {"out": out}
    r["kill"] = launch(out, fault="kill:4", expect_rc=KILLED)
    r["kill_latest"], r["kill_metrics"] = _safely(latest, out), _safely(metrics, out)
    r["kill_save"] = launch(out, ["--resume", "auto"], fault="kill_in_save:6", expect_rc=KILLED)
    r["kill_save_latest"], r["kill_save_metrics"] = _safely(latest, out), _safely(metrics, out)
    r["kill_save_left"] = sorted(os.listdir(out / "checkpoints"))
    r["enospc"] = launch(out, ["--resume", "auto"], fault="enospc_in_save:6", expect_rc=3)
    r["enospc_latest"] = _safely(latest, out)
    r["resumed"] = launch(out, ["--resume", "auto"])
    return r


def test_hard_kill_then_resume_is_exact(straight, crashes):
    assert crashes["kill_latest"] == "step_00000003" and len(crashes["kill_metrics"]) == 3
    resumed = crashes["kill_save"]  # the first resume from the killed run's step 3: steps 4-6 as the straight run
    assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout
    assert [r["loss"] for r in crashes["kill_save_metrics"]] == [r["loss"] for r in metrics(straight)]
    assert_same_run(straight, crashes["out"])  # and the last resume from that same checkpoint, weights too


def test_kill_during_save_keeps_latest_on_the_previous_checkpoint(straight, crashes):
    assert crashes["kill_save_latest"] == "step_00000003"
    assert ".tmp-step_00000006" in crashes["kill_save_left"] and "step_00000006" not in crashes["kill_save_left"]
    out = crashes["out"]
    assert latest(out) == "step_00000006" and not (out / "checkpoints" / ".tmp-step_00000006").exists()
    assert_same_run(straight, out)


def test_full_disk_is_reported_and_previous_checkpoint_stays_usable(straight, crashes):
    text = crashes["enospc"].stdout + crashes["enospc"].stderr
    assert "saving checkpoint step_00000006 failed" in text and "No space left on device" in text
    assert "step_00000003 is untouched" in text and crashes["enospc_latest"] == "step_00000003"
    assert "resumed from" in crashes["resumed"].stdout and "at step 3" in crashes["resumed"].stdout
    assert_same_run(straight, crashes["out"])


def test_shared_master_weights_train_exactly_as_a_separate_copy(straight, tmp_path):
    """--share_master_weights (on in `straight`) lets the optimizer update the model's ZeRO-3 partition in place;
    a run with DeepSpeed's separate master copy gives the same losses and weights, bit for bit."""
    copy = tmp_path / "separate_master"
    proc = launch(copy, ["--share_master_weights", "false"])
    assert "master weights share" in (straight / "stdout.txt").read_text()
    assert "master weights share" not in proc.stdout
    assert_same_run(straight, copy)


def test_save_total_limit_keeps_the_newest(straight):
    assert sorted(os.listdir(straight / "checkpoints")) == ["latest", "step_00000004", "step_00000006"]


def test_injected_failure_on_one_rank_ends_all_ranks(tmp_path):
    """Under the DeepSpeed launcher: the launch ends, naming the rank that failed."""
    proc = subprocess.run(deepspeed_launcher(2) + [TRAIN] + ARGS + ["--output_dir", str(tmp_path)], cwd=ROOT,
                          env=child_env() | {"ULYSSES_TRAIN_FAULT": "raise:2:1"}, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode != 0, "expected a failure"
    text = proc.stdout + proc.stderr
    assert "error: rank 1 failed: RuntimeError: injected failure on rank 1 at step 2" in text


def test_nan_loss_stops_naming_the_step_or_is_skipped(tmp_path):
    """Stopped, the run says why once: rank 0 prints and rank 1 waits on the rendezvous store until it has. Rank 0
    destroyed the process group, and the store with it, before printing, so rank 1 lost its connection and, after
    two minutes of c10d's retries, printed the message a second time (4 runs in 6)."""
    proc = launch(tmp_path / "stop", fault="nan:2", expect_rc=3)
    assert "non-finite loss at step 2" in proc.stderr and "--skip_nonfinite" in proc.stderr
    assert proc.stderr.count("non-finite loss at step 2") == 1 and "[rank 1]" not in proc.stderr, proc.stderr[-3000:]
    launch(tmp_path / "skip", ["--skip_nonfinite"], fault="nan:2")
    records = metrics(tmp_path / "skip")
    assert len(records) == 6 and [r["skipped"] for r in records] == [False, True] + [False] * 4
    assert all(torch.isfinite(w).all() for w in checkpoint_weights(ckpt(tmp_path / "skip", 6)).values())


def test_sigterm_saves_and_the_next_launch_resumes(straight, tmp_path):
    """As under SLURM: every task gets SIGTERM; the run saves, exits 0, and `--resume auto` continues. The run
    waits at step 3 until the signal (ULYSSES_TRAIN_FAULT=hold_at:3), so where it stops does not depend on speed."""
    port, out = str(launch_port()), tmp_path / "run"
    args = [sys.executable, TRAIN, "--seq_len", "128", "--steps", "200", "--lr", "3e-3", "--output_dir", str(out)]
    procs = [subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env() | dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                                ULYSSES_TRAIN_FAULT="hold_at:3")) for r in range(2)]
    metrics_file = out / "metrics.jsonl"
    while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 2):
        assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    results = [p.communicate(timeout=HANG_GUARD_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    stopped_at = int(latest(out).removeprefix("step_"))
    assert "SIGTERM received" in results[0][0] + results[0][1] and stopped_at == 3
    total = stopped_at + 2
    base = ["--seq_len", "128", "--steps", str(total), "--lr", "3e-3"]
    subprocess.run(torchrun_launcher(2) + [TRAIN] + base + ["--output_dir", str(out), "--resume", "auto",
                                                          "--resume_override", "steps"],
                   cwd=ROOT, env=child_env(), check=True, capture_output=True, timeout=HANG_GUARD_S)
    # the first run was launched for 200 steps, so its lr schedule differs: compare the data, not the losses, with
    # those of the straight run's first steps (the same --seq_len and data; --steps changes neither)
    resumed = metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, total + 1))
    assert [r["num_tokens"] for r in resumed] == [r["num_tokens"] for r in metrics(straight)[:total]]


def test_export_round_trip_gives_the_training_time_logits(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from ulysses_train.model.build import load_model_config
    from ulysses_train.train.checkpoints.export_model import export

    folder = tmp_path / "base"
    AutoModelForCausalLM.from_config(load_model_config(None, "tiny")).save_pretrained(folder)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, 512)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                            pad_token="<pad>", eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    logits_file = tmp_path / "logits.pt"
    proc = subprocess.run(torchrun_launcher(2) + [os.path.join(ROOT, "tests", "helpers", "train_then_logits.py"),
                                                  "--model", str(folder), "--steps", "2", "--save_steps", "2",
                                                  "--seq_len", "64", "--lr", "3e-3", "--output_dir",
                                                  str(tmp_path / "run")],
                          cwd=ROOT, env=child_env() | {"LOGITS_OUT": str(logits_file)}, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = export(str(tmp_path / "run"), str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert AutoTokenizer.from_pretrained(exported).eos_token == "<eos>"
    ids = torch.arange(3, 3 + 64)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, torch.load(logits_file), rtol=1e-5, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=ids).logits, logits)  # training changed the weights
