"""Preference pairs for the DPO step benchmark, the same tokens for ours and for TRL's DPOTrainer.

    python benchmarks/dpo_data.py --out /tmp/dpod --side 32768 --count 6 [--completion 2048]

Writes `pairs_<side>.jsonl` (`prompt`, `chosen`, `rejected` strings of words) and `tokenizer/`: a word-level
tokenizer of 151,936 ids (Qwen3's vocabulary size: `<pad>`, `<eos>`, `<unk>`, then the words `w3` ... `w151935`),
so that every word is one token and each side, prompt + completion + EOS, is exactly `--side` tokens. Prompt and
completions are drawn uniformly over the words, seeded. Both trainers tokenize the strings the same way (TRL joins
prompt and completion before tokenizing, ours tokenizes them one after the other; with whole words as tokens and
completions that start with a space the ids are the same).
"""

from __future__ import annotations

import argparse
import json
import os
import random

VOCAB = 151936
SPECIALS = ["<pad>", "<eos>", "<unk>"]
COMPLETION = 2048  # tokens of each completion, EOS included: the only tokens the preference head scores


def save_tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {name: i for i, name in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    tokenizer.save_pretrained(folder)


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(len(SPECIALS), VOCAB)}" for _ in range(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--side", type=int, default=32768, help="tokens of each side: prompt + completion + EOS")
    parser.add_argument("--completion", type=int, default=COMPLETION, help="tokens of each completion, EOS included")
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    if not os.path.exists(os.path.join(args.out, "tokenizer", "tokenizer.json")):
        save_tokenizer(os.path.join(args.out, "tokenizer"))
    prompt_len = args.side - args.completion
    with open(os.path.join(args.out, f"pairs_{args.side}.jsonl"), "w") as f:
        for _ in range(args.count):
            row = {"prompt": words(rng, prompt_len), "chosen": " " + words(rng, args.completion - 1),
                   "rejected": " " + words(rng, args.completion - 1)}
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
