"""Resuming the real trainer (CPU, gloo, two ranks, SP=2, ZeRO-3): one output folder taken through a sequence of
launches, each the way a user would type it; the tests below read what each launch printed and left.

    1 first      --steps 5 --save_steps 2                    step_2, step_4, step_5 (the final save)
    2 fresh      a new run into the same folder              refused (exit 2), nothing touched
    3 changed    --resume auto --seq_len 512 --seed 7 ...    refused (exit 2), every difference named
    4 done       --resume auto, the same settings            "nothing to do", exit 0
    5 rollback   --resume step_2 --lr 1e-3 --resume_override lr --save_total_limit 2, a torn metrics line
                                                             the newer step_4, step_5 moved aside, new lr applied
    6 damaged    rank 1's shard of step_5 removed; --resume step_5
                                                             exit 3 naming the file
    7 fallback   --resume auto --steps 6 --resume_override steps
                                                             warns about step_5, resumes from step_4, trains 5-6

Three launches train (5, 3 and 2 steps); the other four stop before the model is built."""

import os
import subprocess
import sys

import pytest

from tests.trainer_runs import ROOT, TRAIN, child_env, launch_port, metrics
from ulysses_train.train.step.schedule import warmup_cosine

BASE = ["--seq_len", "256", "--lr", "3e-3"]
HANG_GUARD_S = 600
SHARD = os.path.join("ds", "zero_pp_rank_1_mp_rank_00_model_states.pt")


def ckpt(out, step):
    return os.path.join(out, "checkpoints", f"step_{step:08d}")


def listing(out):
    """Top-level entries of checkpoints/ and the name `latest` holds."""
    root = os.path.join(out, "checkpoints")
    names = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    with open(os.path.join(root, "latest")) as f:
        return names, f.read().strip()


