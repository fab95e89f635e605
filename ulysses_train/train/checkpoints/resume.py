"""Where a run starts: the checkpoint it resumes from and whether its settings may continue that checkpoint.

Rank 0 decides, before the model is built, and tells every rank (one message, the same exception everywhere):
the output folder must be writable (run_folder.py); `--resume` resolves to a checkpoint whose files match its
manifest (checkpoint.py); a fresh run may not start in a folder holding another run's checkpoints; and a resumed
run's settings are compared with those saved in the checkpoint's trainer_state.json.

A setting that alters what is trained (every flag but FREE_SETTINGS) and differs from the checkpoint's is a
ConfigError naming each difference (old -> new) unless `--resume_override` names it; an override is then applied.
Settings that decide which tensors are trained and their shapes (SHAPE_SETTINGS: LoRA or every weight, the
adapters' rank and modules) cannot be overridden: a checkpoint holds only the tensors its run trained, and DeepSpeed
would fail on the first size that differs. Such a change is refused with what to do instead (restore the values,
or start a new --output_dir from the exported weights). After the engine is built, the trained tensors' names and
shapes are compared with those the checkpoint saved (check_trained_shapes), which also names a model_config
override that changes a shape, before DeepSpeed's load meets it.
The learning-rate schedule is a pure function of the step and the flags (--lr, --steps or --epochs,
--warmup_steps or --warmup_ratio, --lr_scheduler_type, --min_lr_ratio: schedule.py): a resumed run follows the
schedule of a run launched with its own flags, from the resumed step on. With unchanged flags that is exactly the
schedule the checkpoint was on; with a new --steps the lr jumps to the new schedule's value at that step (extending a
finished cosine from 100 to 200 steps takes the lr from its floor back to the middle of the longer cosine, about 55% of
--lr with the defaults: pass a lower --lr as well to continue lower).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...data.content import dataset_content
from ...errors import CheckpointError, ConfigError
from ..config.train_config import FREE_SETTINGS, SHAPE_SETTINGS, TrainConfig
from .checkpoint import read_trainer_state, resolve_resume, safe_loading
from .run_folder import check_writable, claim_for_fresh_run

SCHEDULE_SETTINGS = ("lr", "steps", "warmup_steps", "min_lr_ratio", "epochs", "warmup_ratio", "lr_scheduler_type")
LAUNCH_ONLY = ("resume", "resume_override", "overwrite_output_dir")  # differ between launches by nature

__all__ = ["FREE_SETTINGS", "NothingToDo", "ResumePlan", "SHAPE_SETTINGS", "apply_optimizer_settings",
           "apply_schedule", "check_trained_shapes", "compare_settings", "plan_run", "training_settings"]


class NothingToDo(Exception):
    """The checkpoint is already at or past --steps; the message says so and the run exits 0."""

    def __init__(self, message: str, checkpoint: Optional[str] = None):
        super().__init__(message)
        self.checkpoint = checkpoint


@dataclass
class ResumePlan:
    checkpoint: Optional[str] = None  # None: a fresh run
    step: int = 0
    overridden: list[str] = field(default_factory=list)


def training_settings(cfg: TrainConfig, resolved: dict) -> dict:
    """The settings that alter what is trained, as this run resolves them. Flags with derived defaults (lr, micro
    batch, accumulation, clipping, dtype) take their resolved values, so that `--lr 1e-3` over a run that defaulted
    to 1e-3 is no change; ds_config and a model_config file are their JSON content, so that a moved file with the
    same content is no change either, and a file edited in place is one."""
    settings = {name: value for name, value in cfg.to_dict().items() if name not in FREE_SETTINGS}
    return settings | resolved


CONTENT_SETTINGS = ("ds_config", "model_config", "dataset")  # compared by their files' content, named by their paths


def dataset_setting(dataset) -> dict:
    """--dataset as the resume check compares it: a local dataset by the digests of its files' bytes (an edit that
    kept the size and the modification time is a change: data/content.py), a hub id by its name."""
    content = dataset_content(dataset)
    return {"dataset": {"path": dataset, "content": content}} if content else {}


def _show(name: str, value, config: dict) -> str:
    if name in CONTENT_SETTINGS and isinstance(value, dict):  # the content differs; show the path
        return str(config.get(name))
    return str(value)


def _describe(name: str, old, new, old_config: dict, new_config: dict) -> str:
    before, after = _show(name, old, old_config), _show(name, new, new_config)
    if before == after and name in CONTENT_SETTINGS:
        return f"{name} {after} (its content differs from the checkpoint's: edited since?)"
    return f"{name} {before} -> {after}"


def _same(name: str, old, new, new_config: dict) -> bool:
    """A checkpoint saved before model_config or dataset was compared by content holds its path (or paths): compared
    as a path."""
    if name in ("model_config", "dataset") and not isinstance(old, dict) and isinstance(new, dict):
        return old == new_config.get(name)
    if name in MODULE_LISTS and isinstance(old, str) and isinstance(new, str):  # the same modules in another order
        return sorted(v.strip() for v in old.split(",")) == sorted(v.strip() for v in new.split(","))
    return old == new


MODULE_LISTS = ("lora_target_modules", "lora_modules_to_save")  # comma-separated names: a set, not a sequence


def compare_settings(state: dict, cfg: TrainConfig, settings: dict, checkpoint: str) -> tuple[dict, list[str]]:
    """Raises ConfigError for training settings that differ from the checkpoint's and are not overridden. Returns
    the overridden differences ({name: "name old -> new"}) and the changed free settings ("name old -> new")."""
    old_config, new_config = state.get("config", {}), cfg.to_dict()
    if "settings" in state:
        old, new = state["settings"], settings
    else:  # saved before resolved settings were: compare the flags as typed
        old = {name: old_config[name] for name in settings if name in old_config}
        new = {name: new_config[name] for name in old}
    changed = sorted(name for name in new if name in old and not _same(name, old[name], new[name], new_config))
    describe = {name: _describe(name, old[name], new[name], old_config, new_config) for name in changed}
    _refuse_shape_changes([describe[name] for name in changed if name in SHAPE_SETTINGS], checkpoint, old_config)
    overrides = cfg.overrides()
    refused = [name for name in changed if name not in overrides]
    if refused:
        raise ConfigError(f"{checkpoint} was trained with other settings: "
                          f"{', '.join(describe[name] for name in refused)}. These change what is trained: to apply "
                          f"them pass --resume_override {','.join(changed)}; to continue as before, restore the "
                          f"old values")
    free = [f"{name} {old_config[name]} -> {new_config[name]}" for name in sorted(FREE_SETTINGS)
            if name in old_config and name not in LAUNCH_ONLY and old_config[name] != new_config[name]]
    return describe, free


def _refuse_shape_changes(changes: list[str], checkpoint: str, old_config: dict) -> None:
    """One ConfigError for changes of SHAPE_SETTINGS (module docstring), saying what to do instead."""
    if not changes:
        return
    raise ConfigError(f"{checkpoint} cannot continue with {', '.join(changes)}: these decide which tensors are "
                      f"trained and their shapes (LoRA or every weight, the adapters' rank and modules), and a "
                      f"checkpoint holds only the tensors its run trained, with their optimizer states; no "
                      f"--resume_override changes them. To continue this run, restore the old values; "
                      f"{_anew(checkpoint, old_config)}")


def _anew(checkpoint: str, old_config: dict) -> str:
    """How to train the new way: from the checkpoint's exported weights where they can be exported (a LoRA run on a
    random initialisation saved no base to merge into), else afresh."""
    if old_config.get("use_peft") and not old_config.get("model"):
        return ("to train the new way, start afresh in a new --output_dir (this LoRA run's base was a random "
                "initialisation, which no checkpoint holds)")
    merge = " --merge" if old_config.get("use_peft") else ""
    return (f"to train the new way from its weights, export them (python -m ulysses_train.export {checkpoint} "
            f"OUT{merge}) and start a new --output_dir with --model OUT")


def _saved_shapes(checkpoint: str) -> Optional[dict]:
    """{name: shape} of the tensors the checkpoint trained (DeepSpeed's `param_shapes`, in every rank's model-states
    file alike), or None where they cannot be read (DeepSpeed's own load then says what is wrong)."""
    files = sorted(glob.glob(os.path.join(checkpoint, "ds", "*model_states.pt")))
    if not files:
        return None
    try:
        with safe_loading():
            state = torch.load(files[0], map_location="cpu", mmap=True)
        return {name: tuple(shape) for group in state["param_shapes"] for name, shape in group.items()}
    except Exception:  # noqa: BLE001 - any unreadable file is DeepSpeed's load's to name
        return None


def _shape_difference(saved: dict, trained: dict) -> Optional[str]:
    """The first differences of names and shapes between the checkpoint's trained tensors and this run's."""
    def show(shape):
        return "x".join(map(str, shape)) or "a scalar"

    found = [f"{n}: {show(saved[n])} there, {show(trained[n])} here" for n in saved
             if n in trained and saved[n] != trained[n]]
    found += [f"{n} only there" for n in saved if n not in trained]
    found += [f"{n} only here" for n in trained if n not in saved]
    if not found:
        return None
    return "; ".join(found[:3]) + (f"; {len(found) - 3} more" if len(found) > 3 else "")


def check_trained_shapes(module, checkpoint: str, rank: int) -> None:
    """Collective: a ConfigError on every rank when the tensors this run trains (names and shapes) are not those
    the checkpoint trained, instead of DeepSpeed's size mismatch or KeyError in the middle of its load."""
    problem = [None]
    if rank == 0:
        saved = _saved_shapes(checkpoint)
        trained = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()
                   if p.requires_grad}
        difference = None if saved is None else _shape_difference(saved, trained)
        if difference:
            problem[0] = (f"{checkpoint} trained other tensors than this run trains ({difference}): a checkpoint "
                          f"continues only a run of the same architecture and the same trained tensors; restore "
                          f"the settings it was trained with (its trainer_state.json), or start afresh in a new "
                          f"--output_dir")
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ConfigError(problem[0])


