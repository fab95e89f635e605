"""The trainer and the planner lay a run out alike (sp/layout.py): for a grid of train flags, models and world sizes,
the Layout the trainer's path resolves (train/run/trainer.py: run_layout, on an H200 with the kernels installed) is
the Layout `plan -- <train flags>` resolves for the same GPUs (tools/plan_command.py: command), or both refuse with
the same message. The planner with its own flags (tools/plan.py: sp_plans) takes the rings the trainer takes.
And the cases where the planner once resolved otherwise: pairs are packed documents for the support check, an
fp32 run's `auto` kernel is SDPA."""

import dataclasses
import itertools

import pytest

from tests.models import any_tiny_config, qwen2_28_heads_config
from ulysses_train.errors import ConfigError
from ulysses_train.families import FAMILIES
from ulysses_train.levers.policy import GiB
from ulysses_train.model.build import load_model_config
from ulysses_train.sp import kernels
from ulysses_train.sp.support import check_support
from ulysses_train.tools.plan import sp_plans
from ulysses_train.tools.plan_command import Machine, command
from ulysses_train.train.config.config_file import parse_args
from ulysses_train.train.preference.pairs import resolve_preference
from ulysses_train.train.run.trainer import run_layout

H200 = (9, 0)
MODELS = ["qwen3", "qwen2_28_heads", "mistral_window", "gemma3_text", "gemma2", "qwen3_5_text"]
# (--sp_size, world): sizes given on 8 GPUs, and the default (the node's 8 ranks) on 16 and on 4
SIZES = [(["--sp_size", "1"], 8), (["--sp_size", "2"], 8), (["--sp_size", "4"], 8), (["--sp_size", "8"], 8),
         ([], 16), ([], 4)]
RINGS = [[], ["--ring_size", "2"]]
DATA = [[], ["--packing"], ["--method", "dpo", "--dataset", "pairs"],
        ["--method", "dpo", "--dataset", "pairs", "--packing", "false"]]
KERNELS = [[], ["--attn_kernel", "sdpa"], ["--attn_kernel", "flash_attn"], ["--attn_kernel", "flash_attn_4"],
           ["--dtype", "fp32"]]


def _model_flags(name: str, folder) -> list[str]:
    config = qwen2_28_heads_config() if name == "qwen2_28_heads" else any_tiny_config(name)
    config.save_pretrained(folder / name)
    return ["--model_config", str(folder / name / "config.json"), "--seq_len", "256"]


def _trainer_layout(argv: list[str], world: int):
    """What Trainer._build resolves, in its order: the flags, the preference settings (pairs packed by default),
    the checks, the model's config, then run_layout on this rank's device (a CUDA GPU of an H200's capability)."""
    cfg, explicit = parse_args(argv)
    resolve_preference(cfg, explicit)
    cfg.validate()
    config = load_model_config(cfg.base.model, cfg.base.model_config, cfg.base.num_layers)
    return run_layout(cfg, config, world, "cuda", H200, local_ranks=lambda: min(world, 8))


def _planner_layout(argv: list[str], world: int):
    return command(argv, Machine(world, 139.7 * GiB, 125 * GiB)).layout


def _either(resolve, argv: list[str], world: int):
    """The layout, or the refusal's message."""
    try:
        return resolve(argv, world)
    except ConfigError as e:
        return f"refused: {e}"


@pytest.fixture
def installed(monkeypatch):
    """The trainer's machine has FA2 and FA4 installed (the planner takes them as installed)."""
    monkeypatch.setattr(kernels, "kernel_available", lambda name: True)


@pytest.mark.parametrize("model", MODELS)
def test_trainer_and_planner_resolve_the_same_layout(model, tmp_path, installed):
    base = _model_flags(model, tmp_path)
    seen = {"resolved": 0, "refused": 0}
    rings, kernels_seen = set(), set()
    for i, (sizes, ring, data) in enumerate(itertools.product(SIZES, RINGS, DATA)):
        (sp, world), kernel = sizes, KERNELS[i % len(KERNELS)]  # every kernel choice with every size, in turn
        argv = base + sp + ring + data + kernel
        trainer, planner = _either(_trainer_layout, argv, world), _either(_planner_layout, argv, world)
        assert trainer == planner, (model, argv, world)
        if isinstance(trainer, str):
            seen["refused"] += 1
            continue
        seen["resolved"] += 1
        rings.add(trainer.ring_size)
        kernels_seen.add(trainer.kernel)
        assert trainer.sp_size * trainer.dp_size == world and trainer.ulysses_size * trainer.ring_size == \
            trainer.sp_size
        assert trainer.packing == ("--packing" in data or "dpo" in data)  # pairs are packed documents
    assert seen["resolved"] and seen["refused"], seen  # both sides of the support check were compared
    if model == "qwen2_28_heads":
        assert 2 in rings  # --ring_size auto: 28 heads do not split over 8 ranks, Ulysses 4 x ring 2
    # Gemma 2's softcap has no SDPA kernel on CUDA: refused there, as the trainer refuses it
    assert kernels_seen == ({"flash_attn", "flash_attn_4"} if model == "gemma2" else
                            {"sdpa", "flash_attn", "flash_attn_4"}), kernels_seen