def launch(out, args):
    """Two ranks as plain processes with the launcher's variables (as torchrun or srun set them; a launcher's own
    start-up would double the time of the launches that stop before the model is built). Rank 0's output, and
    every rank's exit code."""
    port = str(launch_port())
    procs = [subprocess.Popen([sys.executable, TRAIN] + BASE + ["--output_dir", str(out)] + args, cwd=ROOT,
                              env=child_env() | dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    (out0, err0), (_, err1) = [p.communicate(timeout=HANG_GUARD_S) for p in procs]
    return {"rc": procs[0].returncode, "codes": [p.returncode for p in procs], "out": out0, "err": err0,
            "text": out0 + err0, "rank1_err": err1}


def safely(read, *args):
    """What `read` returns, or the error it raised: the sequence goes on, and each test names what went wrong."""
    try:
        return read(*args)
    except Exception as e:  # noqa: BLE001
        return repr(e)


@pytest.fixture(scope="module")
def seq(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("resume") / "run")
    r = {"out": out}
    r["first"] = launch(out, ["--steps", "5", "--save_steps", "2"])
    r["first_listing"], r["first_metrics"] = safely(listing, out), safely(metrics, out)
    r["fresh"] = launch(out, ["--steps", "3", "--save_steps", "1", "--save_total_limit", "1", "--seed", "5"])
    r["fresh_listing"] = safely(listing, out)
    r["changed"] = launch(out, ["--steps", "5", "--resume", "auto", "--seq_len", "512", "--seed", "7", "--lr", "1e-3"])
    r["done"] = launch(out, ["--steps", "5", "--resume", "auto"])
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 6, "loss": 6.1')  # a write cut short by a crash
    r["rollback"] = launch(out, ["--steps", "5", "--resume", ckpt(out, 2), "--lr", "1e-3", "--resume_override", "lr",
                                 "--save_steps", "1", "--save_total_limit", "2"])
    r["rollback_listing"], r["rollback_metrics"] = safely(listing, out), safely(metrics, out)
    abandoned = os.path.join(out, "checkpoints", "abandoned")
    r["abandoned"] = sorted(os.path.relpath(os.path.join(d, n), abandoned) for d, dirs, _ in os.walk(abandoned)
                            for n in dirs if n.startswith("step_")) if os.path.isdir(abandoned) else []
    safely(os.remove, os.path.join(ckpt(out, 5), SHARD))
    r["damaged"] = launch(out, ["--steps", "5", "--resume", ckpt(out, 5), "--lr", "1e-3"])
    r["fallback"] = launch(out, ["--steps", "6", "--resume", "auto", "--lr", "1e-3", "--resume_override", "steps"])
    r["fallback_metrics"] = safely(metrics, out)
    return r


def test_the_final_step_is_saved_and_a_fresh_run_into_a_used_folder_is_refused(seq):
    assert seq["first"]["rc"] == 0, seq["first"]["text"][-3000:]
    assert seq["first_listing"] == (["step_00000002", "step_00000004", "step_00000005"], "step_00000005")
    fresh = seq["fresh"]
    assert fresh["codes"] == [2, 2], fresh["text"][-3000:]
    assert "--resume auto" in fresh["err"] and "--overwrite_output_dir" in fresh["err"]
    assert fresh["err"].count("error:") == 1 and "Traceback" not in fresh["err"] + fresh["rank1_err"]
    assert "error:" not in fresh["rank1_err"]  # one message, from rank 0
    assert seq["fresh_listing"] == seq["first_listing"]


def test_changed_settings_are_named_and_a_finished_run_has_nothing_to_do(seq):
    changed = seq["changed"]
    assert changed["codes"] == [2, 2], changed["text"][-3000:]
    for difference in ("seq_len 256 -> 512", "seed 0 -> 7", "lr 0.003 -> 0.001", "--resume_override"):
        assert difference in changed["err"]
    done = seq["done"]
    assert done["codes"] == [0, 0], done["text"][-3000:]
    assert f"nothing to do: {ckpt(seq['out'], 5)} is at step 5 of --steps 5" in done["out"]


def test_rollback_moves_the_newer_line_aside_and_applies_the_new_lr(seq):
    rollback = seq["rollback"]
    assert rollback["rc"] == 0, rollback["text"][-3000:]
    assert "partial last line" in rollback["text"]  # the torn metrics line was dropped with a warning
    # the new line's two newest are kept: pruning never deletes what was just written nor keeps the old line's
    assert seq["rollback_listing"] == (["step_00000004", "step_00000005"], "step_00000005")
    assert [os.path.basename(p) for p in seq["abandoned"]] == ["step_00000004", "step_00000005"]
    abandoned_run = os.path.join(seq["out"], "checkpoints", "abandoned", os.path.dirname(seq["abandoned"][0]))
    with open(os.path.join(abandoned_run, "metrics.jsonl")) as f:
        assert sum(1 for line in f if line.endswith("\n")) == 5  # the old line's metrics are kept with it
    before, after = seq["first_metrics"], seq["rollback_metrics"]
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in after[:2]] == [r["loss"] for r in before[:2]]
    factor = warmup_cosine(5, 0, 0.1)  # a record's lr is the one its step used: step s is the schedule's s - 1
    assert [r["lr"] for r in after[2:]] == pytest.approx([1e-3 * factor(s - 1) for s in (3, 4, 5)], rel=1e-9)


def test_a_missing_shard_is_named_and_auto_falls_back_to_the_newest_intact_checkpoint(seq):
    damaged = seq["damaged"]
    assert damaged["codes"] == [3, 3], damaged["text"][-3000:]
    assert SHARD in damaged["err"] and "missing" in damaged["err"] and "Traceback" not in damaged["err"]
    fallback = seq["fallback"]
    assert fallback["rc"] == 0, fallback["text"][-3000:]
    assert f"{ckpt(seq['out'], 5)} is damaged" in fallback["text"] and SHARD in fallback["text"]
    assert "resumed from" in fallback["out"] and "at step 4" in fallback["out"]
    records = seq["fallback_metrics"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    factor = warmup_cosine(6, 0, 0.1)  # --steps 6: the schedule of a run launched with it
    assert [r["lr"] for r in records[4:]] == pytest.approx([1e-3 * factor(s - 1) for s in (5, 6)], rel=1e-9)
    assert listing(seq["out"]) == (["step_00000004", "step_00000006"], "step_00000006")  # the final save
    assert os.path.isdir(os.path.join(seq["out"], "checkpoints", "abandoned", "rollback_to_step_00000004",
                                      "step_00000005"))  # the damaged one, set aside with the line it ended


def test_export_refuses_an_existing_file_as_the_output(seq, tmp_path, capsys):
    from ulysses_train.tools.export import main

    target = tmp_path / "model.bin"
    target.write_text("keep me")
    assert main([ckpt(seq["out"], 4), str(target)]) == 2
    assert str(target) in capsys.readouterr().err and target.read_text() == "keep me"
    assert main([ckpt(seq["out"], 4), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").exists()
