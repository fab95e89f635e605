"""Experiment trackers and config files, with the real packages (the [track] extra) and the real trainer.

One run from a YAML config (with a command-line override) logs to TensorBoard, Weights & Biases (offline) and
MLflow (a local file store); the test reads each tracker's own files back and finds every step's loss of
metrics.jsonl there. The run stops after step 3 with its checkpoint at step 2, and is resumed for three more
steps: the same wandb and MLflow runs continue, and every tracker holds each step once."""

import glob
import json
import subprocess
import sys

import pytest
import yaml

from tests.trainer_runs import ROOT, TRAIN, child_env, metrics
from tests.wandb_files import wandb_records
from ulysses_train.errors import ConfigError
from ulysses_train.train.config.config_file import parse_args
from ulysses_train.train.config.flag_checks import parse_report_to

pytest.importorskip("wandb", reason="the [track] extra: pip install -e '.[track]'")
pytest.importorskip("mlflow", reason="the [track] extra: pip install -e '.[track]'")


def _train(args, tmp_path, env=None):
    import subprocess

    proc = subprocess.run([sys.executable, TRAIN] + args, cwd=ROOT, capture_output=True, text=True,
                          env=child_env() | {"WANDB_SILENT": "true"} | (env or {}), timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _tensorboard_steps(out) -> list[tuple[int, float]]:
    """(step, loss) as TensorBoard shows them: its own reader, which drops what a resumed run's purge step orphans."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def _tensorboard_losses(out) -> list[float]:
    return [loss for _, loss in _tensorboard_steps(out)]


def _mlflow_steps(out) -> tuple[list[tuple[int, float]], dict]:
    from mlflow.tracking import MlflowClient

    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"file:{out / 'mlruns'}")
    history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: (m.step, m.timestamp))
    return [(m.step, m.value) for m in history], client.get_run(run_id).data.params


def _mlflow_losses(out) -> tuple[list[float], dict]:
    history, params = _mlflow_steps(out)
    return [loss for _, loss in history], params


def _wandb_steps(out) -> list[int]:
    """The steps of train/loss in every offline run folder, in the order they were logged."""
    steps = []
    for path in sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                if "train/loss" in items:
                    steps.append(int(items["_step"]))
    return steps


def test_trackers_write_their_files_from_a_config_file_and_continue_on_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"max_steps": 3, "seq_len": 512, "lr": 3e-3, "report_to": ["tensorboard", "wandb",
                                                                                                  "mlflow"],
                                      "save_steps": 2, "save_final": False, "output_dir": str(out)}))
    _train(["--config", str(config), "--seq_len", "128"], tmp_path)  # the command line wins over the file
    records = metrics(out)
    losses = [r["loss"] for r in records]
    assert len(records) == 3 and all(r["num_tokens"] == 127 for r in records)
    assert _tensorboard_losses(out) == pytest.approx(losses)
    mlflow_losses, params = _mlflow_losses(out)
    assert mlflow_losses == pytest.approx(losses) and params["seq_len"] == "128" and params["lr"] == "0.003"
    (wandb_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    logged = open(wandb_file, "rb").read()
    assert b"train/loss" in logged and all(json.dumps(loss).encode() in logged for loss in losses)
    # the resolved settings are a config file again: read back, they give the same run
    resolved, _ = parse_args(["--config", str(out / "config.yaml")])
    assert (resolved.data.seq_len, resolved.optim.steps) == (128, 3)
    assert resolved.log.report_to == "tensorboard,wandb,mlflow"

    # step 3 was trained after the last checkpoint (step 2): the resumed run trains it again, and no tracker may
    # show it twice (TensorBoard's reader kept both) nor lose a step
    _train(["--config", str(out / "config.yaml"), "--steps", "6", "--resume", "auto", "--resume_override", "steps"],
           tmp_path)
    records = metrics(out)
    resumed = [r["loss"] for r in records]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and resumed[:2] == losses[:2]
    tensorboard, mlflow_history = _tensorboard_steps(out), _mlflow_steps(out)[0]
    assert [step for step, _ in tensorboard] == [1, 2, 3, 4, 5, 6]
    assert [loss for _, loss in tensorboard] == pytest.approx(resumed)  # the resumed run's step 3
    # the same MLflow run and wandb run id; their histories cannot be rewritten: step 3 keeps its first value
    assert [step for step, _ in mlflow_history] == [1, 2, 3, 4, 5, 6]
    assert [loss for _, loss in mlflow_history] == pytest.approx(losses + resumed[3:])
    assert _wandb_steps(out) == [1, 2, 3, 4, 5, 6]
    assert len(glob.glob(str(out / "wandb" / "offline-run-*"))) == 2  # wandb resumes the run id in a new folder
    assert len({p.split("-")[-1] for p in glob.glob(str(out / "wandb" / "offline-run-*"))}) == 1


def test_a_tracker_added_on_resume_gets_every_step_it_has_not_seen(tmp_path, monkeypatch):
    """Only a continued run is spared the steps it holds: MLflow, first named on the resume, starts a run of its
    own and gets the retrained step 3 (the stopped run logged 1-3, its checkpoint is step 2), which TensorBoard,
    continued, shows with its new value."""
    from ulysses_train.train.step.tracking import Trackers

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    before = Trackers(["tensorboard"], str(tmp_path), {"lr": 1}, resuming=False)
    for step in (1, 2, 3):
        before.log({"loss": float(step)}, step)
    before.close()
    after = Trackers(["tensorboard", "mlflow"], str(tmp_path), {"lr": 1}, resuming=True)
    after.continue_after(2, 3)
    for step in (3, 4):
        after.log({"loss": step + 0.5}, step)
    after.close()
    assert _tensorboard_steps(tmp_path) == [(1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]
    assert _mlflow_steps(tmp_path)[0] == [(3, 3.5), (4, 4.5)]


def test_report_to_and_config_file_errors_name_the_flag(tmp_path, capsys):
    assert parse_report_to("none") == [] and parse_report_to("tensorboard,wandb", True) == ["tensorboard", "wandb"]
    with pytest.raises(ConfigError, match="--report_to comet: unknown tracker comet"):
        parse_report_to("comet")
    bad = tmp_path / "bad.yaml"
    for text, expected in (("seq_lenn: 5\n", "1 unsupported key: seq_lenn (nearest flag: --seq_len)"),
                           ("seq_len: [5\n", "is not valid YAML"),
                           ("- 5\n", "must hold a mapping of flag names to values"),
                           ("seq_len: many\n", f"--config {bad}: seq_len: invalid int value: 'many'")):
        bad.write_text(text)
        with pytest.raises(ConfigError) as e:  # the CLI prints it once (rank 0), exit 2
            parse_args(["--config", str(bad)])
        assert expected in str(e.value)


def _refused_uri() -> str:
    """An http URI on this host where nothing listens (the connection is refused at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_tracker_that_cannot_start_is_named_before_the_model_is_built(tmp_path, monkeypatch):
    """Rank 0's own MLflow ConnectionRefusedError was taken for a peer's failure: no message, no errors/rank_0.txt,
    minutes of MLflow's retries, exit 3 once training started. The trackers now start before the model is built,
    each within a time limit, and a failure names --report_to and where it writes; every exit path releases the
    output folder's lock (an exit 2 left it filled, and the next run warned it took over from a run that died)."""
    import socket

    from ulysses_train.train.config.train_config import TrainConfig
    from ulysses_train.train.step import tracking

    uri = _refused_uri()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = TrainConfig.from_flags({"report_to": "mlflow", "output_dir": str(tmp_path / "a")})
    with pytest.raises(ConfigError, match=rf"^--report_to mlflow: the tracker does not start, writing to "
                                          rf"MLFLOW_TRACKING_URI={uri} \(.*Connection refused.*\): start the server "
                                          rf"or point MLFLOW_TRACKING_URI at one that answers"):
        tracking.start_trackers(cfg, resuming=False, rank=0)
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "tensorboard").write_text("")  # a file where its folder goes
    with pytest.raises(ConfigError, match=rf"^--report_to tensorboard: the tracker does not start, writing to "
                                          rf"{tmp_path / 'tb' / 'tensorboard'} \(FileExistsError"):
        tracking.start_trackers(TrainConfig.from_flags({"report_to": "tensorboard",
                                                           "output_dir": str(tmp_path / "tb")}), False, 0)
    with socket.socket() as silent:  # accepts connections, never answers: MLflow would wait 120 s per request
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(tracking, "START_TIMEOUT_S", 1.0)
        with pytest.raises(ConfigError, match=r"--report_to mlflow: the tracker does not start, .* \(no answer within "
                                              r"1 s\)"):
            tracking.start_trackers(cfg, resuming=False, rank=0)

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, TRAIN, "--output_dir", str(out), "--steps", "2", "--seq_len", "64",
                           "--report_to", "mlflow"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=child_env() | {"MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"error: --report_to mlflow: the tracker does not start, writing to MLFLOW_TRACKING_URI={uri}" in proc.stderr
    assert "Traceback" not in proc.stderr and "levers:" not in proc.stdout  # before the model was built
    assert (out / ".lock").read_text() == ""  # released: the next run takes it without a warning
