"""Training from Python, as a notebook would: a TRL-style configuration, an evaluation, a small learning-rate sweep
and an error caught, all in one interpreter (README: "The Python API").

    python examples/python_api.py --out /tmp/api_example

It writes a few arithmetic conversations, trains the tiny default model on them (one process, the byte tokenizer,
examples/chatml.jinja says what is trained) and prints one JSON line: each run's eval loss, steps and checkpoint.
Under a launcher (`torchrun --nproc_per_node 2 examples/python_api.py ...`) every rank runs the same script.
"""

import argparse
import json
import os
import random

from ulysses_train import train
from ulysses_train.errors import ConfigError

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chatml.jinja")


def write_conversations(path: str, count: int, seed: int) -> str:
    """`count` rows of {"messages": [user, assistant]}: a sum and its answer."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                             {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]}) + "\n")
    return path


def main(out: str) -> dict:
    os.makedirs(out, exist_ok=True)
    # TRL's SFTConfig names; ulysses-train reads them as its own flags (config.yaml holds the canonical ones)
    settings = {
        "dataset": write_conversations(os.path.join(out, "train.jsonl"), 16, seed=0),
        "eval_dataset": write_conversations(os.path.join(out, "eval.jsonl"), 4, seed=1),
        "tokenizer": "bytes", "chat_template": TEMPLATE, "max_length": 128, "assistant_only_loss": True,
        "learning_rate": 3e-3, "gradient_accumulation_steps": 2, "num_train_epochs": 1, "warmup_ratio": 0.25,
        "lr_scheduler_type": "linear", "min_lr_ratio": 0.0, "bf16": False, "data_cache_dir": os.path.join(out, "cache"),
    }
    runs = {}
    for lr in (3e-3, 1e-2):  # a sweep: the same interpreter trains again
        result = train(settings, learning_rate=lr, output_dir=os.path.join(out, f"lr_{lr:g}"))
        runs[f"{lr:g}"] = {"eval_loss": result.eval_loss, "steps": result.metrics["step"],
                           "checkpoint": result.checkpoint, "lr": [r["lr"] for r in result.history]}
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
