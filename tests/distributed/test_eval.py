"""Validation loss (`--eval_dataset`) under SP: against plain transformers on the same weights and samples, and
through the trainer (every --eval_steps and after the last step, into metrics.jsonl)."""

import os

import pytest

from tests.multiprocess import run_distributed
from tests.sft_fixtures import arithmetic_chats, chat_folder, write_jsonl
from tests.trainer_runs import metrics


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    return chat_folder(folder) | {"train": write_jsonl(folder / "train.jsonl", arithmetic_chats(48)),
                                  "eval": write_jsonl(folder / "eval.jsonl", arithmetic_chats(7)[::-1]),
                                  "out": str(folder)}


def _args(files, extra=()):
    """The run's flags; with --val_set_size in `extra`, its eval set is held out of --dataset instead."""
    evaluated = [] if "--val_set_size" in extra else ["--eval_dataset", files["eval"]]
    return ["--dataset", files["train"], *evaluated, "--tokenizer", files["tokenizer"], "--chat_template",
            files["template"], "--data_cache_dir", files["cache"], "--seq_len", "128", *extra]


def _evaluate_against_transformers(rank, world, files, settings, trained):
    """Each of `settings` evaluated (ours, and on rank 0 plain transformers on the same weights and samples); then
    `trained` run through the training loop, which evaluates every --eval_steps and after the last step."""
    import torch

    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.run.trainer import Trainer
    from ulysses_train.train.step.evaluate import evaluate_tokens as evaluate
    from ulysses_train.train.step.loop import train
    from ulysses_train.train.verify.reference_model import reference_step
    from ulysses_train.train.verify.verify import _gather_weights

    results = []
    for i, extra in enumerate(settings):
        cfg, explicit = parse_args(_args(files, extra) + ["--output_dir", os.path.join(files["out"], f"run{i}")])
        trainer = Trainer(cfg, explicit)
        ours = evaluate(trainer, trainer.eval_source, None)
        weights = _gather_weights(trainer.engine, rank)
        if rank == 0:
            from ulysses_train.data.sources import build_batch

            batches = [build_batch([trainer.eval_source.get(i)], cfg.data.packing)
                       for i in range(trainer.eval_source.num_samples)]
            ref_loss, _, _ = reference_step(trainer.model_config, weights, batches, torch.float32, trainer.device)
            results.append((ours, ref_loss))
    trainer = Trainer(*parse_args(_args(files) + trained + ["--output_dir", os.path.join(files["out"], "trained")]))
    train(trainer)
    return results


