"""End to end through launch/train.py on CPU (gloo): the trainer as users run it, under the DeepSpeed launcher,
torchrun and accelerate launch, and elsewhere as plain rank processes (no launcher's start-up to pay).

The sharded runs must reproduce the loss curve of the unsharded run with the same global batch: fp32 on CPU, the
same data, the same initial weights (zero.Init broadcasts rank 0's), so differences are reduction-order rounding
(rel 1e-4 after several optimizer steps)."""

import sys

import pytest

from tests.trainer_runs import (
    accelerate_launcher,
    assert_same_curve,
    deepspeed_launcher,
    deepspeed_shm_segments,
    metrics,
    plain_ranks,
    run,
    torchrun_launcher,
)


def test_sp2_matches_single_process_under_deepspeed_torchrun_and_accelerate(tmp_path):
    shm_before = deepspeed_shm_segments()
    run([sys.executable], [], tmp_path / "single")
    ds = run(deepspeed_launcher(2), [], tmp_path / "ds_sp2")  # sp_size defaults to the ranks on the node
    assert "dp 1 x sp 2" in ds.stdout
    # --save_final (on by default): a finished run leaves its weights even without --save_steps
    assert (tmp_path / "ds_sp2" / "checkpoints" / "step_00000004" / "COMPLETE").exists()
    run(torchrun_launcher(2), ["--sp_size", "2"], tmp_path / "torchrun_sp2")
    run(accelerate_launcher(2), ["--sp_size", "2"], tmp_path / "accelerate_sp2")
    single = metrics(tmp_path / "single")
    for launcher in ("ds_sp2", "torchrun_sp2", "accelerate_sp2"):
        assert_same_curve(metrics(tmp_path / launcher), single)
    assert single[-1]["loss"] < single[0]["loss"]
    # DeepSpeed's CPU shared-memory all-reduce leaves 66 MB per rank in /dev/shm; enough runs OOM the machine
    assert deepspeed_shm_segments() <= shm_before


def test_dp2_sp2_matches_dp2_sp1_with_accumulation(tmp_path):
    args = ["--grad_accum", "2"]
    run(plain_ranks(2), args + ["--sp_size", "1"], tmp_path / "dp2_sp1")
    out = run(plain_ranks(4), args + ["--sp_size", "2"], tmp_path / "dp2_sp2")
    assert "dp 2 x sp 2" in out.stdout
    assert_same_curve(metrics(tmp_path / "dp2_sp2"), metrics(tmp_path / "dp2_sp1"))


def test_local_model_folder(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from ulysses_train.model.build import load_model_config

    folder = tmp_path / "tiny_model"
    config = load_model_config(None, "tiny")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, 512)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                            pad_token="<pad>", eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    out = run(plain_ranks(2), ["--model", str(folder), "--tensorboard"], tmp_path / "out")
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))
    assert "done: 4 steps" in out.stdout and "tokenizer TokenizersBackend" in out.stdout
    # the first step's loss is the saved model's loss on the first sample: the weights were loaded, not re-drawn
    import torch

    from ulysses_train.data.sources import SyntheticTokens

    ids = SyntheticTokens(512, 256, seed=0).sample(0)[None]
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
    assert metrics(tmp_path / "out")[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_pad_to_sp_trains_an_odd_length(tmp_path):
    run(plain_ranks(2), ["--seq_len", "255", "--pad_to_sp"], tmp_path)
    assert all(r["num_tokens"] == 254 for r in metrics(tmp_path))  # 255 tokens, 254 targets; padding ignored


def test_text_folder_with_packing_under_sp2_and_cache_hit(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    for i in range(3):
        (books / f"book{i}.txt").write_text(" ".join(["chapter", str(i), "the cat sat on the mat."] * 400))
    args = ["--dataset", str(books), "--tokenizer", "bytes", "--seq_len", "2048", "--sp_size", "2", "--packing",
            "--data_cache_dir", str(tmp_path / "cache")]
    first = run(plain_ranks(2), args, tmp_path / "first")
    assert "cache written, packing True" in first.stdout
    second = run(plain_ranks(2), args, tmp_path / "second")
    assert "cache hit, packing True" in second.stdout
    a, b = metrics(tmp_path / "first"), metrics(tmp_path / "second")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # same data, same order
    assert a[-1]["loss"] < a[0]["loss"]
