"""What the trainer will see: its first samples, token by token, with what is trained.

    python -m ulysses_train.preview [--num_samples N] [--color auto|always|never] <flags of launch/train.py>

It reads the same flags, data and token cache as a run with those flags (no process group, no model: only the
model's config, for its vocabulary and heads) and prints the first N samples in the order the first steps train
them, each with:

- every token, decoded; the trained ones (the targets: those the loss asks the model to write from the tokens
  before them) in colour on a terminal, else between [[ and ]];
- where each document or conversation starts inside a packed sample (‹doc N›) and the padding (‹pad xN›);
- where each SP rank's shard starts (‹rank R›; with --ring_size, the zigzag chunks), for --sp_size (default 1 here:
  give the run's) and --ring_size;
- its counts: positions, real tokens, trained tokens and the targets of each SP rank's shard (targets are shifted
  over the whole sequence before it is cut, as sp/sharding.py does).

Exit code 2 with the reason for a setting or data to change, as the trainer would say it.
"""

from __future__ import annotations

import argparse
import sys
import unicodedata
from typing import Optional

import torch

from ..errors import ConfigError
from ..sp.sharding import IGNORE_INDEX, shard_order, shard_sequence

TRAINED, DOC, RANK, RESET = "\033[1;32m", "\033[33m", "\033[35m", "\033[0m"  # bold green, yellow, magenta


def _owners(length: int, sp: int, ring: int) -> torch.Tensor:
    """(length,): the SP rank that holds each position of a sequence padded to `length` (sp/sharding.py's cut)."""
    owner = torch.empty(length, dtype=torch.long)
    local = length // sp
    order = shard_order(length, ring)
    for rank in range(sp):
        owner[order[rank * local:(rank + 1) * local]] = rank
    return owner


# bidirectional overrides and isolates reorder what a terminal shows (the "Trojan source" characters)
_BIDI = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def _visible(text: str) -> str:
    """A token's text as it may go to a terminal: newlines and tabs marked, and every other control character (a
    row's clear-screen or title escape, BEL, NUL) and bidirectional override written as its code, never sent raw."""
    out = []
    for c in text:
        if c == "\n":
            out.append("↵\n")
        elif c == "\t":
            out.append("→")
        elif unicodedata.category(c) == "Cc" or c in _BIDI:
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out)


class Renderer:
    def __init__(self, tokenizer, color: bool, sp: int, ring: int):
        self.tokenizer, self.color, self.sp, self.ring = tokenizer, color, sp, ring

    def _token(self, token: int) -> str:
        if self.tokenizer is None:
            return f"{token} "
        return _visible(self.tokenizer.decode([token]))

    def _mark(self, text: str, style: str) -> str:
        return f"{style}‹{text}›{RESET}" if self.color else f"‹{text}›"

    def sample(self, batch: dict, valid: int, title: str) -> str:
        """One sample: a batch of one row (build_batch's) of which `valid` tokens are real, its marks and counts."""
        ids, labels = batch["input_ids"][0], batch["labels"][0]
        docs = batch["docs"][0] if batch["docs"] is not None else None  # only packing keeps documents apart
        shards = [shard_sequence(batch["input_ids"], self.sp, r, labels=batch["labels"], ring_size=self.ring)
                  for r in range(self.sp)]
        owner = _owners(shards[0]["input_ids"].shape[1] * self.sp, self.sp, self.ring)
        starts = self._doc_starts(docs)
        out, trained_open = [], False
        for t in range(valid):
            marks = []
            if self.sp > 1 and (t == 0 or owner[t] != owner[t - 1]):
                marks.append(self._mark(f"rank {int(owner[t])}", RANK))
            if starts.get(t, 0) > 0:
                marks.append(self._mark(f"doc {starts[t] + 1}", DOC))
            trained = t > 0 and bool(labels[t] != IGNORE_INDEX)  # the first token is no position's target
            if trained_open and (marks or not trained):
                out.append(self._close())
                trained_open = False
            out.extend(marks)
            if trained and not trained_open:
                out.append(TRAINED if self.color else "[[")
                trained_open = True
            out.append(self._token(int(ids[t])))
        if trained_open:
            out.append(self._close())
        out.extend(self._padding(valid, len(ids), owner))
        return f"{title}\n{''.join(out)}\n{self._counts(ids, labels, valid, docs, shards)}\n"

    def _padding(self, valid: int, length: int, owner: torch.Tensor) -> list[str]:
        """The padding, cut where an SP rank's shard starts inside it."""
        marks, start = [], valid
        for t in range(valid, length + 1):
            if t == length or (self.sp > 1 and t > valid and owner[t] != owner[t - 1]):
                if t > start:
                    marks.append(self._mark(f"pad x{t - start}", DOC))
                if t < length:
                    marks.append(self._mark(f"rank {int(owner[t])}", RANK))
                start = t
        return marks

    def _close(self) -> str:
        return RESET if self.color else "]]"

    @staticmethod
    def _doc_starts(docs: Optional[list]) -> dict:
        """{position: its document's number} for each document's first position."""
        starts, at = {}, 0
        for number, length in enumerate(docs or []):
            starts.setdefault(at, number)
            at += length
        return starts

    def _counts(self, ids, labels, valid: int, docs, shards) -> str:
        trained = int((labels[1:] != IGNORE_INDEX).sum())
        pieces = len(docs) - (valid < len(ids)) if docs else 1
        text = (f"  {len(ids):,} positions, {valid:,} real tokens, {trained:,} trained, {pieces} "
                f"document(s)/conversation(s)")
        if self.sp > 1:
            targets = [int((s["labels"] != IGNORE_INDEX).sum()) for s in shards]
            text += "; targets per SP rank: " + ", ".join(f"rank {r} {n:,}" for r, n in enumerate(targets))
        return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ulysses_train.preview", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num_samples", type=int, default=2, help="How many samples to show (default: 2).")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="Colour the trained tokens (auto: on a terminal), else mark them with [[ ]].")
    return p


