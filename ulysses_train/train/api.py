"""The Python API: train from a script or a notebook, in the calling process.

    from ulysses_train import TrainConfig, train

    result = train("run.yaml", learning_rate=1e-4)      # a YAML file, a dict or a TrainConfig, and overrides
    result.eval_loss, result.checkpoint, result.metrics

`train` runs as one process, or as one rank under any launcher (deepspeed, torchrun, accelerate, srun: every rank
calls it). Settings are read as the command line reads them (train/config/config_file.py): every flag and its aliases,
the same checks. It returns a `TrainResult` and never exits the interpreter: a setting to change raises ConfigError, a
checkpoint that cannot be written or read CheckpointError, a non-finite loss NonFiniteError, SIGTERM or Ctrl-C
before training `Interrupted`, anything else its own exception. When it returns or raises, the run has released
what it held (the engine, the process groups it created, the watchdog's thread, signal handlers, the output
folder's lock, the launcher variables it set for a single process), so the interpreter goes on and can train again.
`launch/train.py` is this function and exit codes (cli.py).

`Trainer` holds a run open between calls, as transformers' Trainer does:

    with Trainer("run.yaml", val_set_size=0.1) as trainer:
        result = trainer.train()
        trainer.evaluate()                 # {"eval_loss": ..., "eval_tokens": ...}, under SP like training's
        trainer.save_model("outputs/model")  # a transformers folder (a PEFT adapter folder under --use_peft)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Optional, Union

from ..errors import ConfigError
from .config.config_file import config_from
from .config.train_config import TrainConfig

# the launcher variables a single process sets for itself (launcher.py), put back as they were after the run
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ULYSSES_TRAIN_LAUNCHER")


@dataclass
class TrainResult:
    """What a run did, the same on every rank."""

    config: TrainConfig  # the settings as resolved (what <output_dir>/config.yaml holds)
    history: list = field(default_factory=list)  # one record per step trained by this call (metrics.jsonl's)
    checkpoint: Optional[str] = None  # the newest checkpoint of the run (saved, or resumed from), None if none
    stopped: Optional[str] = None  # why the run stopped before its last step (SIGTERM, the launcher gone), or None
    verify: Optional[dict] = None  # --verify's result (verify.json), with `passed`
    message: Optional[str] = None  # when there was nothing to do: why

    @property
    def metrics(self) -> dict:
        """The last trained step's record ({} when no step was trained)."""
        return self.history[-1] if self.history else {}

    @property
    def eval_loss(self) -> Optional[float]:
        """The last evaluation's loss (--eval_dataset), None without one."""
        return next((r["eval_loss"] for r in reversed(self.history) if "eval_loss" in r), None)

    @property
    def output_dir(self) -> str:
        return self.config.output.output_dir


def train(config: Union[TrainConfig, dict, str, os.PathLike, None] = None, /, **overrides) -> TrainResult:
    """Trains (or with `verify=True` checks) one run and returns its TrainResult. `config`: a TrainConfig, a dict or
    the path of a YAML file whose keys are flags or their aliases (`--config`'s form); `overrides` win over it."""
    cfg, explicit = config_from(config, overrides)
    return run(cfg, explicit)


# Environment defaults of a run's processes, each kept where the user set it: the allocator's expandable segments
# (long sequences fragment it), read when CUDA starts, before any allocation here. Not among them: Triton's
# TRITON_CACHE_AUTOTUNING. The only autotuned kernels a run uses are FLA's, and FLA (>= 0.6, our [fla] extra) asks
# Triton to keep their autotuning results on disk itself (its FLA_CACHE_RESULTS, on unless set to 0), so a resumed or
# repeated run on the same machine skips that part of the first step whatever the knob says.
PROCESS_DEFAULTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def process_defaults() -> None:
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)


def run(cfg: TrainConfig, explicit: set[str], process_exits: bool = False) -> TrainResult:
    """The run of a parsed config (`explicit`: the settings given, not defaulted; train/config/ds_config.py reconciles
    them with the DeepSpeed JSON). `process_exits`: the process ends with the run (the command line), which then
    leaves the default process group it created for the process's exit (run.trainer.Trainer says why)."""
    from .checkpoints.resume import NothingToDo
    from .run.trainer import Trainer
    from .step.loop import train as train_loop

    process_defaults()
    quiet_libraries()
    cfg = copy.deepcopy(cfg)  # the run resolves some settings in place (--epochs); the caller's stays
    result = TrainResult(cfg)
    with launcher_environment():
        try:
            trainer = Trainer(cfg, explicit, process_exits)
        except NothingToDo as e:  # every rank knows it; rank 0 says it
            if int(os.environ.get("RANK", 0)) == 0:
                print(e, flush=True)
            return dataclasses.replace(result, checkpoint=e.checkpoint, message=str(e))
        try:
            if cfg.check.verify:
                from .verify.verify import run_verify

                result.verify = run_verify(trainer)
            else:
                result.history = train_loop(trainer)
                result.stopped = trainer.stop.reason if trainer.stop.requested else None
                _say_done(trainer, result)
            result.checkpoint = trainer.checkpoint
            trainer.barrier()  # no rank leaves while another still talks to it
        finally:
            trainer.close()
            del trainer
            gc.collect()  # the engine's cycles hold the groups (and their threads) until collected
    return result


