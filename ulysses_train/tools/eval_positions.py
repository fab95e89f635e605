"""Loss at every position of long sequences: does the model really read position 900,000?

    python -m ulysses_train.eval_positions --model PATH --dataset DATA --seq_len N [--out DIR]
    torchrun --nproc_per_node 8 -m ulysses_train.eval_positions ...   (Ulysses SP over all ranks)

Writes `positions.csv` (bucket start, bucket end, mean loss), `positions.png` (mean loss per bucket, with the
unigram entropy of the same tokens as a reference line: a model that ignores context does no better than that),
and prints a summary line: the mean loss over the last 20k tokens, and the first position where the loss rises
above the early average (first 10% of buckets) by --threshold nats. This is the check that YaRN worked.

Conversation data (the trainer's SFT formats, data/sft.py: `messages`, `prompt`/`completion`, pre-tokenized) is
read as the trainer reads it, one conversation per sample (padded), and only its trained tokens count: with the
default `--loss_on auto`, what the assistant writes. Positions that train nothing (prompts, padding) have no loss;
the means are over the positions that do.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.sft import DATA_FORMATS, LOSS_ON, TRUNCATION
from ..errors import ConfigError
from ..levers.loss import backbone


def per_position_loss(model, ids: torch.Tensor, groups, device, labels=None) -> torch.Tensor:
    """(s,) token ids of one sequence -> (s-1,) cross-entropy of predicting token t+1 from its prefix; NaN where
    token t+1 is not a target (`labels`: unshifted, -100 where not trained; default: every token is one)."""
    from ..sp.sharding import IGNORE_INDEX, shard_sequence

    labels = None if labels is None else labels[None]
    shard = {k: v.to(device) for k, v in shard_sequence(ids[None], groups.sp_size, groups.sp_rank,
                                                        labels=labels).items()}
    hidden = backbone(model)(input_ids=shard["input_ids"], position_ids=shard["position_ids"])[0]
    head = model.get_output_embeddings()
    losses = []
    for piece in torch.split(torch.arange(hidden.shape[1], device=device), 4096):  # never the full logits
        logits = F.linear(hidden[0, piece], head.weight).float()
        losses.append(F.cross_entropy(logits, shard["labels"][0, piece].clamp(min=0), reduction="none"))
    local = torch.cat(losses).masked_fill(shard["labels"][0] == IGNORE_INDEX, float("nan"))
    if groups.sp_size > 1:
        parts = [torch.empty_like(local) for _ in range(groups.sp_size)]
        dist.all_gather(parts, local.contiguous(), group=groups.sp_group)
        local = torch.cat(parts)
    return local[: ids.shape[0] - 1].cpu()


def unigram_entropy(ids: torch.Tensor) -> float:
    counts = torch.bincount(ids.flatten()).float()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def summarize(losses: torch.Tensor, bucket: int, threshold: float, tail_tokens: int = 20_000) -> dict:
    """losses: (positions,) mean loss per position, NaN where nothing is a target. Returns bucket means (NaN for a
    bucket without targets) and the summary numbers, over the positions with a loss."""
    n = losses.shape[0]
    starts = list(range(0, n, bucket))
    means = [float(losses[s:s + bucket].nanmean()) for s in starts]
    scored = [m for m in means if not math.isnan(m)] or [math.nan]
    early = scored[: max(1, len(scored) // 10)]
    early_mean = sum(early) / len(early)
    rise = next((s for s, m in zip(starts, means) if m > early_mean + threshold), None)
    targets = losses[~losses.isnan()]
    tail = min(tail_tokens, len(targets))
    return {"starts": starts, "means": means, "early_mean": early_mean, "first_rise_position": rise,
            "tail_tokens": tail, "tail_mean": float(targets[len(targets) - tail:].mean())}


def plot(path: str, summary: dict, bucket: int, entropy: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    centers = [s + bucket / 2 for s in summary["starts"]]
    ax.plot(centers, summary["means"], marker=".", label="mean loss per bucket")
    ax.axhline(entropy, color="gray", linestyle="--", label=f"unigram entropy {entropy:.2f} nats")
    if summary["first_rise_position"] is not None:
        ax.axvline(summary["first_rise_position"], color="red", linestyle=":", label="first rise above early mean")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ulysses_train.eval_positions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--dataset_split", default="train")
    p.add_argument("--text_column", default=None)
    p.add_argument("--data_format", default="auto", choices=DATA_FORMATS, help="as the trainer's --data_format")
    p.add_argument("--chat_template", default=None, help="as the trainer's --chat_template")
    p.add_argument("--loss_on", default="auto", choices=LOSS_ON,
                   help="which tokens count, as the trainer's --loss_on (auto: what the assistant writes in "
                        "conversations, every token of text)")
    p.add_argument("--truncation", default="error", choices=TRUNCATION, help="as the trainer's --truncation")
    p.add_argument("--tokenizer", default=None, help="default: the model's; 'bytes' for the byte tokenizer")
    p.add_argument("--seq_len", type=int, required=True)
    p.add_argument("--num_samples", type=int, default=4)
    p.add_argument("--bucket", type=int, default=None, help="positions per bucket (default: seq_len / 64)")
    p.add_argument("--threshold", type=float, default=0.5, help="nats above the early mean that count as a rise")
    p.add_argument("--out", default="outputs/eval_positions")
    p.add_argument("--data_cache_dir", default=os.path.join(os.path.expanduser("~"), ".cache", "ulysses_train"))
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> None:
    """The numbers, and the model, tokenizer and dataset paths: ConfigErrors naming the flag."""
    from ..train.run.preflight import check_chat_template, check_dataset, check_model, check_tokenizer

    if a.seq_len < 2:
        raise ConfigError(f"--seq_len must be at least 2 (a loss needs a token and its successor), got {a.seq_len}")
    for name in ("num_samples", "bucket"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise ConfigError(f"--{name} must be positive, got {getattr(a, name)}")
    if not math.isfinite(a.threshold):
        raise ConfigError(f"--threshold must be a finite number, got {a.threshold}")
    check_model(a.model, need_tokenizer=a.tokenizer is None)
    check_tokenizer(a.tokenizer)
    check_dataset(a.dataset)
    check_chat_template(a.chat_template)


def main(argv=None) -> int:
    """Settings and data are checked before any process group or model exists: a setting to change is one message
    (from rank 0) and exit code 2 on every rank."""
    from transformers import AutoConfig

    from ..data.corpus import load_tokenizer
    from ..sp.layout import LayoutFlags, Target, resolve_layout

    a = parse_args(argv)
    try:
        check_args(a)
        # every rank shares one sequence (SP over the world, Ulysses alone, SDPA: what evaluate builds), laid out as
        # the trainer would: heads that do not split, or a layer that would not be exact, stop it here
        world = int(os.environ.get("WORLD_SIZE", 1))
        resolve_layout(LayoutFlags(sp_size=world, ring_size=1, attn_kernel="sdpa"), AutoConfig.from_pretrained(a.model),
                       Target(world, device_type="cuda" if torch.cuda.is_available() else "cpu"))
        tokenizer = load_tokenizer(a.tokenizer, a.model)
        samples = load_samples(a, tokenizer)
        require_targets(a, samples)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    evaluate(a, samples)
    return 0


def load_samples(a: argparse.Namespace, tokenizer):
    """Samples of --seq_len whose `get(i)` gives (ids, valid, docs, labels) (data/sources.py's Row): text cut from
    the joined documents, or conversations with their trained mask, through the trainer's own data path."""
    from ..data.corpus import corpus_samples, dataset_columns, load_corpus, unreadable_dataset_is_a_config_error
    from ..data.sft import detect_format, resolve_loss_on, sft_samples
    from ..data.sources import ChatSource, CorpusSource

    with unreadable_dataset_is_a_config_error(a.dataset):
        corpus = load_corpus(a.dataset, a.dataset_split)
        fmt = detect_format(dataset_columns(corpus), a.data_format, a.text_column)
    if fmt == "text":
        resolve_loss_on("text", a.loss_on, [])  # text counts every token
        samples, _ = corpus_samples(a.dataset, a.dataset_split, a.text_column, tokenizer, a.seq_len,
                                    a.data_cache_dir, can_pad=False, corpus=corpus)  # a padded tail shows nothing
        return CorpusSource(samples, packing=False)
    samples, _, _ = sft_samples(corpus, fmt, tokenizer, a.seq_len, dataset=a.dataset, split=a.dataset_split,
                                cache_dir=a.data_cache_dir, chat_template=a.chat_template, loss_on=a.loss_on,
                                truncation=a.truncation, vocab_size=_vocab_size(a.model))
    return ChatSource(samples)


def _vocab_size(model: str):
    """The model's vocabulary, from its config alone (pre-tokenized ids are checked against it); None if the config
    does not say."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    return getattr(config.get_text_config(), "vocab_size", None)


def require_targets(a: argparse.Namespace, samples) -> None:
    """The first --num_samples samples must hold a target, or every mean would be NaN (a ConfigError naming the
    flags, before any process group or model)."""
    from ..data.sources import build_batch, trainable_tokens

    n = min(a.num_samples, samples.num_samples)
    if any(trainable_tokens(build_batch([samples.get(i)], packing=False)) for i in range(n)):
        return
    raise ConfigError(f"the first {n} sample(s) of --dataset {a.dataset} have no target (nothing the model is "
                      f"trained to write under --loss_on {a.loss_on}): raise --num_samples, or check --loss_on and "
                      f"--chat_template")


def evaluate(a: argparse.Namespace, samples) -> None:
    """Loss per position over the first --num_samples samples (Ulysses SP over all ranks); rank 0 writes the csv,
    the plot and the summary. Ends the process (see exit_now)."""
    from transformers import AutoModelForCausalLM

    from ..data.sources import build_batch
    from ..model.surgery import SurgeryReport, apply_sp_patches
    from ..sp.attention import ATTN_NAME, register_ulysses_attention
    from ..sp.groups import SequenceParallelGroups
    from ..sp.sharding import IGNORE_INDEX
    from ..train.process.launcher import exit_now, normalise_launcher_env

    normalise_launcher_env()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    groups = SequenceParallelGroups(dist.get_world_size())
    register_ulysses_attention(groups.sp_group, "sdpa")
    model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation=ATTN_NAME,
                                                 dtype=torch.bfloat16 if cuda else torch.float32).to(device).eval()
    apply_sp_patches(model, groups.sp_group, SurgeryReport(), device)  # DeltaNet mixers, as training (auto kernel)
    n = min(a.num_samples, samples.num_samples)
    losses, targets = [], []
    with torch.no_grad():
        for i in range(n):
            row = build_batch([samples.get(i)], packing=False)  # labels: -100 where not a target
            ids, labels = row["input_ids"][0], row["labels"][0]
            losses.append(per_position_loss(model, ids, groups, device, labels))
            targets.append(ids[1:][labels[1:] != IGNORE_INDEX])
    if dist.get_rank() == 0:
        # per position, the mean over the samples where it is a target (NaN where it is none)
        write_results(a, torch.stack(losses).nanmean(0), torch.cat(targets), n)
    dist.barrier()
    exit_now(0)  # see exit_now: no process-group teardown


def write_results(a: argparse.Namespace, losses: torch.Tensor, ids: torch.Tensor, n: int) -> None:
    bucket = a.bucket or max(1, a.seq_len // 64)
    summary = summarize(losses, bucket, a.threshold)
    entropy = unigram_entropy(ids)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "positions.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["bucket_start", "bucket_end", "mean_loss"])
        for s, m in zip(summary["starts"], summary["means"]):
            writer.writerow([s, min(s + bucket, a.seq_len - 1), f"{m:.6f}"])
    plot(os.path.join(a.out, "positions.png"), summary, bucket, entropy,
         f"{os.path.basename(a.model.rstrip('/'))}: {n} x {a.seq_len:,} tokens")
    line = {"tail_tokens": summary["tail_tokens"], "tail_mean_loss": summary["tail_mean"],
            "early_mean_loss": summary["early_mean"], "first_rise_position": summary["first_rise_position"],
            "unigram_entropy": entropy, "samples": n}
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(line, f)
    rise = summary["first_rise_position"]
    print(f"last {summary['tail_tokens']:,} tokens: mean loss {summary['tail_mean']:.4f} (unigram entropy "
          f"{entropy:.4f}); "
          + ('no rise' if rise is None
             else f'loss first rises {a.threshold} nats above the early mean at position {rise:,}')
          + f" -> {a.out}")


if __name__ == "__main__":
    sys.exit(main())
