"""`python -m ulysses_train.preview`: a mixture of a ShareGPT conversation (tool call and result) and an instruction
pair, rendered as the trainer sees it: the trained spans are transformers' own assistant mask of the same
conversation, SP ranks' shards and packed conversations are marked, settings errors exit 2 (no processes)."""

import re

import pytest

from tests.sft_fixtures import CHATML_TOOLS, SHAREGPT, SHAREGPT_AS_MESSAGES, tiny_tokenizer, trained_spans, write_jsonl
from ulysses_train.tools.preview import main


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preview")
    tok = tiny_tokenizer()
    tok.save_pretrained(folder / "tok")
    (folder / "tools.jinja").write_text(CHATML_TOOLS)
    return {"tok": tok, "folder": folder,
            "sharegpt": write_jsonl(folder / "sharegpt.jsonl", [{"conversations": SHAREGPT}]),
            "pairs": write_jsonl(folder / "pairs.jsonl", [{"prompt": "What is two plus two?", "completion": " Four."},
                                                          {"prompt": "And the cat?", "completion": " The mat."}])}


def _run(data, capsys, *flags):
    folder = data["folder"]
    code = main(["--color", "never", "--tokenizer", str(folder / "tok"), "--chat_template",
                 str(folder / "tools.jinja"), "--data_cache_dir", str(folder / "cache"), *flags])
    return code, capsys.readouterr()


def test_a_mixture_previewed_with_its_masks_packing_and_shards(data, capsys):
    code, out = _run(data, capsys, "--dataset", data["sharegpt"], "--dataset", data["pairs"], "--seq_len", "128",
                     "--sp_size", "2", "--packing", "--num_samples", "2")
    assert code == 0, out.err
    found = re.findall(r"=== trained #\d: sample \d \(dataset (\d), its sample 0\) ===\n(.*?)\n  (.*?)\n", out.out,
                       re.S)
    samples = {dataset: (text, counts) for dataset, text, counts in found}
    text, counts = samples["1"]
    tok = data["tok"]
    rendered = tok.apply_chat_template(SHAREGPT_AS_MESSAGES, chat_template=CHATML_TOOLS, tokenize=True,
                                       return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = rendered["input_ids"], rendered["assistant_masks"]
    plain = re.sub(r"‹rank \d›", "", re.sub(r"\]\]‹rank \d›\[\[", "", text))  # a shard starts inside a span
    expected = [span.replace("\n", "↵\n") for span in trained_spans(tok, ids, mask)]
    assert re.findall(r"\[\[(.*?)\]\]", plain, re.S) == expected
    assert plain.endswith(f"‹pad x{128 - len(ids)}›") and len(ids) > 64
    first_half = tok.decode(ids[:64]).replace("\n", "↵\n")
    assert re.sub(r"\[\[|\]\]", "", text).startswith(f"‹rank 0›{first_half}‹rank 1›")  # the shards' cut
    assert counts.startswith(f"128 positions, {len(ids)} real tokens, {sum(mask)} trained, 1 document(s)")
    pairs_text, pairs_counts = samples["2"]
    assert "‹doc 2›" in pairs_text and "2 document(s)/conversation(s)" in pairs_counts  # packed, kept apart
    pairs_spans = re.findall(r"\[\[(.*?)\]\]", re.sub(r"‹[^›]*›", "", pairs_text))
    assert pairs_spans == [" Four.<|im_end|>", " The mat.<|im_end|>"]
    assert "a mixture of 2" in out.out and "‹rank R› where SP rank R's shard starts (--sp_size 2)" in out.out


def test_settings_errors_exit_2(data, capsys):
    code, out = _run(data, capsys, "--dataset", str(data["folder"] / "none.jsonl"))
    assert code == 2 and "none.jsonl" in out.err
    code, out = _run(data, capsys, "--dataset", data["pairs"], "--seq_len", "255", "--sp_size", "2")
    assert code == 2 and "--seq_len 255" in out.err
    code, out = _run(data, capsys, "--no_such_flag", "1")  # a trainer flag mistyped: one line, not a traceback
    assert code == 2 and out.err.startswith("error: unrecognized arguments: --no_such_flag 1")
    assert "Traceback" not in out.err


def test_a_rows_terminal_escapes_are_shown_not_sent(data, capsys):
    """A row's clear-screen and window-title escapes, BEL, NUL and a bidirectional override reach the terminal as
    their codes (they were written raw, also with --color never)."""
    rows = [{"prompt": "Hi\x1b[2J\x1b]0;owned\x07", "completion": " ok\x00\u202e."}]
    path = write_jsonl(data["folder"] / "escapes.jsonl", rows)
    code, out = _run(data, capsys, "--dataset", path, "--seq_len", "128")
    assert code == 0, out.err
    assert not any(c in out.out for c in "\x1b\x07\x00\u202e")
    assert "\\x1b[2J\\x1b]0;owned\\x07" in out.out and "\\x00" in out.out  # (a byte tokenizer splits U+202E)
    from ulysses_train.tools.preview import _visible

    assert _visible("a\u202eb\u2066") == "a\\u202eb\\u2066" and _visible("é\n") == "é↵\n"  # whole tokens' text
