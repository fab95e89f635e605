"""The learning-rate schedules (--lr_scheduler_type, --warmup_steps / --warmup_ratio, --min_lr_ratio) against
transformers' own after the warmup, and a resumed run put on the schedule of its new flags (no processes)."""

import pytest
import torch

from ulysses_train.train.checkpoints import resume
from ulysses_train.train.step.schedule import lr_factor, warmup_steps


def _transformers_lrs(name: str, total: int, warmup: int) -> list[float]:
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("name", ["cosine", "linear", "constant_with_warmup"])
def test_after_the_warmup_each_schedule_is_transformers_own(name):
    total, warmup = 20, 4
    factor = lr_factor(name, total, warmup, min_ratio=0.0)
    ours = [factor(step) for step in range(total)]
    assert ours[warmup:] == pytest.approx(_transformers_lrs(name, total, warmup)[warmup:], abs=1e-12)
    assert ours[:warmup] == pytest.approx([(s + 1) / (warmup + 1) for s in range(warmup)])  # never 0 at step 0
    floor = lr_factor(name, total, warmup, min_ratio=0.1)
    if name != "constant_with_warmup":  # the decays end at --min_lr_ratio, through the same shape
        assert floor(total) == pytest.approx(0.1) and floor(warmup) == 1.0
        assert [floor(s) for s in range(warmup, total)] == pytest.approx([0.1 + 0.9 * f for f in ours[warmup:]])


def test_warmup_steps_follow_transformers_rule():
    assert warmup_steps(100, None, None) == 10  # our default: a tenth
    assert warmup_steps(100, None, 0.03) == 3 and warmup_steps(101, None, 0.03) == 4  # ceil, as transformers
    assert warmup_steps(100, 0, 0.03) == 3  # warmup_steps 0 (transformers' default) leaves the ratio
    assert warmup_steps(100, 5, 0.5) == 5 and warmup_steps(100, 0, None) == 0


def test_a_resumed_run_follows_the_schedule_of_its_new_flags():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor("cosine", 10, 2, 0.1))
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    new = lr_factor("linear", 10, 2, 0.0)  # --lr_scheduler_type linear --min_lr_ratio 0 --resume_override ...
    scheduler.lr_lambdas = [new]
    resume.apply_schedule(scheduler, 2e-3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * new(4))
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * new(5))
    assert {"lr_scheduler_type", "warmup_ratio", "epochs"} <= set(resume.SCHEDULE_SETTINGS)


def test_resumed_adamw_settings_are_this_runs():
    from ulysses_train.train.config.train_config import OptimConfig, TrainConfig

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], betas=(0.9, 0.95), eps=1e-8)
    resume.apply_optimizer_settings(optimizer, TrainConfig(optim=OptimConfig(
        adam_beta2=0.999, adam_epsilon=1e-6, weight_decay=0.1)))
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.999), 1e-6, 0.1)
