"""--profile_memory: the dispatch-mode tracker files each allocation under the right category (exact, on a scripted
sequence of phases), and a real training run writes the picture and series with every category the planner names."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ulysses_train.train.step.memory_profile import MemoryTimeline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def test_categories_follow_phases_and_lifetimes():
    timeline = MemoryTimeline("cpu", baseline_bytes=1000)
    with timeline:
        with timeline.in_phase("forward"):
            kept = torch.ones(100)  # alive after the forward: a checkpoint
            temporary = torch.ones(50)  # freed inside the forward: an activation
            del temporary
            with timeline.in_phase("loss"):
                loss_buffer = torch.ones(25)
        with timeline.in_phase("backward"):
            grad = torch.ones(10)
        with timeline.in_phase("optimizer"):
            state = torch.zeros(40)  # alive after the step: optimizer state
            scratch = state + 1  # freed in the step: a temporary
            del scratch
    result = timeline.series(points=50)
    series, peak = result["bytes"], result["peaks"]
    assert peak["model states"] == 1000
    assert peak["checkpoints"] == 400 and peak["activations"] == 200
    assert peak["loss"] == 100 and peak["gradients"] == 40 and peak["optimizer"] == 160 and peak["other"] == 160
    assert series["activations"][-1] == 0 and series["checkpoints"][-1] == 400  # lifetimes, not just sizes
    del kept, loss_buffer, grad, state


@pytest.mark.slow
def test_training_run_writes_the_picture(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--steps", "3", "--seq_len",
                           "256", "--profile_memory", "2", "--output_dir", str(out)], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memory profile: peak" in proc.stdout + proc.stderr
    assert (out / "memory" / "memory.png").stat().st_size > 10_000
    summary = json.loads((out / "memory" / "memory.json").read_text())
    from ulysses_train.model.build import load_model_config

    config = load_model_config(None, "tiny")
    params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_config(config).parameters())
    gib = 2**30
    peak = summary["peak_gib"]
    assert peak["model states"] * gib >= 4 * params  # fp32 weights at least
    assert peak["optimizer"] * gib >= 8 * params * 0.99  # Adam's two fp32 states, made on the first step
    # every layer's input is saved for the backward (fp32 on CPU): layers x tokens x hidden x 4 bytes, at least
    assert peak["checkpoints"] * gib >= config.num_hidden_layers * 256 * config.hidden_size * 4
    for category in ("gradients", "recomputed layer", "loss"):
        assert peak[category] > 0, category
    assert len(summary["series"]["ops"]) > 100