def preview(cfg, num_samples: int, color: bool, write=print) -> None:
    """The first `num_samples` samples a run of `cfg` trains, rendered (module docstring)."""
    from ..data.load import load_source
    from ..data.sources import Row, SyntheticSource, build_batch, sample_order
    from ..model.build import load_model_config
    from ..sp.layout import Target, resolve_layout
    from ..train.config.train_config import verify_seq_len
    from ..train.run.preflight import preflight

    cfg.validate()
    preflight(cfg)
    config = load_model_config(cfg.base.model, cfg.base.model_config, cfg.base.num_layers)
    # one SP group (--sp_size, default 1) on the GPUs the run is for, laid out as the trainer lays it out: the shards
    # shown are the ones it cuts, and a layout it refuses is refused here with its message
    layout = resolve_layout(cfg.layout_flags(), config, Target.planned(cfg.parallel.sp_size or 1))
    seq_len, sp, ring = verify_seq_len(cfg), layout.sp_size, layout.ring_size
    if cfg.data.dataset:
        tokenizer, source = load_source(cfg.data_settings(), cfg.data.dataset, cfg.data.dataset_split, seq_len,
                                        config.vocab_size, 0, write)
    else:
        from ..data.corpus import load_tokenizer

        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.base.model, need_eos=False) if cfg.base.model else None
        source = SyntheticSource(config.vocab_size, seq_len, cfg.data.seed)
    renderer = Renderer(tokenizer, color, sp, ring)
    legend = "trained tokens in colour" if color else "[[trained tokens]]"
    layout = f"--sp_size {sp}" + (f", --ring_size {ring}" if ring > 1 else "")
    write(f"legend: {legend}, ‹doc N› where the Nth document or conversation of a packed sample starts, ‹pad xN› "
          f"padding, ‹rank R› where SP rank R's shard starts ({layout})")
    total = source.num_samples if source.num_samples is not None else num_samples
    for index in range(min(num_samples, total)):
        stored = sample_order(index, source.num_samples, cfg.data.seed)
        where = f"sample {stored}"
        if hasattr(source, "locate"):  # a mixture: which dataset, which of its samples
            entry, local = source.locate(stored)
            where += f" (dataset {entry + 1}, its sample {local})"
        row = Row(*source.get(stored))
        batch = build_batch([row], cfg.data.packing)
        write(renderer.sample(batch, row.valid, f"=== trained #{index + 1}: {where} ==="))


def main(argv=None) -> int:
    from ..train.config.config_file import parse_args

    own, rest = _parser().parse_known_args(argv)
    color = own.color == "always" or (own.color == "auto" and sys.stdout.isatty())
    try:
        cfg, _ = parse_args(rest)  # the trainer's flags: a wrong one is one line, as from launch/train.py
        if own.num_samples < 1:
            raise ConfigError(f"--num_samples must be positive, got {own.num_samples}")
        preview(cfg, own.num_samples, color)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
