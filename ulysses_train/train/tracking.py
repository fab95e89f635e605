"""Experiment trackers (`--report_to`): TensorBoard, Weights & Biases, MLflow, beside metrics.jsonl, on rank 0.

Each works without a network, into the output folder, unless the user points it elsewhere:

- tensorboard: event files under `<output_dir>/tensorboard`.
- wandb: offline mode (files under `<output_dir>/wandb`, `wandb sync` uploads them later) unless `WANDB_MODE` is set
  or an API key is configured (`WANDB_API_KEY`, or `wandb login`); project `WANDB_PROJECT`, default ulysses-train.
- mlflow: the tracking server of `MLFLOW_TRACKING_URI`, else a local file store `<output_dir>/mlruns` (MLflow 3
  keeps that backend in maintenance mode and refuses it unless `MLFLOW_ALLOW_FILE_STORE=true`, which we set for
  our own default only); experiment `MLFLOW_EXPERIMENT_NAME`, default ulysses-train.

A resumed run continues the same wandb and MLflow runs: their ids are kept in `<output_dir>/trackers.json`. The
packages come with the `[track]` extra (`pip install -e ".[track]"`); a tracker named without its package is a
setting to change, said before any work.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Optional

from ..errors import ConfigError

TRACKERS = ("none", "tensorboard", "wandb", "mlflow")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
PROJECT = "ulysses-train"


def parse_report_to(value: str, tensorboard_flag: bool = False) -> list[str]:
    """`--report_to` as a list (comma-separated, `none` for nothing); `--tensorboard` adds tensorboard. Raises a
    ConfigError for an unknown name or a tracker whose package is missing."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"--report_to {value}: unknown tracker {', '.join(unknown)}; choose from "
                          f"{', '.join(TRACKERS)} (several with commas)")
    chosen = [n for n in names if n != "none"] + (["tensorboard"] if tensorboard_flag else [])
    chosen = list(dict.fromkeys(chosen))
    missing = [n for n in chosen if importlib.util.find_spec(PACKAGES[n]) is None]
    if missing:
        raise ConfigError(f"--report_to {','.join(missing)}: the {' and '.join(PACKAGES[n] for n in missing)} "
                          f"package is not installed: pip install -e \".[track]\", or leave it out of --report_to")
    return chosen


class Trackers:
    """The chosen trackers of one run; `log(metrics, step, prefix)` sends every number to each."""

    def __init__(self, names: list[str], output_dir: str, config: dict, resuming: bool):
        self.names, self.output_dir = names, output_dir
        self.ids_path = os.path.join(output_dir, "trackers.json")
        ids = self._saved_ids() if resuming else {}
        self.tb = self.wandb_run = self.mlflow = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if "wandb" in names:
            ids["wandb"] = self._start_wandb(config, ids.get("wandb"))
        if "mlflow" in names:
            ids["mlflow"] = self._start_mlflow(config, ids.get("mlflow"))
        if ids:
            with open(self.ids_path, "w") as f:
                json.dump(ids, f)

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

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri("file:" + os.path.abspath(os.path.join(self.output_dir, "mlruns")))
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
        if self.wandb_run is not None:
            self.wandb_run.log(numbers, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics(numbers, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()