TRAINED = ["--steps", "5", "--eval_steps", "2", "--sp_size", "2", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def launched(files):
    """One launch of two ranks for both tests below (rank 0's results)."""
    settings = [["--sp_size", "2"], ["--sp_size", "1"], ["--sp_size", "2", "--packing"],
                ["--sp_size", "2", "--val_set_size", "0.2"]]  # a fifth of --dataset held out
    results = run_distributed(_evaluate_against_transformers, 2, files, settings, TRAINED, use_deepspeed=True)[0]
    return {"settings": settings, "results": results, "trained": os.path.join(files["out"], "trained")}


def test_eval_loss_under_sp_equals_plain_transformers(launched):
    """SP=2 (one SP group) and SP=1 (two DP groups, seven samples: the second group's last micro-batch runs past
    the end and counts nothing), packed and not, and on the share of --dataset that --val_set_size holds out: the
    mean over every trained token of the eval samples."""
    assert len(launched["results"]) == len(launched["settings"])
    for extra, (ours, reference) in zip(launched["settings"], launched["results"]):
        assert ours["eval_loss"] == pytest.approx(reference, rel=1e-5), extra
        assert ours["eval_tokens"] > 0 and ours["eval_samples"] >= 1


def test_eval_runs_every_eval_steps_and_after_the_last_step(launched):
    """Through the training loop (the trainer's own, in the launch above): into metrics.jsonl."""
    records = metrics(launched["trained"])
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    evaluated = [r["step"] for r in records if "eval_loss" in r]
    assert evaluated == [2, 4, 5]
    losses = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert losses[-1] < losses[0]  # it learns the answers' form


def test_eval_settings_and_data_errors_name_the_eval_flags(files, tmp_path):
    """No process: the eval flags need --eval_dataset, a missing one is named before any work, and what is wrong
    in its rows names --eval_dataset, not --dataset."""
    from ulysses_train.data.load import _Loader
    from ulysses_train.data.mixture import dataset_entries
    from ulysses_train.errors import ConfigError
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.run.preflight import preflight

    for extra in (["--eval_steps", "2"], ["--eval_samples", "3"], ["--eval_split", "test"], ["--evals_per_epoch", "2"]):
        with pytest.raises(ConfigError, match="needs? (an eval set: --eval_dataset or --val_set_size|--eval_dataset)"):
            parse_args(["--dataset", files["train"]] + extra)[0].validate()
    for extra, message in ((["--val_set_size", "0.1"] + _args(files)[2:4], "leave --eval_dataset unset"),
                           (["--val_set_size", "2.5"], "a fraction under 1 or a whole number"),
                           (["--val_set_size", "0.1", "--method", "dpo"], "evaluated with the SFT loss")):
        with pytest.raises(ConfigError, match=message):
            parse_args(["--dataset", files["train"]] + extra)[0].validate()
    with pytest.raises(ConfigError, match="--eval_steps must be >= 0"):
        parse_args(_args(files) + ["--eval_steps", "-1"])[0].validate()
    cfg, _ = parse_args(_args(files)[:2] + ["--eval_dataset", str(tmp_path / "none.jsonl")])
    with pytest.raises(ConfigError, match=f"--eval_dataset {tmp_path}/none.jsonl: no such file"):
        preflight(cfg)

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": "not a list"}])
    cfg, _ = parse_args(_args(files) + ["--data_cache_dir", str(tmp_path / "cache")])
    settings = cfg.data_settings()

    def load(path, split="train"):
        return _Loader(settings, dataset_entries(path, "eval_dataset"), split, 128, 512, print, "eval_dataset").load()

    message = load(bad)
    assert message.startswith(f"row 0 of --eval_dataset {bad}: `messages` must be"), message
    no_target = write_jsonl(tmp_path / "noassist.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    message = load(no_target)
    assert message.startswith(f"--eval_dataset {no_target}: no target: none of its 3 conversations"), message
    message = load(files["eval"], "validation")
    assert message.startswith("--eval_split validation: ") and "no such split" in message, message


def test_val_set_size_holds_out_a_fixed_share_that_is_never_trained_on():
    """No process: the held-out samples depend on the seed alone; they and the training ones split the source."""
    from ulysses_train.data.held_out import split_off
    from ulysses_train.errors import ConfigError

    class Source:
        num_samples = 40

        def get(self, i):
            return i

    for size, count in ((0.25, 10), (3, 3), (0.001, 1)):
        train, held = split_off(Source(), size, seed=5)
        kept, out = [train.get(i) for i in range(train.num_samples)], [held.get(i) for i in range(held.num_samples)]
        assert len(out) == count and sorted(kept + out) == list(range(40)) and not set(kept) & set(out)
        assert out == [split_off(Source(), size, seed=5)[1].get(i) for i in range(count)]
    assert split_off(Source(), 0.25, seed=5)[1].indices != split_off(Source(), 0.25, seed=6)[1].indices
    with pytest.raises(ConfigError, match="--val_set_size 40 holds out 40 of the 40 samples"):
        split_off(Source(), 40, seed=0)


def test_an_evaluation_without_a_target_reports_no_loss_not_zero(tmp_path):
    """The first --eval_samples may train nothing although the set does: the loss is None (null in metrics.jsonl,
    "none" in the log), never 0.0. One process, a gloo group of one, a stand-in engine."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from ulysses_train.train.step.evaluate import evaluate_tokens as evaluate

    class Source:
        num_samples = 2

        def get(self, i):
            return torch.arange(8), 8, None, torch.full((8,), -100)

    run = SimpleNamespace(groups=SimpleNamespace(dp_size=1, dp_rank=0, sp_size=1, sp_rank=0, ring_size=1), micro=1,
                          cfg=SimpleNamespace(data=SimpleNamespace(packing=False)), device=torch.device("cpu"),
                          tokenizer=None,
                          attention=SimpleNamespace(),
                          engine=type("Engine", (), {"eval": lambda self: None, "train": lambda self: None,
                                                     "__call__": lambda self, *a: torch.zeros(())})())
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        result = evaluate(run, Source(), None)
    finally:
        dist.destroy_process_group()
    assert result["eval_loss"] is None and result["eval_tokens"] == 0