def _decide(cfg: TrainConfig, settings: dict, dp_size: int, sp_size: int, own_scheduler: bool,
            log: Callable[[str], None], warn: Callable[[str], None]) -> ResumePlan:
    check_writable(cfg.output.output_dir)
    path = resolve_resume(cfg.output.resume, cfg.output.output_dir, warn)
    if path is None:
        if not cfg.output.resume and not cfg.check.verify:  # (--resume auto without checkpoints starts afresh)
            claim_for_fresh_run(cfg.output.output_dir, cfg.output.overwrite_output_dir, log)
        if cfg.output.resume_override:
            log(f"no checkpoint in {cfg.output.output_dir} to resume from: starting afresh, --resume_override unused")
        return ResumePlan()
    state = read_trainer_state(path)
    if (state["dp_size"], state["sp_size"]) != (dp_size, sp_size):
        raise ConfigError(f"{path} was saved with dp {state['dp_size']} x sp {state['sp_size']}; resume with the "
                          f"same world size and --sp_size")
    overridden, free = compare_settings(state, cfg, settings, path)
    scheduled = [name for name in overridden if name in SCHEDULE_SETTINGS]
    if scheduled and not own_scheduler:
        raise ConfigError(f"--resume_override {','.join(scheduled)}: the scheduler of "
                          f"--ds_config {cfg.parallel.ds_config} sets the learning rate; remove its \"scheduler\" "
                          f"block so that the flags set the schedule")
    if state["step"] >= cfg.optim.steps and not cfg.check.verify:
        raise NothingToDo(f"nothing to do: {path} is at step {state['step']} of --steps {cfg.optim.steps}", path)
    if free:
        log(f"changed since {path} (they do not alter training): {', '.join(free)}")
    return ResumePlan(path, state["step"], list(overridden.values()))


