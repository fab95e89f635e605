"""Preference training through the trainer under SP: DPO and SimPO at SP=4 reproduce one process step by step
(loss, gradient norm, TRL's metrics; the reference log-probs computed under SP=4 and in one process agree),
`--verify` passes for DPO (SP=2 x DP=2, two pairs a micro-batch), SimPO (Ulysses 2 x ring 2) and ORPO on
conversational pairs (DPO's cached reference log-probs checked against plain transformers too), and a resumed DPO
run finds its reference in the checkpoint under the initial weights' key, not the checkpoint's. Without --method a
dataset of pairs trains DPO, packed by default, equal to --packing false and to one process, with --eval_dataset's
loss and TRL's metrics.

Two launches: four gloo ranks for the sharded runs, one for the single-process ones, each running several trainers
in turn (the test of the defaults has its own two, two ranks and one). Packed rows of 128 tokens hold two to four string
pairs, so at SP=4 (32 tokens a rank) sequences straddle the ranks."""

import glob
import json
import os
import shutil

import numpy as np
import pytest

from tests.multiprocess import run_distributed
from tests.sft_fixtures import chat_folder, write_jsonl

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen"]


def _pairs(n=24, messages=False):
    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 6
        question, good, bad = f"What is {WORDS[a]} plus {WORDS[b]}?", WORDS[a + b], WORDS[(a + b + 3) % 13]
        if messages:
            rows.append({"prompt": [{"role": "user", "content": question}],
                         "chosen": [{"role": "assistant", "content": f"{good.capitalize()}."}],
                         "rejected": [{"role": "assistant", "content": f"Maybe {bad}, or so."}]})
        else:
            rows.append({"prompt": question, "chosen": f" {good}.", "rejected": f" {bad} or so" + " or so" * (i % 3)})
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preference_train")
    return chat_folder(folder) | {"pairs": write_jsonl(folder / "pairs.jsonl", _pairs()),
                                  "chats": write_jsonl(folder / "chats.jsonl", _pairs(messages=True))}


def _run(rank, world, runs, tmp):
    """Each (name, argv) in turn: training returns its metrics, --verify its result; with the reference log-probs."""
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.run.trainer import Trainer
    from ulysses_train.train.step.loop import train
    from ulysses_train.train.verify.verify import run_verify

    out = {}
    for name, argv in runs:
        if name.startswith("resume") and rank == 0:  # the reference must come from the initial weights again
            for folder in glob.glob(os.path.join(tmp, "cache_" + name.split("_", 1)[1], "*", "reference")):
                shutil.rmtree(folder)
        cfg, explicit = parse_args(argv + ["--output_dir", os.path.join(tmp, name.removeprefix("resume_"))])
        trainer = Trainer(cfg, explicit)
        result = run_verify(trainer) if cfg.check.verify else train(trainer)
        if trainer.lock is not None:
            trainer.lock.release()
        out[name] = (result, trainer.reference)
        out[f"{name}/origins"] = getattr(trainer, "reference_origins", None)
    return out


def _argv(files, tmp, cache, method="dpo", data="pairs", *extra):
    return ["--method", method, "--dataset", files[data], "--tokenizer", files["tokenizer"], "--chat_template",
            files["template"], "--data_cache_dir", os.path.join(tmp, f"cache_{cache}"), "--seq_len", "128",
            "--packing", "--steps", "3", "--lr", "3e-3", "--warmup_steps", "0", "--beta", "0.5", *extra]


