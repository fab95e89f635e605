"""The probe suite's load case (tests/unit/test_probes.py probes single runs): runs that meet in one output folder, and
a disk that is full at every save. Whatever happens, no complete checkpoint is lost or changed, a run that meets
another one's lock exits 2 naming it (its pid and host), and the run that comes last resumes from the newest
intact checkpoint.

Runs are launch/train.py on the tiny model on CPU (one process each); ULYSSES_TRAIN_FAULT (train/process/faults.py)
holds one in the middle of a save, or fails a save as a full disk does, so that what is probed does not depend on
timing.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.trainer_runs import ROOT, TRAIN, child_env, listing_names
from ulysses_train.train.checkpoints import manifest

HANG_GUARD_S = 600  # a hang detector, not a speed requirement
RUN = ["--seq_len", "64", "--tokenizer", "bytes", "--save_steps", "1", "--steps", "4"]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "books.jsonl"
    path.write_text("".join(f'{{"text": "book {i} {"words " * 40}"}}\n' for i in range(6)))
    return path


def command(out, data, *extra) -> list[str]:
    return [sys.executable, TRAIN, "--output_dir", str(out), "--dataset", str(data)] + RUN + list(extra)


def train(out, data, *extra, fault=None) -> subprocess.CompletedProcess:
    env = child_env() | ({"ULYSSES_TRAIN_FAULT": fault} if fault else {})
    return subprocess.run(command(out, data, *extra), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)


def errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def intact(out) -> dict[str, bytes]:
    """Every complete checkpoint, each checked against its manifest: name -> its manifest's bytes."""
    names = listing_names(str(out))
    for name in names:
        assert manifest.damage(str(out / "checkpoints" / name)) is None, name
    return {name: (out / "checkpoints" / name / manifest.MANIFEST).read_bytes() for name in names}


@pytest.mark.slow
def test_runs_meeting_in_one_folder_lose_no_checkpoint_and_name_the_lock(tmp_path, data):
    """A writes checkpoint 1, then is held in the middle of writing checkpoint 2. Meanwhile a second fresh run and a
    --resume auto into the same folder each exit 2 naming A's lock, and touch nothing; A is killed mid-save; the
    next --resume auto takes over the lock (naming A), resumes from checkpoint 1 and trains to the end."""
    out = tmp_path / "run"
    writer = subprocess.Popen(command(out, data), cwd=ROOT, env=child_env() | {"ULYSSES_TRAIN_FAULT": "hold_in_save:2"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        writing = out / "checkpoints" / ".tmp-step_00000002"
        while not writing.is_dir() or not (out / "checkpoints" / "step_00000001").is_dir():
            assert writer.poll() is None, writer.communicate()[1][-3000:]
            time.sleep(0.2)
        before = intact(out)
        assert list(before) == ["step_00000001"]
        holder = f"is in use by another run (pid {writer.pid} on {socket.gethostname()}"
        for extra in ((), ("--resume", "auto")):
            proc = train(out, data, *extra)
            assert proc.returncode == 2 and len(errors(proc)) == 1, proc.stderr[-3000:]
            assert holder in errors(proc)[0] and "Traceback" not in proc.stderr
            assert intact(out) == before and writing.is_dir()  # neither touched the folder
    finally:
        writer.send_signal(signal.SIGKILL)  # dies in the middle of its save
        writer.communicate()
    proc = train(out, data, "--resume", "auto")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"took over {out / '.lock'} from a run that did not end cleanly (pid {writer.pid}" in proc.stdout
    assert f"resumed from {out / 'checkpoints' / 'step_00000001'} at step 1" in proc.stdout + proc.stderr
    after = intact(out)
    assert after["step_00000001"] == before["step_00000001"] and sorted(after)[-1] == "step_00000004"
    assert sorted(os.listdir(out / "checkpoints")) == ["latest"] + sorted(after)  # the killed save's folder went


@pytest.mark.slow
def test_a_full_disk_at_every_save_loses_no_checkpoint(tmp_path, data):
    """The disk is full at save 1, then (resumed each time) at save 2 and at save 3: each run exits 3 with one line
    naming the checkpoint before it (or saying there is none yet), every earlier checkpoint stays as it was, and
    the run after the last one finishes from the newest."""
    out = tmp_path / "run"
    kept = {}
    for step in (1, 2, 3):
        proc = train(out, data, *(("--resume", "auto") if step > 1 else ()), fault=f"enospc_in_save:{step}")
        assert proc.returncode == 3 and len(errors(proc)) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
        line = errors(proc)[0]
        assert line.startswith(f"error: saving checkpoint step_{step:08d} failed (rank 0: [Errno 28] No space left")
        previous = out / "checkpoints" / f"step_{step - 1:08d}"
        assert line.endswith("it was this run's first, so no checkpoint of it exists yet" if step == 1 else
                             f"the previous checkpoint {previous} is untouched"), line
        assert "Traceback" not in proc.stderr
        now = intact(out)
        assert {name: now[name] for name in kept} == kept and list(now) == [f"step_{s:08d}" for s in range(1, step)]
        assert sorted(os.listdir(out / "checkpoints") if now else []) == (["latest"] + list(now) if now else [])
        kept = now
    proc = train(out, data, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = intact(out)
    assert {name: final[name] for name in kept} == kept and sorted(final)[-1] == "step_00000004"
