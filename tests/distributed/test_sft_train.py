"""Conversations through the trainer: a packed SFT run (SP=2) whose loss falls and whose metrics count each step's
conversations and trained tokens; `--verify` on packed chat data (labels reach the reference); and the SP x DP x
accumulation normalisation on SFT data against one process, with samples whose targets all sit on one SP rank and a
sample with no target at all. The two `--verify` checks share one launch of four ranks."""

import re
import sys

import pytest

from tests.multiprocess import run_distributed
from tests.sft_fixtures import NUMBER_WORDS, arithmetic_chats, chat_folder, write_jsonl
from tests.trainer_runs import metrics, plain_ranks, run
from tests.verify_runs import verify_settings


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft")
    return chat_folder(folder) | {"chats": write_jsonl(folder / "chats.jsonl", arithmetic_chats())}


def _args(files, dataset=None):
    return ["--dataset", dataset or files["chats"], "--tokenizer", files["tokenizer"], "--chat_template",
            files["template"], "--data_cache_dir", files["cache"]]


def _samples(files, seq_len, packing, dataset=None):
    """The trainer's samples, rebuilt here from the same cache."""
    from ulysses_train.data.corpus import load_corpus, load_tokenizer
    from ulysses_train.data.sft import sft_samples

    dataset = dataset or files["chats"]
    return sft_samples(load_corpus(dataset), "messages", load_tokenizer(files["tokenizer"], None), seq_len,
                       dataset=dataset, split="train", cache_dir=files["cache"], chat_template=files["template"],
                       packing=packing)[0]


def _step_batches(samples, step, packing, accum=1, dp=1):
    from ulysses_train.data.sources import ChatSource, build_batch, global_sample_index, sample_order

    source = ChatSource(samples)
    return [build_batch([source.get(sample_order(global_sample_index(step - 1, m, accum, d, dp, 1, 0),
                                                 len(samples), 0))], packing)
            for d in range(dp) for m in range(accum)]


def test_packed_conversations_train_under_sp2(chat_files):
    from ulysses_train.data.sources import trainable_tokens

    out_dir = chat_files["folder"] / "train"
    out = run(plain_ranks(2), _args(chat_files) + ["--sp_size", "2", "--packing", "--steps", "8"], out_dir)
    assert "data: messages, loss on assistant, --chat_template chatml.jinja: 48 conversations" in out.stdout
    assert "cache written, packing True" in out.stdout
    records = metrics(out_dir)
    assert len(records) == 8 and records[-1]["loss"] < 0.8 * records[0]["loss"]
    samples = _samples(chat_files, 256, packing=True)
    for r in records:  # each step's composition: the conversations of its packed sample and their trained tokens
        batch, = _step_batches(samples, r["step"], packing=True)
        assert (r["num_tokens"], r["conversations"]) == (trainable_tokens(batch), batch["conversations"])
        assert r["conversations"] >= 2 and 0 < r["num_tokens"] < 256 / 4


def test_verify_on_packed_chat_data(chat_files, verified):
    from ulysses_train.data.sources import trainable_tokens

    result = verified["packed"]
    assert result["passed"], result
    assert "sp 2 x dp 2" in result["setup"]
    batches = _step_batches(_samples(chat_files, 128, packing=True), 1, packing=True, dp=2)
    # the assistant labels reached the reference: every trained token of the step's two packed samples, no other
    assert result["targets"] == sum(trainable_tokens(b) for b in batches) < 2 * 128 / 3
    assert result["ours"]["loss"] < 1e-5 and result["ours"]["grad_max"] < 1e-5


def _lopsided_chats():
    """A: a long user turn and a short answer at the end (every target on SP rank 1 of 2); B: no assistant turn
    (no target at all); C and D: short conversations."""
    long_question = "What is " + " plus ".join(NUMBER_WORDS[:10]) + "?"
    return [{"messages": [{"role": "user", "content": long_question}, {"role": "assistant", "content": "Nine."}]},
            {"messages": [{"role": "user", "content": "Hello there, how are you?"}]},
            {"messages": [{"role": "user", "content": "What is two plus two?"},
                          {"role": "assistant", "content": "Four."}]},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The cat?"},
                          {"role": "assistant", "content": "It sat on the mat."}]}]


@pytest.fixture(scope="module")
def verified(chat_files):
    """`--verify` (as run_verify, in-process) of both checks below in one launch of four ranks: SP=2 x DP=2."""
    dataset = write_jsonl(chat_files["folder"] / "lopsided.jsonl", _lopsided_chats())
    settings = {"lopsided": ["--sp_size", "2", "--grad_accum", "2", "--verify_seq_len", "128"]
                + _args(chat_files, dataset),
                "packed": ["--sp_size", "2", "--seq_len", "256", "--verify_seq_len", "128", "--packing"]
                + _args(chat_files)}
    results = run_distributed(verify_settings, 4, list(settings.values()), str(chat_files["folder"] / "verify4"),
                              use_deepspeed=True)[0]
    return dict(zip(settings, results)) | {"lopsided_dataset": dataset}


def test_sp_dp_accumulation_normalisation_on_sft_data_against_one_process(chat_files, verified):
    from ulysses_train.data.sources import trainable_tokens
    from ulysses_train.sp.sharding import IGNORE_INDEX, shift_labels

    seq_len = 128
    samples = _samples(chat_files, seq_len, packing=False, dataset=verified["lopsided_dataset"])
    targets = []
    for i in range(4):
        ids, labels, valid, _ = samples.sample(i)
        shifted = shift_labels(ids[None], labels[None])[0]
        targets.append((shifted != IGNORE_INDEX).nonzero().flatten().tolist())
    assert min(targets[0]) >= seq_len // 2 and targets[1] == []  # the design of the data holds
    result = verified["lopsided"]
    assert result["passed"], result
    assert "sp 2 x dp 2" in result["setup"] and result["sequences"] == 4
    batches = _step_batches(samples, 1, packing=False, accum=2, dp=2)
    assert result["targets"] == sum(len(t) for t in targets) == sum(trainable_tokens(b) for b in batches)
    assert min(trainable_tokens(b) for b in batches) == 0  # one micro-batch trains nothing
    assert result["ours"]["loss"] < 1e-5 and result["ours"]["grad_max"] < 1e-5  # fp32 on CPU: rounding only


def test_conversations_longer_than_seq_len_stop_the_run_naming_the_flag(chat_files):
    out = run([sys.executable], _args(chat_files) + ["--seq_len", "64"], chat_files["folder"] / "too_long",
              expect_ok=False)
    assert out.returncode == 2, out.stderr[-3000:]
    assert re.search(r"error: \d+ conversation\(s\) are longer than --seq_len 64 \(the longest has \d+ tokens\): "
                     r"raise --seq_len, or cut them with --truncation left", out.stderr)
