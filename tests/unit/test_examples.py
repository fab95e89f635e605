"""examples/needle.py, the worked SFT example of docs/needle.md: its conversations hold the code in the first tenth of
the document, train and eval codes differ, and the trainer reads the rows as messages whose trained tokens are the
assistant's answer (through examples/chatml.jinja and the byte tokenizer, as that page's command runs it)."""

import json
import os
import subprocess
import sys

from tests.trainer_runs import ROOT


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_needle_conversations(tmp_path):
    from ulysses_train.data.chat import load_chat_template
    from ulysses_train.data.corpus import ByteTokenizer
    from ulysses_train.data.sft import RowEncoder, detect_format

    out = tmp_path / "needle"
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "needle.py"), "--out", str(out), "--train", "40",
                    "--eval", "10", "--chars", "3000"], check=True, capture_output=True)
    train, evaluation = _rows(out / "train.jsonl"), _rows(out / "eval.jsonl")
    assert len(train) == 40 and len(evaluation) == 10
    for row in train + evaluation:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        document, question = user["content"].rsplit("\n\n", 1)
        fact = f"The pass code is {row['answer']}."
        assert question.endswith("?") and assistant["content"] == fact
        assert document.count(fact) == 1 and len(document) >= 3000
        assert document.index(fact) + len(fact) <= len(document) / 10  # the whole fact is in the first tenth
    assert not {r["answer"] for r in train} & {r["answer"] for r in evaluation}

    assert detect_format(list(train[0]), "auto", None) == "messages"
    tokenizer = ByteTokenizer()
    template = load_chat_template(os.path.join(ROOT, "examples", "chatml.jinja"), tokenizer)
    encoded = RowEncoder("messages", tokenizer, template, "assistant")(
        {"messages": [r["messages"] for r in evaluation[:3]]}, [0, 1, 2])
    for row, ids, trained in zip(evaluation, encoded["input_ids"], encoded["trained"]):
        answer = tokenizer.decode(ids[trained.astype(bool)])
        assert answer == f"The pass code is {row['answer']}.<|im_end|>"