def test_dpo_and_simpo_under_sp_equal_one_process_verify_and_resume(files):
    tmp = str(files["folder"])
    sharded = [("dpo_sp4", _argv(files, tmp, "sp4", "dpo", "pairs", "--sp_size", "4", "--grad_accum", "2")),
               ("simpo_sp4", _argv(files, tmp, "sp4", "simpo", "pairs", "--sp_size", "4", "--grad_accum", "2",
                                   "--eval_dataset", files["pairs"], "--eval_steps", "2")),
               ("verify_dpo", _argv(files, tmp, "chat", "dpo", "chats", "--sp_size", "2", "--verify",
                                    "--verify_seq_len", "256", "--micro_batch_size", "2", "--loss_type", "ipo")),
               ("verify_simpo", _argv(files, tmp, "chat", "simpo", "chats", "--sp_size", "4", "--ring_size", "2",
                                      "--verify", "--verify_seq_len", "256")),
               ("verify_orpo", _argv(files, tmp, "chat", "orpo", "chats", "--sp_size", "2", "--verify",
                                     "--verify_seq_len", "256", "--loss", "plain"))]
    four = run_distributed(_run, 4, sharded, tmp, use_deepspeed=True)[0]
    single = [("dpo", _argv(files, tmp, "one", "dpo", "pairs", "--grad_accum", "2", "--save_steps", "2")),
              ("simpo", _argv(files, tmp, "one", "simpo", "pairs", "--grad_accum", "2", "--save_final", "false",
                              "--eval_dataset", files["pairs"], "--eval_steps", "2")),
              ("resume_one", _argv(files, tmp, "one", "dpo", "pairs", "--grad_accum", "2", "--save_steps", "2",
                                   "--resume", os.path.join(tmp, "dpo", "checkpoints", "step_00000002")))]
    one = run_distributed(_run, 1, single, tmp, use_deepspeed=True)[0]
    # sequences straddle the SP ranks: a packed row of three or more pairs, 128 tokens over 4 ranks
    for ours, theirs in (("dpo_sp4", "dpo"), ("simpo_sp4", "simpo")):
        records, reference = four[ours]
        expected, expected_reference = one[theirs]
        assert len(records) == 3 and records[-1]["loss"] < records[0]["loss"], ours
        for r, e in zip(records, expected):
            assert (r["num_tokens"], r["conversations"]) == (e["num_tokens"], e["conversations"])
            assert r["conversations"] >= 4  # two micro-batches of packed rows, several pairs each
            assert r["loss"] == pytest.approx(e["loss"], rel=1e-5) and r["grad_norm"] == pytest.approx(
                e["grad_norm"], rel=1e-4), (ours, r, e)
            for key, value in e["preference"].items():
                assert r["preference"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (ours, key)
            evaluation = {k: v for k, v in e.items() if k.startswith("eval_")}  # SimPO's, at SP=4 as in one
            assert bool(evaluation) == (ours == "simpo_sp4" and e["step"] in (2, 3)), (ours, e["step"])
            for key, value in evaluation.items():
                assert r[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (ours, key)
        if reference is not None:  # computed under SP 4 and in one process: the same log-probs
            assert np.allclose(reference, expected_reference, rtol=1e-6)
    assert four["dpo_sp4"][0][0]["preference"]["rewards/margins"] == 0.0  # the policy starts as the reference
    assert one["dpo"][0][-1]["preference"]["rewards/accuracies"] > 0.5
    for name in ("verify_dpo", "verify_simpo", "verify_orpo"):
        result = four[name][0]
        assert result["passed"], (name, result)
        assert result["ours"]["loss"] < 1e-5 and result["ours"]["grad_max"] < 1e-4, (name, result["ours"])
    assert four["verify_dpo"][0]["reference_logps"]["compared"]
    assert four["verify_dpo"][0]["reference_logps"]["ours"] < 1e-6
    assert "sp 2 x dp 2" in four["verify_dpo"][0]["setup"] and four["verify_dpo"][0]["sequences"] == 4
    assert "sp 4 (Ulysses 2 x ring 2)" in four["verify_simpo"][0]["setup"]
    # the resumed run read its reference from the checkpoint (the cache was removed), under the key of the initial
    # weights (the checkpoint's would be another): the same log-probs, step 3 again
    resumed, reference = one["resume_one"]
    assert [r["step"] for r in resumed] == [3]
    assert one["dpo/origins"] == ["computed"] and one["resume_one/origins"] == ["checkpoint"]
    assert np.array_equal(reference, one["dpo"][1])
    assert resumed[0]["loss"] == pytest.approx(one["dpo"][0][2]["loss"], rel=1e-6)
    assert not glob.glob(os.path.join(tmp, "cache_one", "*", "reference", "*.npy"))  # removed, not computed again
    kept = glob.glob(os.path.join(tmp, "dpo", "checkpoints", "step_00000002", "reference", "*.npy"))
    assert len(kept) == 1 and np.array_equal(np.load(kept[0]), one["dpo"][1]) and np.load(kept[0]).shape == (24, 2)


def _reference_runs(rank, world, runs, tmp):
    """Each (name, argv) in turn: (metrics or --verify's result, reference log-probs, the policy's weights digest
    right after the trainer is built: after any --ref_model swap and its undoing), or the ConfigError's message."""
    from ulysses_train.errors import ConfigError
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.preference.reference_logps import reference_parameters, weights_digest
    from ulysses_train.train.run.trainer import Trainer
    from ulysses_train.train.step.loop import train
    from ulysses_train.train.verify.verify import run_verify

    out = {}
    for name, argv in runs:
        cfg, explicit = parse_args(argv + ["--output_dir", os.path.join(tmp, name)])
        try:
            trainer = Trainer(cfg, explicit)
        except ConfigError as e:
            out[name] = str(e)
            continue
        digest = weights_digest(reference_parameters(trainer.module.model))
        result = run_verify(trainer) if cfg.check.verify else train(trainer)
        if trainer.lock is not None:
            trainer.lock.release()
        out[name] = (result, trainer.reference, digest)
    return out


def test_dpo_against_a_separate_reference_model(files, tmp_path):
    """--ref_model: policy A trained against the frozen model B. B's log-probs, computed with B's weights swapped into
    the model, equal those of a run whose policy is B, under SP=2 as in one process; the policy is A again after
    the pass (its weights' digest), ZeRO-3's partitions and ZeRO-2's replicated weights alike; the steps at SP=2
    equal one process; --verify checks the cached log-probs
    against plain transformers on B. A model of another shape, a reference-free method and LoRA are refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.build import load_model_config

    folders = {}
    for name, seed, layers in (("A", 0, None), ("B", 1, None), ("shallow", 2, 1)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(load_model_config(None, "tiny", layers))
        with torch.no_grad():  # norms other than 1, and A's and B's apart: ZeRO-3 keeps such small ones gathered
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(tmp_path / name)
        folders[name] = str(tmp_path / name)
    tmp = str(tmp_path)

    def argv(cache, model, *extra):
        return _argv(files, tmp, cache, "dpo", "pairs", "--model", folders[model], "--steps", "2", *extra)

    zero2 = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "ds_configs", "zero2.json")
    # ZeRO-2 first: a ZeRO-3 trainer's HfDeepSpeedConfig outlives it in this process until its teardown
    sharded = [("ref_dp2_zero2", argv("dp2", "A", "--ref_model", folders["B"], "--ds_config", zero2)),
               ("ref_sp2", argv("sp2", "A", "--ref_model", folders["B"], "--sp_size", "2")),
               ("verify_ref", argv("verify", "A", "--ref_model", folders["B"], "--sp_size", "2", "--verify",
                                   "--verify_seq_len", "256"))]
    every_rank = run_distributed(_reference_runs, 2, sharded, tmp, use_deepspeed=True)
    two = every_rank[0]
    single = [("ref_one", argv("ref_one", "A", "--ref_model", folders["B"])), ("own", argv("own", "A")),
              ("policy_b", argv("policy_b", "B")),
              ("shallow", argv("shallow", "A", "--ref_model", folders["shallow"])),
              ("missing", argv("missing", "A", "--ref_model", str(tmp_path / "no_such_model")))]
    one = run_distributed(_reference_runs, 1, single, tmp, use_deepspeed=True)[0]
    (records, reference, digest), (own_records, own_reference, own_digest) = one["ref_one"], one["own"]
    assert np.array_equal(reference, one["policy_b"][1])  # B's log-probs, as B's own run computes them
    assert not np.allclose(reference, own_reference)
    # the policy is A again after the pass: ZeRO-3's partitions, and ZeRO-2's replicated weights (DP 2)
    assert digest == own_digest
    assert all(ranks[name][2] == own_digest for ranks in every_rank for name in ("ref_sp2", "ref_dp2_zero2"))
    assert np.allclose(two["ref_dp2_zero2"][1], reference, rtol=1e-6)
    assert records[0]["preference"]["rewards/margins"] != 0.0 and own_records[0]["preference"]["rewards/margins"] == 0
    sp_records, sp_reference, _ = two["ref_sp2"]
    assert np.allclose(sp_reference, reference, rtol=1e-6)
    for r, e in zip(sp_records, records, strict=True):
        assert r["loss"] == pytest.approx(e["loss"], rel=1e-5) and r["grad_norm"] == pytest.approx(
            e["grad_norm"], rel=1e-4), (r, e)
    result = two["verify_ref"][0]
    assert result["passed"] and result["reference_logps"]["compared"], result
    assert result["reference_logps"]["ours"] < 1e-6 and result["reference_logps"]["weights"] == \
        f"--ref_model {folders['B']}"
    # refused before the data and the model are built: another shape from its config, a missing path at once
    assert one["shallow"].startswith(f"--ref_model {folders['shallow']} is not a model of the policy's architecture "
                                     f"and shape (num_hidden_layers 1 against "), one["shallow"]
    assert one["missing"].startswith(f"--ref_model {tmp_path / 'no_such_model'}: no such file or folder"), \
        one["missing"]


@pytest.mark.parametrize("extra, message", [
    (["--method", "simpo"], "--ref_model is DPO's reference: --method simpo has none"),
    (["--use_peft"], "--ref_model with --use_peft: a LoRA run's reference is its base model"),
])
def test_ref_model_settings_refused(files, extra, message):
    from ulysses_train.errors import ConfigError
    from ulysses_train.train.config.config_file import parse_args

    argv = ["--dataset", files["pairs"], "--ref_model", "some/model", "--method", "dpo"] + extra
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(argv)[0].validate()


@pytest.mark.parametrize("zero", [{"zero_hpz_partition_size": 2}, {"offload_param": {"device": "nvme"}}])
def test_ref_model_refuses_partitionings_it_cannot_put_back(zero):
    """ZeRO++'s secondary partitions and NVMe-swapped parameters hold copies of a weight that the swap would leave
    on the reference's values: refused before any weight moves."""
    from ulysses_train.errors import ConfigError
    from ulysses_train.train.preference.reference_logps import _check_restorable

    _check_restorable({"stage": 3, "offload_param": {"device": "cpu"}}, "B")
    with pytest.raises(ConfigError, match="leave those out of --ds_config"):
        _check_restorable({"stage": 3, **zero}, "B")


def _default_runs(rank, world, runs, tmp):
    """Each (name, argv) in turn: (metrics records, the method and packing the run resolved, metrics.jsonl's
    records), or the ConfigError's message."""
    from ulysses_train.errors import ConfigError
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.run.trainer import Trainer
    from ulysses_train.train.step.loop import train

    out = {}
    for name, argv in runs:
        cfg, explicit = parse_args(argv + ["--output_dir", os.path.join(tmp, name)])
        try:
            trainer = Trainer(cfg, explicit)
        except ConfigError as e:
            out[name] = str(e)
            continue
        records = train(trainer)
        if trainer.lock is not None:
            trainer.lock.release()
        with open(os.path.join(tmp, name, "metrics.jsonl")) as f:
            logged = [json.loads(line) for line in f]
        out[name] = (records, cfg.pref.method, cfg.data.packing, logged)
    return out


def test_pairs_train_dpo_packed_by_default_with_eval_and_trls_metrics(files):
    """A dataset of prompt/chosen/rejected trains DPO without --method, its pairs packed several a row; at SP=2 the
    packed run equals --packing false (one pair a row, the same pairs a step: no pair attends to another) and one
    process, in the loss, the gradient norm, TRL's metrics and --eval_dataset's loss and metrics, which are in
    metrics.jsonl under TRL's names. A dataset whose every pair has chosen == rejected is refused."""
    from tests.sft_fixtures import write_jsonl

    tmp = str(files["folder"])
    folder = files["folder"]
    six, four = write_jsonl(folder / "six.jsonl", _pairs(6)), write_jsonl(folder / "four.jsonl", _pairs(10)[6:])
    same = write_jsonl(folder / "same.jsonl", [dict(p, rejected=p["chosen"]) for p in _pairs(3)])

    def argv(cache, *extra, data=six):
        return ["--dataset", data, "--tokenizer", files["tokenizer"], "--data_cache_dir",
                os.path.join(tmp, f"cache_{cache}"), "--seq_len", "512", "--steps", "2", "--lr", "3e-3",
                "--warmup_steps", "0", "--beta", "0.5", "--eval_dataset", four, "--eval_steps", "1", *extra]

    two = run_distributed(_default_runs, 2, [
        ("packed", argv("sp2", "--sp_size", "2")),
        ("unpacked", argv("sp2", "--sp_size", "2", "--packing", "false", "--micro_batch_size", "6")),
        ("same", argv("sp2", "--sp_size", "2", data=same))], tmp, use_deepspeed=True)[0]
    one = run_distributed(_default_runs, 1, [("single", argv("single"))], tmp, use_deepspeed=True)[0]
    packed, unpacked, single = two["packed"], two["unpacked"], one["single"]
    assert packed[1:3] == ("dpo", True) and unpacked[1:3] == ("dpo", False)
    trl_names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")
    for records, theirs in ((packed[0], unpacked[0]), (packed[0], single[0])):
        for r, e in zip(records, theirs, strict=True):
            assert r["conversations"] == e["conversations"] == 6 and r["num_tokens"] == e["num_tokens"]
            assert r["loss"] == pytest.approx(e["loss"], rel=1e-5) and r["grad_norm"] == pytest.approx(
                e["grad_norm"], rel=1e-4), (r, e)
            for key in trl_names:  # at step 1 the rewards are 0 up to rounding: which side wins is noise
                if key != "rewards/accuracies" or r["step"] > 1:
                    assert r["preference"][key] == pytest.approx(e["preference"][key], rel=1e-4, abs=1e-5), \
                        (r["step"], key)
                assert r[f"eval_{key}"] == pytest.approx(e[f"eval_{key}"], rel=1e-4, abs=1e-5), (r["step"], key)
            assert r["eval_loss"] == pytest.approx(e["eval_loss"], rel=1e-5) and r["eval_pairs"] == 4
    first, last = packed[3]
    assert abs(first["rewards/margins"]) < 1e-6 and first["eval_rewards/margins"] > 1e-4  # eval: after the update
    assert last["eval_rewards/accuracies"] >= 0.0 and set(trl_names) <= set(last)
    assert all(f"eval_{k}" in last for k in trl_names) and 0.0 <= last["mean_token_accuracy"] <= 1.0
    assert last["entropy"] > 0 and last["logits/chosen"] != last["logits/rejected"]
    assert two["same"].startswith(f"--dataset {same}: every one of its 3 pair(s) has the same chosen and rejected")


def _stopped_reference_pass(rank, world, argv, tmp):
    """The reference pass stopped after its 5th micro-batch (an injected failure on every rank), then the same run
    started again; and the same run in a fresh cache, whole. Returns what each computed and the logs."""
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.run.trainer import Trainer

    def build(cache, fault=None):
        os.environ.pop("ULYSSES_TRAIN_FAULT", None)
        if fault:
            os.environ["ULYSSES_TRAIN_FAULT"] = fault
        cfg, explicit = parse_args(argv + ["--data_cache_dir", os.path.join(tmp, cache), "--output_dir",
                                           os.path.join(tmp, f"out_{cache}_{fault is not None}")])
        logged = []
        trainer = Trainer.__new__(Trainer)
        trainer.log = lambda message: logged.append(message) if rank == 0 else None
        try:
            Trainer.__init__(trainer, cfg, explicit)
        except RuntimeError as e:
            return None, [str(e)]
        finally:
            os.environ.pop("ULYSSES_TRAIN_FAULT", None)
        trainer.close()
        return trainer.reference, logged

    stopped = build("stopped", "raise_in_reference:5")
    partial = glob.glob(os.path.join(tmp, "stopped", "*", "reference", "*.partial.npz"))
    held = np.load(partial[0])["done"].sum() if partial and rank == 0 else None
    resumed = build("stopped")
    left = glob.glob(os.path.join(tmp, "stopped", "*", "reference", "*.partial.npz"))
    whole = build("whole")
    return stopped, held, resumed, left, whole


def test_a_stopped_reference_pass_goes_on_from_what_it_streamed_to_the_cache(files, tmp_path):
    """DPO's reference pass writes what it has computed as it goes (every twentieth of the pass): stopped after 5 of
    its 24 micro-batches (24 pairs, one a row, SP=2), the cache holds the 4 pairs of its last write (every 2nd
    micro-batch); the run started again reads them and computes only the rest, and its table equals a whole pass's
    in a fresh cache, bit for bit; the partial file is gone once the table is written."""
    argv = ["--method", "dpo", "--dataset", files["pairs"], "--tokenizer", files["tokenizer"], "--chat_template",
            files["template"], "--seq_len", "128", "--packing", "false", "--steps", "1", "--beta", "0.5"]
    rank0 = run_distributed(_stopped_reference_pass, 2, argv, str(tmp_path), use_deepspeed=True)[0]
    (none, error), held, (resumed, logged), left, (whole, _) = rank0
    assert none is None and "after micro-batch 5 of the reference pass" in error[0]
    assert held == 4
    assert any("4 of 24 pairs' log-probs read from" in line and "computing the rest" in line for line in logged)
    assert np.array_equal(resumed, whole) and not left