def plan_run(cfg: TrainConfig, settings: dict, dp_size: int, sp_size: int, own_scheduler: bool, rank: int,
             log: Callable[[str], None], warn: Callable[[str], None]) -> ResumePlan:
    """Collective: rank 0 decides (module docstring) and every rank returns its plan or raises its error."""
    plan, error = None, None
    if rank == 0:
        try:
            plan = _decide(cfg, settings, dp_size, sp_size, own_scheduler, log, warn)
        except (ConfigError, CheckpointError, NothingToDo) as e:
            error = (type(e).__name__, str(e), getattr(e, "checkpoint", None))
    message = [plan, error]
    dist.broadcast_object_list(message, src=0)
    plan, error = message
    if error:
        name, text, checkpoint = error
        if name == "NothingToDo":
            raise NothingToDo(text, checkpoint)
        raise {"ConfigError": ConfigError, "CheckpointError": CheckpointError}[name](text)
    return plan


def apply_schedule(scheduler, lr: float) -> None:
    """Puts a LambdaLR restored from a checkpoint on this run's schedule: its peak `lr` (the checkpoint's base_lrs
    would win otherwise) and, for the next step, this run's lambda (built from its flags) at the resumed step.
    With the checkpoint's own settings this recomputes the restored values exactly (the same products)."""
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    values = [lr * factor(scheduler.last_epoch) for factor in scheduler.lr_lambdas]
    for group, value in zip(scheduler.optimizer.param_groups, values):
        group["initial_lr"], group["lr"] = lr, value
    scheduler._last_lr = values


def apply_optimizer_settings(optimizer, cfg: TrainConfig) -> None:
    """Puts this run's AdamW settings (--adam_beta1/2, --adam_epsilon, --weight_decay) on an optimizer restored from a
    checkpoint, whose param groups came back with the checkpoint's: the same values unless --resume_override
    changed them."""
    optim = cfg.optim
    for group in optimizer.param_groups:
        group.update(betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_epsilon,
                     weight_decay=optim.weight_decay)
