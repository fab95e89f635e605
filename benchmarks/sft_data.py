"""Long conversations for the SFT step benchmark, and the same documents as raw text.

    python benchmarks/sft_data.py --out /tmp/sftd --count 12 --min_chars 30000 --max_chars 120000

Writes `chat.jsonl` (a `messages` column: a system turn, a user turn holding a document of filler words and a
request, an assistant turn of 20-200 words) and `text.jsonl` (a `text` column: each document followed by its
answer). With `--tokenizer bytes` a character is a token, so the lengths are the token counts. Seeded: the same
arguments give the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random

WORDS = ("river stone lantern orchard meadow harbor thunder willow copper violet canyon ember frost garden "
         "island").split()


def filler(rng: random.Random, chars: int) -> str:
    words, length = [], 0
    while length < chars:
        words.append(rng.choice(WORDS))
        length += len(words[-1]) + 1
    return " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=12)
    parser.add_argument("--min_chars", type=int, default=30000)
    parser.add_argument("--max_chars", type=int, default=120000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chat.jsonl"), "w") as chat, \
            open(os.path.join(args.out, "text.jsonl"), "w") as text:
        for _ in range(args.count):
            document = filler(rng, rng.randint(args.min_chars, args.max_chars))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
            messages = [{"role": "system", "content": "You read long documents."},
                        {"role": "user", "content": document + "\n\nSummarise the document."},
                        {"role": "assistant", "content": answer}]
            chat.write(json.dumps({"messages": messages}) + "\n")
            text.write(json.dumps({"text": document + " " + answer}) + "\n")


if __name__ == "__main__":
    main()
