"""--progress: a bar on a terminal, clean step lines in a redirected log (`grep '^step'` finds them all), nothing
with none; the step line's throughput: positions and trained tokens (no processes)."""

import io
import json

import pytest

from ulysses_train.train.step.metrics import MetricsLogger, progress_mode

RECORD = {"step": 1, "loss": 2.5, "grad_norm": 1.0, "num_tokens": 900, "num_positions": 1024, "conversations": 3,
          "tokens_per_s": 2048.0, "trained_tokens_per_s": 1800.0, "step_time_s": 0.5, "peak_mem_gib": 1.0,
          "lr": 1e-3}


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_auto_is_a_bar_on_a_terminal_and_lines_elsewhere():
    assert progress_mode("auto", Terminal()) == "bar" and progress_mode("auto", io.StringIO()) == "lines"
    assert progress_mode("lines", Terminal()) == "lines" and progress_mode("none", io.StringIO()) == "none"


@pytest.mark.parametrize("progress, lines", [("lines", 3), ("none", 0)])
def test_step_lines_alone_in_a_redirected_log(tmp_path, capsys, progress, lines):
    with MetricsLogger(str(tmp_path), 3, True, log_every=1, progress=progress) as logger:
        for step in (1, 2):
            logger.log(dict(RECORD, step=step), {"eval_loss": 2.0, "eval_tokens": 10, "eval_samples": 1}
                       if step == 2 else {})
        logger.write("saved checkpoint x")
    out = capsys.readouterr()
    assert out.err == "" and "train:" not in out.out
    stepped = [line for line in out.out.splitlines() if line.startswith("step")]
    assert len(stepped) == lines and "saved checkpoint x" in out.out  # events are printed in every mode
    if lines:
        assert stepped[0] == ("step     1 | loss 2.5000 | grad_norm 1.000 | tokens 900 of 1024 | 2048 tok/s (1800 "
                              "trained) | 0.50 s | peak 1.00 GiB | lr 1.00e-03")
        assert stepped[2].startswith("step     2 | eval loss 2.0000")
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and records[0]["trained_tokens_per_s"] == 1800.0


def test_the_first_step_is_announced_where_it_compiles_on_a_gpu():
    """Before a GPU run's first step the log says what makes it slow (FLA autotuned for minutes at 64k on an H200,
    a step line the only sign of life before), naming only what this run uses; on the CPU nothing."""
    from types import SimpleNamespace

    import torch

    from ulysses_train.levers.policy import Levers
    from ulysses_train.train.step.loop import first_step_note

    def run(device, kernel="sdpa", linear=None, fused=False, offload=None):
        return SimpleNamespace(device=torch.device(device), kernel=kernel, offload=offload,
                               linear_kernel=None if linear is None else SimpleNamespace(name=linear),
                               levers=Levers(fused_kernels=fused))

    note = first_step_note(run("cuda", "flash_attn_4", "fla", True, object()))
    assert note.startswith("the first step compiles") and all(
        what in note for what in ("FlashAttention-4", "FLA's DeltaNet", "our Triton", "pinned host pool"))
    alone = first_step_note(run("cuda", linear="fla"))
    assert "FLA's DeltaNet" in alone and "FlashAttention-4" not in alone and "pinned" not in alone
    assert first_step_note(run("cuda")) is None and first_step_note(run("cpu", "flash_attn_4", "fla", True)) is None


def test_the_first_step_says_it_is_alive_until_it_ends():
    """Lines from a thread while the first step runs, with the seconds so far, and none once it ended. With no
    interval (every=0) the thread writes as fast as it runs; the clock says 60 s more at each line."""
    import itertools

    from ulysses_train.train.step.metrics import FirstStepTicker

    lines = []
    with FirstStepTicker(lines.append, every=0, clock=itertools.count(100.0, 60.0).__next__) as ticker:
        while len(lines) < 3:  # the step runs until the thread has written three lines
            ticker._thread.join(0.01)
    written = len(lines)
    assert lines[:3] == [f"first step: {s} s so far (compiling and autotuning once; later steps reuse it)"
                         for s in (60, 120, 180)]
    assert not ticker._thread.is_alive() and len(lines) == written  # stopped with the step
    assert not any(line.startswith("step") for line in lines)  # apart from the step lines