class Trainer:
    """A run built and held until `close()` (or the end of a `with` block): `train()`, `evaluate()` and
    `save_model(path)`, every rank calling each (module docstring). Settings as `train()` takes them."""

    def __init__(self, config: Union[TrainConfig, dict, str, os.PathLike, None] = None, /, **overrides):
        from .run.trainer import Trainer as Run

        cfg, explicit = config_from(config, overrides)
        quiet_libraries()
        self.config = copy.deepcopy(cfg)  # resolved by the run (--epochs, --evals_per_epoch)
        self._held = contextlib.ExitStack()
        self._held.enter_context(launcher_environment())
        try:
            self._run = Run(self.config, explicit)
        except BaseException:
            self._held.close()
            raise
        self._held.callback(self._run.close)
        self.step = self._run.start_step  # the last finished step (the resumed one before training)

    def train(self) -> TrainResult:
        """Trains from the last finished step to --steps (saving as the flags say) and returns what it did."""
        from .step.loop import train as train_loop

        run = self._live()
        result = TrainResult(self.config, history=train_loop(run))
        result.stopped = run.stop.reason if run.stop.requested else None
        self.step = result.history[-1]["step"] if result.history else self.step
        _say_done(run, result)
        result.checkpoint = run.checkpoint
        run.barrier()
        return result

    def evaluate(self) -> dict:
        """The eval set's loss at the current weights ({"eval_loss", "eval_tokens", "eval_samples", ...}), under SP
        as during training: --eval_dataset, or the share of --dataset that --val_set_size holds out."""
        from .step.loop import evaluate

        run = self._live()
        if run.eval_source is None:
            raise ConfigError("evaluate() needs an eval set: give eval_dataset, or val_set_size to hold out part of "
                              "the dataset")
        return evaluate(run, run.eval_source, self.config.eval.eval_samples)

    def save_model(self, path: Union[str, os.PathLike], dtype: str = "auto") -> str:
        """The weights of the last finished step as a transformers folder at `path` (under --use_peft, a PEFT
        adapter folder): that step's checkpoint, saved now if it was not, exported as `python -m
        ulysses_train.export` does. `path` must not hold files yet."""
        import torch.distributed as dist

        from .checkpoints.checkpoint import checkpoint_step
        from .checkpoints.export_model import export

        run, path = self._live(), os.fspath(path)
        if run.checkpoint is None or checkpoint_step(run.checkpoint) != self.step:
            if self.step == 0:
                raise ConfigError("save_model() saves trained weights: call train() first")
            run.save(self.step)
        error = [None]
        if run.rank == 0:
            try:
                with _plain_models(run):
                    export(run.checkpoint, path, dtype)
            except ConfigError as e:
                error = [str(e)]
        dist.broadcast_object_list(error, src=0)  # every rank raises rank 0's error, none waits for it
        if error[0]:
            raise ConfigError(error[0])
        return path

    def close(self) -> None:
        """Releases the run (api.py's module docstring); idempotent."""
        self._held.close()
        self._run = None
        gc.collect()  # the engine's cycles hold the groups (and their threads) until collected

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live(self):
        if self._run is None:
            raise RuntimeError("this Trainer is closed")
        return self._run


@contextlib.contextmanager
def _plain_models(run):
    """transformers builds whole models (the export's), not ZeRO-3 partitions, while the run's setting is off."""
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    if run._hf_ds is None:
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(run._hf_ds)


def _say_done(trainer, result: TrainResult) -> None:
    history = result.history
    if trainer.rank == 0 and history:
        print(f"done: {history[-1]['step']} steps, loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}, "
              f"metrics in {os.path.join(trainer.cfg.output.output_dir, 'metrics.jsonl')}", flush=True)


@contextlib.contextmanager
def launcher_environment():
    """The torch.distributed variables of whichever launcher started this process (launcher.py); those that a
    single process sets for itself (rank 0 of 1, a free port) are put back afterwards, so the next run picks its own
    port."""
    from .process.launcher import normalise_launcher_env

    before = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    normalise_launcher_env()
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def quiet_libraries() -> None:
    # torch renamed these collectives; DeepSpeed still calls the old names once per bucket, every step
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
