"""Training from Python, as a notebook would: a TRL-style configuration with an evaluation, a second run on a
mixture of two datasets (one of them ShareGPT's layout) with another learning rate, and an error caught, all in one
interpreter (docs/python-api.md).

    python examples/python_api.py --out /tmp/api_example

It writes a few arithmetic conversations, trains the tiny default model on them (one process, the byte tokenizer,
examples/chatml.jinja says what is trained) and prints one JSON line: each run's eval loss, steps, checkpoint and
the lr of each step. Under a launcher (`torchrun --nproc_per_node 2 examples/python_api.py ...`) every rank runs
the same script.
"""

import argparse
import json
import os
import random

from ulysses_train import train
from ulysses_train.errors import ConfigError

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chatml.jinja")


def write_conversations(path: str, count: int, seed: int, sharegpt: bool = False) -> str:
    """`count` rows of {"messages": [user, assistant]}: a sum and its answer; or ShareGPT's
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            turns = [("user", "human", f"What is {a} + {b}?"), ("assistant", "gpt", f"{a} + {b} = {a + b}.")]
            row = ({"conversations": [{"from": name, "value": text} for _, name, text in turns]} if sharegpt else
                   {"messages": [{"role": role, "content": text} for role, _, text in turns]})
            f.write(json.dumps(row) + "\n")
    return path


def main(out: str) -> dict:
    os.makedirs(out, exist_ok=True)
    # TRL's SFTConfig names; ulysses-train reads them as its own flags (config.yaml holds the canonical ones)
    settings = {
        "dataset": write_conversations(os.path.join(out, "train.jsonl"), 16, seed=0),
        "eval_dataset": write_conversations(os.path.join(out, "eval.jsonl"), 4, seed=1),
        "tokenizer": "bytes", "chat_template": TEMPLATE, "max_seq_length": 128, "assistant_only_loss": True,
        "learning_rate": 3e-3, "gradient_accumulation_steps": 2, "num_train_epochs": 1, "warmup_ratio": 0.25,
        "lr_scheduler_type": "linear", "min_lr_ratio": 0.0, "bf16": False, "data_cache_dir": os.path.join(out, "cache"),
    }
    # the same interpreter trains again: half of those conversations and 8 ShareGPT rows, a higher learning rate
    sharegpt = write_conversations(os.path.join(out, "sharegpt.jsonl"), 6, seed=2, sharegpt=True)
    mixture = [{"path": settings["dataset"], "weight": 0.5}, {"path": sharegpt, "samples": 8}]
    runs = {}
    for name, overrides in (("trl_style", {}), ("mixture", {"dataset": mixture, "learning_rate": 1e-2})):
        result = train(settings, **overrides, output_dir=os.path.join(out, name))
        runs[name] = {"eval_loss": result.eval_loss, "steps": result.metrics["step"], "checkpoint": result.checkpoint,
                      "lr": [r["lr"] for r in result.history]}
    try:  # a setting to change raises, it does not exit
        train(settings, sp_size=3, output_dir=os.path.join(out, "bad"))
        error = None
    except ConfigError as e:
        error = str(e)
    return {"runs": runs, "error": error}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the data and the runs")
    print(json.dumps(main(parser.parse_args().out)))
