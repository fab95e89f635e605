"""Experiment trackers (`--report_to`): TensorBoard, Weights & Biases, MLflow, beside metrics.jsonl, on rank 0.

Each works without a network, into the output folder, unless the user points it elsewhere:

- tensorboard: event files under `<output_dir>/tensorboard`.
- wandb: offline mode (files under `<output_dir>/wandb`, `wandb sync` uploads them later) unless `WANDB_MODE` is set
  or an API key is configured (`WANDB_API_KEY`, or `wandb login`); project `WANDB_PROJECT`, default ulysses-train.
- mlflow: the tracking server of `MLFLOW_TRACKING_URI`, else a local file store `<output_dir>/mlruns` (MLflow 3
  keeps that backend in maintenance mode and refuses it unless `MLFLOW_ALLOW_FILE_STORE=true`, which we set for
  our own default only); experiment `MLFLOW_EXPERIMENT_NAME`, default ulysses-train.

A resumed run continues the same wandb and MLflow runs: their ids are kept in `<output_dir>/trackers.json`. Each
tracker holds every step once across a resume (`Trackers.continue_after`): a run that stopped after its last
checkpoint had logged steps past it, which the resumed run trains again. TensorBoard's event files take a purge
step, after which its readers drop what the earlier files hold from that step on (and show the resumed run's
values); wandb and MLflow histories cannot be rewritten, so those steps, already there, are not sent again. The
packages come with the `[track]` extra (`pip install -e ".[track]"`); a tracker named without its package is a
setting to change, said before any work.

The trackers start before the model is built (`start_trackers`, on rank 0, its outcome told to every rank), each
within START_TIMEOUT_S: a tracker that cannot write its folder, or a server that refuses the connection or does
not answer (MLflow retries for minutes by default), stops the run at once with one message naming --report_to and
where it was writing to, instead of failing after the model is built, or being taken for another rank's failure.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch.distributed as dist

from ...deadline import DeadlineExceeded, deadline
from ...errors import ConfigError
from ..config.flag_checks import parse_report_to

PROJECT = "ulysses-train"
START_TIMEOUT_S = 90.0  # as long as wandb.init waits for its own service by default


class Trackers:
    """The chosen trackers of one run; `log(metrics, step, prefix)` sends every number to each. Starting one that
    fails (or runs past START_TIMEOUT_S) raises a ConfigError naming --report_to and where it writes."""

    def __init__(self, names: list[str], output_dir: str, config: dict, resuming: bool):
        self.names, self.output_dir = names, output_dir
        self.held_up_to = 0  # the continued wandb and MLflow runs hold the steps up to this one (continue_after)
        self.ids_path = os.path.join(output_dir, "trackers.json")
        ids = self._saved_ids() if resuming else {}
        self.continued = set(ids)  # the trackers whose run of before goes on (a new one holds no step)
        self.tb = self.wandb_run = self.mlflow = None
        if "tensorboard" in names:
            self.tb = self._start("tensorboard", self._start_tensorboard)
        if "wandb" in names:
            ids["wandb"] = self._start("wandb", lambda: self._start_wandb(config, ids.get("wandb")))
        if "mlflow" in names:
            ids["mlflow"] = self._start("mlflow", lambda: self._start_mlflow(config, ids.get("mlflow")))
        if ids:
            with open(self.ids_path, "w") as f:
                json.dump(ids, f)

    def _start(self, name: str, start):
        try:
            with deadline(START_TIMEOUT_S):
                return start()
        except DeadlineExceeded:
            problem = f"no answer within {START_TIMEOUT_S:g} s"
        except Exception as e:  # noqa: BLE001 - each tracker's own errors (connection, permissions, its server)
            problem = _root_cause(e)
        self.close()  # the trackers started before this one
        raise ConfigError(f"--report_to {name}: the tracker does not start, writing to {self._destination(name)} "
                          f"({problem}): {FIXES[name]}, or leave {name} out of --report_to")

    def _destination(self, name: str) -> str:
        if name == "tensorboard":
            return os.path.join(self.output_dir, "tensorboard")
        if name == "mlflow":
            uri = os.environ.get("MLFLOW_TRACKING_URI")
            return f"MLFLOW_TRACKING_URI={uri}" if uri else os.path.join(self.output_dir, "mlruns")
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        where = os.environ.get("WANDB_BASE_URL", "its server") if mode == "online" else \
            os.path.join(self.output_dir, "wandb")
        return f"{where} (WANDB_MODE {mode})"

    def _start_tensorboard(self, purge_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(os.path.join(self.output_dir, "tensorboard"), purge_step=purge_step)

    def continue_after(self, step: int, logged: int) -> None:
        """A resumed run goes on after checkpoint `step`; the run before it logged up to step `logged`. TensorBoard
        gets a writer whose purge step is `step + 1` (its readers then drop the earlier files' events from there
        on); wandb and MLflow are not sent the steps up to `logged` again (module docstring)."""
        if self.tb is not None:
            self.tb.close()  # opened before the step was known: its file holds only its header
            self.tb = self._start_tensorboard(purge_step=step + 1)
        self.held_up_to = logged

    def _saved_ids(self) -> dict:
        try:
            with open(self.ids_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _start_wandb(self, config: dict, run_id: Optional[str]) -> str:
        import wandb

        online = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.wandb_run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), dir=self.output_dir,
                                    config=config, mode=online, id=run_id, resume="allow" if run_id else None,
                                    name=os.path.basename(os.path.abspath(self.output_dir)))
        return self.wandb_run.id

    def _start_mlflow(self, config: dict, run_id: Optional[str]) -> str:
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = "file:" + os.path.abspath(os.path.join(self.output_dir, "mlruns"))
        mlflow.set_tracking_uri(uri)  # always: an earlier run in this process (the Python API) left its own set
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT))
        run = mlflow.start_run(run_id=run_id, run_name=None if run_id else os.path.basename(
            os.path.abspath(self.output_dir)))
        if not run_id:  # parameters are written once; MLflow refuses to change them
            mlflow.log_params({k: str(v)[:500] for k, v in config.items()})
        self.mlflow = mlflow
        return run.info.run_id

    def log(self, metrics: dict, step: int, prefix: str = "train") -> None:
        numbers = {f"{prefix}/{k}": float(v) for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb_run is not None and not self._holds("wandb", step):
            self.wandb_run.log(numbers, step=step)
        if self.mlflow is not None and not self._holds("mlflow", step):
            self.mlflow.log_metrics(numbers, step=step)

    def _holds(self, name: str, step: int) -> bool:
        return name in self.continued and step <= self.held_up_to

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()
        self.tb = self.wandb_run = self.mlflow = None


def _root_cause(error: BaseException) -> str:
    """The error and, when it wraps others (MLflow wraps requests' wrapping of urllib3's), the one at the bottom:
    `MlflowException: ... ... caused by ConnectionRefusedError: [Errno 111] Connection refused`."""
    def line(e):
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"

    root, seen = error, {id(error)}
    while (root.__cause__ or root.__context__) is not None and id(root.__cause__ or root.__context__) not in seen:
        root = root.__cause__ or root.__context__
        seen.add(id(root))
    return line(error) + (f" ... caused by {line(root)}" if root is not error else "")


FIXES = {"tensorboard": "make the folder writable or choose another --output_dir",
         "wandb": "check WANDB_MODE, WANDB_API_KEY and the network (WANDB_MODE=offline writes to files)",
         "mlflow": "start the server or point MLFLOW_TRACKING_URI at one that answers (unset, MLflow writes to files)"}


def start_trackers(cfg, resuming: bool, rank: int) -> Optional[Trackers]:
    """Collective: rank 0 starts the trackers of --report_to (None on the other ranks, and when there are none);
    a tracker that does not start is a ConfigError on every rank (module docstring)."""
    names = parse_report_to(cfg.log.report_to, cfg.log.tensorboard)
    trackers, error = None, [None]
    if rank == 0 and names:
        try:  # (the output folder exists: the run's lock is in it)
            trackers = Trackers(names, cfg.output.output_dir, cfg.to_dict(), resuming)
        except ConfigError as e:
            error[0] = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise ConfigError(error[0])
    return trackers
