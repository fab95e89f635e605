"""Long conversations with a known answer, for a first SFT run: a document of filler sentences holds one fact (a
pass code) in its first tenth; the user asks for it at the end; the assistant answers.

    python examples/needle.py --out /tmp/needle --train 400 --eval 40 --chars 1500       # ~1,700 byte tokens each
    python examples/needle.py --out /tmp/needle_131k --chars 550000                      # ~105k BPE tokens each

Writes `train.jsonl` and `eval.jsonl` with a `messages` column (the trainer's SFT format). The answer can only come
from reading back to the start of the document, so the loss on the answer tokens measures long-range reading; the
eval set uses other codes (no code is in both files) and other documents.
"""

from __future__ import annotations

import argparse
import json
import os
import random

WORDS = ("river stone lantern orchard meadow harbor thunder willow copper violet canyon ember frost garden island "
         "marble pepper quartz saddle timber velvet walnut yonder zephyr anchor beacon cobalt dune falcon glacier "
         "hollow ivory juniper kettle lagoon mosaic nectar oasis prairie quiver ridge summit tundra umber "
         "valley").split()
QUESTION = "What is the pass code mentioned in the document?"


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 12))]
    return " ".join(words).capitalize() + "."


def conversation(rng: random.Random, chars: int, code: str) -> dict:
    """One conversation whose document has about `chars` characters and holds `code` in its first tenth."""
    fact = f"The pass code is {code}."
    sentences, length = [], 0
    while length < chars:
        sentences.append(sentence(rng))
        length += len(sentences[-1]) + 1
    # the fact starts at or before character `limit`, so it ends inside the first tenth of the document
    limit, at, before = rng.randint(0, max(0, chars // 10 - len(fact) - 1)), 0, 0
    while at < len(sentences) and before + len(sentences[at]) + 1 <= limit:
        before += len(sentences[at]) + 1
        at += 1
    sentences.insert(at, fact)
    document = " ".join(sentences)
    return {"messages": [{"role": "user", "content": f"{document}\n\n{QUESTION}"},
                         {"role": "assistant", "content": fact}],
            "answer": code}


def codes(rng: random.Random, train: int, evaluation: int) -> tuple[list[str], list[str]]:
    """Distinct 4-digit codes, none shared between train and eval: an eval answer cannot be remembered."""
    picked = [str(c) for c in rng.sample(range(1000, 10000), train + evaluation)]
    return picked[:train], picked[train:]


def write(path: str, rows) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=400, help="conversations in train.jsonl")
    p.add_argument("--eval", type=int, default=40, help="conversations in eval.jsonl")
    p.add_argument("--chars", type=int, default=2000, help="characters of each document")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.train + a.eval > 9000:
        p.error("--train + --eval must be at most 9000 (one 4-digit code each)")
    rng = random.Random(a.seed)
    train_codes, eval_codes = codes(rng, a.train, a.eval)
    write(os.path.join(a.out, "train.jsonl"), (conversation(rng, a.chars, c) for c in train_codes))
    write(os.path.join(a.out, "eval.jsonl"), (conversation(rng, a.chars, c) for c in eval_codes))
    print(f"wrote {a.train} + {a.eval} conversations of ~{a.chars:,} characters to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
