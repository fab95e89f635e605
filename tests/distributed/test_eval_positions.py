"""The per-position loss tool: its numbers are the model's own per-token losses, and SP=2 gives the same."""

import csv
import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.trainer_runs import ROOT, child_env, torchrun_launcher

SEQ, BUCKET = 512, 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.build import load_model_config

    d = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_model_config(None, "tiny")).save_pretrained(d / "model")
    (d / "books").mkdir()
    for i in range(2):
        (d / "books" / f"{i}.txt").write_text(" ".join(f"word{j % 37} line {i}" for j in range(200)))
    return d


def _run(launcher, setup, out):
    args = ["-m", "ulysses_train.tools.eval_positions", "--model", str(setup / "model"),
            "--dataset", str(setup / "books"), "--tokenizer", "bytes", "--seq_len", str(SEQ), "--num_samples", "2",
            "--bucket", str(BUCKET), "--out", str(out), "--data_cache_dir", str(setup / "cache")]
    cmd = launcher + args if launcher[0] != sys.executable else [sys.executable] + args
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "positions.csv") as f:
        rows = list(csv.DictReader(f))
    return proc.stdout, [float(r["mean_loss"]) for r in rows]


def test_per_position_loss_matches_the_model_and_sp2(setup):
    from transformers import AutoModelForCausalLM

    from ulysses_train.data.corpus import ByteTokenizer

    stdout, single = _run([sys.executable], setup, setup / "out1")
    _, sharded = _run(torchrun_launcher(2) + ["--no-python", sys.executable], setup, setup / "out2")
    assert sharded == pytest.approx(single, rel=1e-5)
    assert "last 511 tokens: mean loss" in stdout and (setup / "out1" / "positions.png").stat().st_size > 0
    summary = json.loads((setup / "out1" / "summary.json").read_text())
    assert {"tail_mean_loss", "first_rise_position", "unigram_entropy"} <= summary.keys()

    # the same numbers from the model itself, with transformers' own attention, on the same two samples
    text = "".join(open(setup / "books" / f"{i}.txt").read() + "\0" for i in range(2))
    ids = torch.from_numpy(ByteTokenizer().encode_batch([text])[0]).long()
    ids[ids == 3] = 1  # the "\0" separators stand for EOS (id 1) as the corpus pipeline joins documents
    model = AutoModelForCausalLM.from_pretrained(setup / "model", attn_implementation="sdpa")
    losses = []
    with torch.no_grad():
        for i in range(2):
            x = ids[i * SEQ:(i + 1) * SEQ][None]
            losses.append(F.cross_entropy(model(input_ids=x).logits[0, :-1], x[0, 1:], reduction="none"))
    mean = torch.stack(losses).mean(0)
    expected = [float(mean[s:s + BUCKET].mean()) for s in range(0, SEQ - 1, BUCKET)]
    assert single == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("args, message", [
    (["--num_samples", "0"], "--num_samples must be positive, got 0"),
    (["--seq_len", "1"], r"--seq_len must be at least 2 \(a loss needs a token and its successor\), got 1"),
    (["--bucket", "0"], "--bucket must be positive, got 0"),
    (["--threshold", "nan"], "--threshold must be a finite number, got nan"),
    (["--seq_len", "100000"], r"fewer than one sample of --seq_len 100000: lower --seq_len or add data$"),
    (["--model", "/no/such/model"], r"--model /no/such/model: no such file or folder"),
    (["--dataset", "/no/such/books"], r"--dataset /no/such/books: no such file or folder"),
])
def test_bad_settings_are_one_message_and_exit_2(setup, capsys, args, message):
    """Checked before any process group or model: main returns 2 with one line, whatever it suggests exists."""
    from ulysses_train.tools.eval_positions import main

    base = {"--model": str(setup / "model"), "--dataset": str(setup / "books"), "--tokenizer": "bytes",
            "--seq_len": str(SEQ), "--data_cache_dir": str(setup / "cache")}
    base.update(dict(zip(args[::2], args[1::2])))
    assert main([x for kv in base.items() for x in kv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(message, err) and err.startswith("error: ") and "--last_sample" not in err, err


def test_conversations_count_only_trained_tokens(setup):
    """Conversation data (SP=2): the loss at each position is the model's own, and only where the assistant writes.
    Our masks come from growing prefixes of a template without markers; the reference's from transformers'
    `return_assistant_tokens_mask` on the same template with `{% generation %}` markers."""
    from transformers import AutoModelForCausalLM

    from tests.sft_fixtures import CHATML_PLAIN, CHATML_QWEN, MULTI_TURN, arithmetic_chats, tiny_tokenizer, write_jsonl

    seq, n = 128, 3
    chats = [MULTI_TURN] + [row["messages"] for row in arithmetic_chats(4)[::3]]  # multi-turn ones, with a tool turn
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(setup / "chat_tokenizer")
    (setup / "chatml.jinja").write_text(CHATML_PLAIN)
    data = write_jsonl(setup / "chats.jsonl", [{"messages": m} for m in chats])
    args = ["-m", "ulysses_train.tools.eval_positions", "--model", str(setup / "model"), "--dataset", data,
            "--tokenizer", str(setup / "chat_tokenizer"), "--chat_template", str(setup / "chatml.jinja"),
            "--seq_len", str(seq), "--num_samples", str(n), "--bucket", "1", "--out", str(setup / "chat_out"),
            "--data_cache_dir", str(setup / "cache")]
    proc = subprocess.run(torchrun_launcher(2) + ["--no-python", sys.executable] + args, cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(setup / "chat_out" / "positions.csv") as f:
        ours = [float(r["mean_loss"]) for r in csv.DictReader(f)]

    model = AutoModelForCausalLM.from_pretrained(setup / "model", attn_implementation="sdpa")
    losses = torch.full((n, seq - 1), float("nan"))
    with torch.no_grad():
        for i, messages in enumerate(chats[:n]):
            rendered = tokenizer.apply_chat_template(messages, chat_template=CHATML_QWEN, tokenize=True,
                                                     return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = torch.tensor(rendered["input_ids"]), torch.tensor(rendered["assistant_masks"]).bool()
            ce = F.cross_entropy(model(input_ids=ids[None]).logits[0, :-1], ids[1:], reduction="none")
            losses[i, :len(ids) - 1] = ce.masked_fill(~mask[1:], float("nan"))
    expected = losses.nanmean(0)
    assert expected.isnan().sum() > seq // 2 > (~expected.isnan()).sum() > 0  # prompts and padding count nothing
    assert ours == pytest.approx(expected.tolist(), rel=1e-4, nan_ok=True)
    summary = json.loads((setup / "chat_out" / "summary.json").read_text())
    assert summary["tail_mean_loss"] == pytest.approx(float(expected.nanmean()), rel=1e-4)


def test_data_without_a_target_is_one_message_and_exit_2(setup, capsys, tmp_path):
    """It printed NaN means and exited 0: conversations with no assistant turn, or first --num_samples samples
    that train nothing, are refused before any process group or model; so are pre-tokenized ids past the model's
    vocabulary, and a template that raises (a bare exception, exit 3)."""
    from tests.sft_fixtures import write_jsonl
    from ulysses_train.tools.eval_positions import main

    user = [{"role": "user", "content": "hello"}]
    answered = user + [{"role": "assistant", "content": "hi"}]
    base = ["--model", str(setup / "model"), "--tokenizer", "bytes", "--seq_len", "128", "--chat_template",
            f"{ROOT}/examples/chatml.jinja", "--data_cache_dir", str(tmp_path / "cache")]
    none = write_jsonl(tmp_path / "none.jsonl", [{"messages": user}] * 3)
    assert main(base + ["--dataset", none]) == 2
    assert f"error: --dataset {none}: no target: none of its 3 conversations" in capsys.readouterr().err
    late = write_jsonl(tmp_path / "late.jsonl", [{"messages": user}, {"messages": answered}])
    assert main(base + ["--dataset", late, "--num_samples", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: the first 1 sample(s) of --dataset {late} have no target (nothing the model is trained "
                   f"to write under --loss_on auto): raise --num_samples, or check --loss_on and --chat_template"), err
    raising = tmp_path / "raising.jinja"  # a bare ZeroDivisionError, exit 3
    raising.write_text("{{ 1/0 }}")
    assert main([x if x != f"{ROOT}/examples/chatml.jinja" else str(raising) for x in base] + ["--dataset", late]) == 2
    assert f"error: row 0 of --dataset {late}: --chat_template {raising} fails on the conversation: " \
           f"ZeroDivisionError: division by zero" in capsys.readouterr().err
    tokens = write_jsonl(tmp_path / "tokens.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 512, 7]}])
    no_template = [x for x in base if x not in ("--chat_template", f"{ROOT}/examples/chatml.jinja")]
    assert main(no_template + ["--dataset", tokens]) == 2  # the tiny model has 512 ids
    assert f"row 1 of --dataset {tokens}: `input_ids`[1] is 512, outside the model's vocabulary (0 to 511)" in \
        capsys.readouterr().err
