"""A local dataset is known by its bytes (ulysses_train/data/content.py): an edit that keeps the file's size and
restores its modification time was a cache hit that trained the old tokens (datasets' Arrow cache and our token
store were keyed by size and time); rows appended between a run and its resume gave another sample order without a
word. Now both caches miss on any change of the bytes, and a resume over changed data is refused unless
`--resume_override dataset` names it."""

import json
import os
import sys

from tests.trainer_runs import run
from ulysses_train.data.corpus import ByteTokenizer, corpus_samples


def _edit_keeping_size_and_time(path, text: str) -> None:
    st = os.stat(path)
    assert len(text.encode()) == st.st_size
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_edit_that_keeps_size_and_time_is_a_new_cache_with_the_new_tokens(tmp_path):
    path = tmp_path / "books.jsonl"
    path.write_text(json.dumps({"text": "a" * 40}) + "\n")
    samples, store = corpus_samples(str(path), "train", None, ByteTokenizer(), 16, str(tmp_path / "cache"))
    assert not store.cache_hit and int(store.tokens[0]) == ord("a") + 3
    again = corpus_samples(str(path), "train", None, ByteTokenizer(), 16, str(tmp_path / "cache"))[1]
    assert again.cache_hit  # unchanged bytes: the same store, its digest read back, not recomputed
    _edit_keeping_size_and_time(path, json.dumps({"text": "b" * 40}) + "\n")
    edited = corpus_samples(str(path), "train", None, ByteTokenizer(), 16, str(tmp_path / "cache"))[1]
    assert not edited.cache_hit and int(edited.tokens[0]) == ord("b") + 3


def test_a_resume_over_changed_data_is_refused_unless_overridden(tmp_path):
    data = tmp_path / "books.jsonl"
    data.write_text("".join(json.dumps({"text": f"book {i} " * 40}) + "\n" for i in range(4)))
    out = tmp_path / "run"
    common = ["--dataset", str(data), "--tokenizer", "bytes", "--seq_len", "64"]
    run([sys.executable], common + ["--steps", "1"], out)
    resume = common + ["--steps", "2", "--resume", "auto", "--resume_override", "steps"]
    with open(data, "a") as f:  # rows appended between the run and its resume
        f.write(json.dumps({"text": "a new book " * 40}) + "\n")
    proc = run([sys.executable], resume, out, expect_ok=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"dataset {data} (its content differs from the checkpoint's: edited since?)" in errors[0]
    assert "--resume_override" in errors[0]
    proc = run([sys.executable], resume[:-1] + ["steps,dataset"], out)
    assert "resumed" in (proc.stdout + proc.stderr).lower()
