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


def test_a_json_lines_row_that_is_no_object_is_named_by_line(tmp_path):
    """A `null` line (first, or first of one of pyarrow's blocks) killed the run with a segmentation fault inside
    pyarrow's JSON reader, and a line holding a number, a string or a list failed inside datasets naming no line.
    Each is now refused naming the file and the line, before datasets reads it (in a child process here, so that
    the crash it guards against cannot take the tests with it)."""
    import subprocess

    from tests.trainer_runs import ROOT, child_env

    cases = {"null.jsonl": ("null\n" + json.dumps({"text": "a"}) + "\n", "line 1 holds 'null'"),
             "late.jsonl": (json.dumps({"text": "a"}) + "\n\n  [1, 2]\n", "line 3 holds '[1, 2]'"),
             "lines.json": (json.dumps({"text": "a"}) + "\n\"loose\"\n", "line 2 holds '\"loose\"'")}
    for name, (text, said) in cases.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "fine.jsonl").write_text("\ufeff" + json.dumps({"text": "a" * 20}) + "\n\r\n   {\"text\": \"b\"}\n")
    script = ("import sys\nfrom ulysses_train.data.corpus import ByteTokenizer, corpus_samples\n"
              "from ulysses_train.errors import ConfigError\n"
              "try:\n    corpus_samples(sys.argv[1], 'train', None, ByteTokenizer(), 4, sys.argv[2])\n"
              "    print('loaded')\nexcept ConfigError as e:\n    print(e)\n")
    for name in list(cases) + ["fine.jsonl"]:
        proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / name), str(tmp_path / "cache")],
                              cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (name, proc.returncode, proc.stderr[-2000:])
        if name == "fine.jsonl":
            assert proc.stdout.strip() == "loaded"
            continue
        assert proc.stdout.strip() == (f"--dataset {tmp_path / name}: {cases[name][1]}, not a JSON object: each "
                                       f"line of a JSON Lines file is one row, an object of its columns (remove "
                                       f"or fix the line)"), proc.stdout