def test_a_ring_auto_takes_and_the_flags_planner_takes(tmp_path, installed):
    """`plan` with its own flags proposes, for each SP size, the ring the trainer resolves with --ring_size auto."""
    config = qwen2_28_heads_config()
    flags = _model_flags("qwen2_28_heads", tmp_path)
    for sp, ring in sp_plans(config, 8):
        assert _trainer_layout(flags + ["--sp_size", str(sp)], 8).ring_size == ring
    assert sp_plans(config, 8)[-1] == (8, 2)
    # a DeltaNet model under a ring, or a window: refused by the support check, so not proposed
    assert sp_plans(any_tiny_config("qwen3_5_text"), 8, ring=2) == []
    assert sp_plans(any_tiny_config("mistral_window"), 8, 8) == [(8, 1)]


def test_pairs_are_packed_documents_for_the_planner_too(tmp_path, monkeypatch, installed):
    """A planner that checked `--packing` alone passed a pair run whose recurrence the trainer refuses to carry across
    a pair's two documents (a DeltaNet family whose mixers were not sharded for packing)."""
    record = FAMILIES["qwen3_5_text"]
    monkeypatch.setitem(FAMILIES, "qwen3_5_text", dataclasses.replace(record, sharded_mixers=frozenset()))
    argv = _model_flags("qwen3_5_text", tmp_path) + ["--sp_size", "1", "--method", "dpo", "--dataset", "pairs",
                                                      "--packing", "false"]
    config = load_model_config(None, argv[1])
    check_support(config, 1, 1, "flash_attn_4", "cuda", packing=False)  # what the planner used to check: accepted
    for resolve in (_trainer_layout, _planner_layout):
        with pytest.raises(ConfigError, match="would carry their state across packed documents: drop --packing"):
            resolve(argv, 8)
    sft = argv[:argv.index("--method")]
    assert _trainer_layout(sft, 8) == _planner_layout(sft, 8)  # one document a row: accepted by both
    assert not _planner_layout(sft, 8).packing


def test_an_fp32_run_plans_the_kernel_it_runs(tmp_path, installed):
    """`--dtype fp32` with `--attn_kernel auto`: the trainer takes SDPA (FA4 is bf16/fp16 only); the planner once
    planned FA4 for it."""
    argv = _model_flags("qwen3", tmp_path) + ["--dtype", "fp32"]
    trainer, planner = _trainer_layout(argv, 8), _planner_layout(argv, 8)
    assert trainer == planner and planner.kernel == "sdpa" and not planner.bf16
    assert _planner_layout(argv[:-2], 8).kernel == "flash_attn_4"  # bf16: FA4
    with pytest.raises(ConfigError, match="--attn_kernel flash_attn_4 runs in bf16/fp16 only"):
        _planner_layout(argv + ["--attn_kernel", "flash_attn_4"], 8)


def test_auto_runs_fa4_at_head_dim_256(tmp_path, installed):
    """Qwen3.5's attention layers (full causal, heads of 256), Gemma 3's (windows) and Qwen3's: `--attn_kernel auto`
    takes FA4 on Hopper, in the trainer and the planner alike (at head_dim 256 our FA4 op runs cuDNN's backward,
    sp/fa4_op.py, so FA4 is the faster choice each way: docs/benchmarks.md, "At head_dim 256")."""
    for name in ("qwen3_5_text", "gemma3_text", "qwen3"):
        config = any_tiny_config(name)
        config.head_dim = 256 if name != "qwen3" else config.head_dim
        config.save_pretrained(tmp_path / name)
        argv = ["--model_config", str(tmp_path / name / "config.json"), "--seq_len", "256", "--sp_size", "1"]
        trainer, planner = _trainer_layout(argv, 1), _planner_layout(argv, 1)
        assert trainer == planner and planner.kernel == "flash_attn_4", (name, planner.kernel)


def test_the_flags_planner_says_when_the_trainer_refuses_its_default_layout(tmp_path, capsys):
    """The default --sp_size 8 cannot cut this DeltaNet model's 2 linear key heads and 4 value heads: the planner
    once printed that the default flags fit; it now says the trainer refuses them, and plans the sizes that run."""
    from ulysses_train.tools.plan import main

    flags = _model_flags("qwen3_5_text", tmp_path)[:2]
    assert main(flags + ["--seq_len", "4096", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "with the default flags (--sp_size 8): the trainer refuses them: --sp_size 8 cannot cut the Gated " \
           "DeltaNet layers'" in out and "fits with --sp_size 1 " in out
    assert main(flags + ["--seq_len", "4096", "--gpus", "8", "--sp_size", "8"]) == 2  # given: refused, as the trainer
    assert "error: --sp_size 8 cannot cut the Gated DeltaNet layers'" in capsys.readouterr().err
