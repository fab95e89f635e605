"""The per-position check on a task that needs long-range context, small enough for a CPU in seconds.

    python -m ulysses_train.long_range_demo [--out DIR] [--short 64] [--long 256]

Each sequence is `BOS key x1 y1 x2 y2 ...` with a key in 1..8 at position 1, random x in 0..31, and
y = (x + key) mod 32: every y needs the key, so every y needs to look back to position 1, as far as the sequence is
long. A tiny Qwen3 (2 layers, rope_theta 100 so that its slowest rotary dimensions turn less than once over the
trained length) is trained at `--short` tokens and read at `--long` with `eval_positions.per_position_loss`:

* without YaRN, the loss rises right after the trained length: positions beyond it see rotary angles never trained;
* with YaRN (our `configure_rope`, factor long/short) and no more training, most of the rise is gone;
* with YaRN and a few steps at the long length, the curve is flat.

It writes `long_range.png` (the three curves, with the x entropy as the floor a model without the key would reach)
and `long_range.json`. Tests assert the three shapes (tests/unit/test_long_range.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import types

import torch

KEYS, VALUES, VOCAB = 8, 32, 48  # ids: 0 BOS, 1..8 keys, 16..47 values


def keyed_sum_batch(n: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """(n, length) sequences `BOS key x1 y1 x2 y2 ...` with y = (x + key) mod 32, values offset by 16."""
    key = torch.randint(1, 1 + KEYS, (n, 1), generator=generator)
    x = torch.randint(0, VALUES, (n, length // 2), generator=generator)
    pairs = torch.stack([x, (x + key) % VALUES], dim=2).reshape(n, -1) + 16
    return torch.cat([torch.zeros(n, 1, dtype=torch.long), key, pairs[:, : length - 2]], dim=1)


def tiny_model(trained_length: int, scale_to: int | None = None):
    """A 2-layer Qwen3 for the task; with scale_to, YaRN is configured for that length by configure_rope."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..levers.rope import configure_rope

    config = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                  max_position_embeddings=trained_length, use_cache=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    if scale_to:
        configure_rope(config, "yarn", scale_to)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def train(model, length: int, steps: int, batch: int, lr: float, generator: torch.Generator) -> float:
    """Next-token loss on every position after the key; returns the last step's loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        ids = keyed_sum_batch(batch, length, generator)
        labels = ids.clone()
        labels[:, :2] = -100  # BOS and the key itself are not predictable
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def position_curve(model, length: int, samples: int = 16, bucket: int = 16, threshold: float = 0.5) -> dict:
    """Mean loss per position bucket on fresh sequences, summarised by eval_positions.summarize."""
    from .eval_positions import per_position_loss, summarize

    ids = keyed_sum_batch(samples, length, torch.Generator().manual_seed(1234))
    single = types.SimpleNamespace(sp_size=1, sp_rank=0, sp_group=None)
    model.eval()
    with torch.no_grad():
        losses = torch.stack([per_position_loss(model, row, single, torch.device("cpu")) for row in ids])
    losses[:, 0] = float("nan")  # predicting the key from BOS is a guess
    return summarize(losses.nanmean(0), bucket, threshold, tail_tokens=length // 4)


def run(short: int = 64, long: int = 256, steps: int = 400, finetune_steps: int = 30, seed: int = 0) -> dict:
    """Trains at `short`, reads at `long` without YaRN, with YaRN, and with YaRN after a short fine-tune."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    base = tiny_model(short)
    train(base, short, steps, batch=32, lr=3e-3, generator=generator)
    curves = {"no YaRN": position_curve(base, long)}
    yarn = tiny_model(short, scale_to=long)
    yarn.load_state_dict(base.state_dict())  # YaRN changes no weight, only the rotary frequencies
    curves["YaRN, no training"] = position_curve(yarn, long)
    train(yarn, long, finetune_steps, batch=8, lr=1e-3, generator=generator)
    curves[f"YaRN, {finetune_steps} steps at {long}"] = position_curve(yarn, long)
    return {"short": short, "long": long, "curves": curves}


def plot(path: str, result: dict, bucket: int = 16) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, curve in result["curves"].items():
        ax.plot([s + bucket / 2 for s in curve["starts"]], curve["means"], marker=".", label=name)
    floor = math.log(VALUES) / 2  # x is random (log 32 nats), y is free once the key is read
    ax.axhline(floor, color="gray", linestyle="--", label=f"reading the key: {floor:.2f} nats")
    ax.axvline(result["short"], color="black", linestyle=":", label=f"trained length {result['short']}")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("Keyed sums: every other token needs position 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ulysses_train.long_range_demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/long_range_demo")
    p.add_argument("--short", type=int, default=64, help="trained length")
    p.add_argument("--long", type=int, default=256, help="length read, and fine-tuned with YaRN")
    a = p.parse_args(argv)
    result = run(a.short, a.long)
    os.makedirs(a.out, exist_ok=True)
    plot(os.path.join(a.out, "long_range.png"), result)
    with open(os.path.join(a.out, "long_range.json"), "w") as f:
        json.dump(result, f, indent=1)
    for name, curve in result["curves"].items():
        rise = curve["first_rise_position"]
        print(f"{name:<24} early {curve['early_mean']:.2f}  last {curve['tail_tokens']} tokens "
              f"{curve['tail_mean']:.2f}  first rise {'none' if rise is None else rise}")
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
