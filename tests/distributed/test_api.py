"""The Python API from a plain script: examples/python_api.py's runs (TRL-style settings, --epochs, a linear
schedule, evaluation; then a mixture with ShareGPT rows; an error that raises) in one interpreter, which then holds
nothing of them and exits normally."""

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from tests.trainer_runs import ROOT, child_env

# runs the example in this interpreter, then reports what the runs left behind
DRIVER = """
import glob, json, os, runpy, signal, sys, threading
import torch.distributed as dist
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
report = runpy.run_path(sys.argv[1])["main"](sys.argv[2])
comm = [open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm")]
report["after"] = {
    "gloo_threads": sum(n.startswith(("pt_gloo", "gloo_", "pt_tcpstore")) for n in comm),
    # tqdm's monitor (a sleeping daemon that datasets' progress bars start, whoever calls datasets.map) stays
    "python_threads": [t.name for t in threading.enumerate() if t.name != "tqdm_monitor"],
    "process_group": dist.is_initialized(), "zero3": is_deepspeed_zero3_enabled(),
    "handlers_restored": handlers == (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)),
    "launcher_variables": [v for v in ("RANK", "WORLD_SIZE", "MASTER_PORT") if v in os.environ]}
print("REPORT " + json.dumps(report), flush=True)
"""


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    (out / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in child_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(out / "driver.py"), os.path.join(ROOT, "examples", "python_api.py"),
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]  # a normal exit: no abort in teardown
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("REPORT "))[7:])
    return {"report": report, "out": out, "stdout": proc.stdout}


def test_trl_style_settings_train_with_epochs_a_linear_schedule_and_evaluation(session):
    import torch
    from transformers import get_linear_schedule_with_warmup

    runs, out = session["report"]["runs"], session["out"]
    steps = math.ceil(1 * 16 / 2)  # num_train_epochs x conversations (one per sample) / gradient_accumulation_steps
    # the mixture: half of the 16 and 8 ShareGPT conversations, the same steps
    for (name, run), lr in zip(runs.items(), (3e-3, 1e-2)):
        assert run["steps"] == steps and run["eval_loss"] is not None and run["eval_loss"] > 0
        assert os.path.isdir(run["checkpoint"]) and run["checkpoint"].endswith(f"step_{steps:08d}")
        # after the warmup, transformers' linear schedule (min_lr_ratio 0): each record holds the lr its step used
        warmup = math.ceil(0.25 * steps)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        reference = get_linear_schedule_with_warmup(optimizer, warmup, steps)
        expected = []
        for _ in range(steps):
            expected.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            reference.step()
        assert run["lr"][warmup:] == pytest.approx(expected[warmup:], rel=1e-9)
        assert run["lr"][0] == pytest.approx(lr / (warmup + 1))  # ours: (step + 1) / (warmup + 1), never 0
    assert runs["trl_style"]["eval_loss"] != runs["mixture"]["eval_loss"]
    mixture = yaml.safe_load(open(out / "mixture" / "config.yaml"))["data"]["dataset"]  # grouped by concern
    assert mixture == [{"path": str(out / "train.jsonl"), "weight": 0.5}, {"path": str(out / "sharegpt.jsonl"),
                                                                           "samples": 8}]
    resolved = {k: v for group in yaml.safe_load(open(out / "trl_style" / "config.yaml")).values() for k, v in
                group.items()}
    assert {"learning_rate", "max_seq_length", "num_train_epochs", "assistant_only_loss", "bf16"}.isdisjoint(resolved)
    assert (resolved["lr"], resolved["seq_len"], resolved["grad_accum"], resolved["epochs"], resolved["steps"],
            resolved["warmup_ratio"], resolved["lr_scheduler_type"], resolved["loss_on"], resolved["dtype"]) == (
        0.003, 128, 2, 1.0, steps, 0.25, "linear", "assistant", "fp32")
    # its output is a pipe: step lines without a progress bar, every one found by grep '^step'
    lines = [line for line in session["stdout"].splitlines() if line.startswith("step ")]
    assert len(lines) == 2 * (steps + 1) and "train:" not in session["stdout"]  # and the eval lines


def test_errors_raise_and_the_interpreter_keeps_nothing_of_the_runs(session):
    report = session["report"]
    assert report["error"].startswith("--sp_size 3 does not divide the world size 1")
    assert report["after"] == {"gloo_threads": 0, "python_threads": ["MainThread"], "process_group": False,
                               "zero3": False, "handlers_restored": True, "launcher_variables": []}


# a Trainer held open: train, evaluate, save_model; a misspelt attribute and the aliases of from_flags
HELD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
from ulysses_train import Trainer, TrainConfig
from ulysses_train.errors import ConfigError
from ulysses_train.train.checkpoints.checkpoint import consolidated_state

out, chats, tokenizer, template = sys.argv[1:5]
config = TrainConfig.from_flags({"learning_rate": 3e-3, "max_seq_length": 128, "max_steps": 3, "bf16": False})
try:
    config.data.seq_lenn = 512
    misspelt = None
except AttributeError as e:
    misspelt = str(e)
with Trainer(config, dataset=chats, tokenizer=tokenizer, chat_template=template, val_set_size=0.25,
             output_dir=out + "/run", save_final=False) as trainer:
    result = trainer.train()
    evaluated = trainer.evaluate()
    path = trainer.save_model(out + "/model")
    try:
        trainer.save_model(out + "/model")
        again = None
    except ConfigError as e:
        again = str(e)
    checkpoint = trainer._run.checkpoint
model = AutoModelForCausalLM.from_pretrained(path)
state = consolidated_state(checkpoint)
same = all(torch.equal(p.float(), state[name]) for name, p in model.named_parameters())
print("HELD " + json.dumps({"eval_loss": result.eval_loss, "evaluated": evaluated["eval_loss"], "same": same,
                            "misspelt": misspelt, "again": again, "checkpoint": checkpoint,
                            "steps": [r["step"] for r in result.history]}), flush=True)
"""


def test_a_trainer_evaluates_and_saves_its_model_and_configs_refuse_unknown_attributes(tmp_path):
    from tests.sft_fixtures import arithmetic_chats, chat_folder, write_jsonl

    files = chat_folder(tmp_path)
    (tmp_path / "held.py").write_text(HELD)
    env = {k: v for k, v in child_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(tmp_path / "held.py"), str(tmp_path),
                           write_jsonl(tmp_path / "chats.jsonl", arithmetic_chats(16)), files["tokenizer"],
                           files["template"]],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    held = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("HELD "))[5:])
    assert held["steps"] == [1, 2, 3] and held["eval_loss"] is not None
    assert held["evaluated"] == pytest.approx(held["eval_loss"], rel=1e-6)  # the same weights as the last step's
    assert held["same"] and held["checkpoint"].endswith("step_00000003")  # saved by save_model (no final save)
    assert held["misspelt"] == "DataConfig has no setting 'seq_lenn' (did you mean 'seq_len'?)"
    assert "holds" in held["again"] or "exists" in held["again"] or "not empty" in held["again"], held["again"]
