"""Preference pairs into rows: one pair (two documents, prompt + chosen and prompt + rejected) per row, padded, or
with --packing several pairs per row by first-fit decreasing (data/packing.py), a pair never split.

A row is split over the SP group like any packed sample: the two sides are documents (positions restart at each,
attention never crosses one), and every token carries the sequence it belongs to (`segments`: 2 p for pair p's
chosen side, 2 p + 1 for its rejected side, -100 where nothing is scored), cut and shifted with the labels, so that
each rank sums its shard's log-probs per sequence before the SP group adds them up (levers/preference_loss.py).

--max_length is the most tokens of one side (prompt + completion), TRL's `max_length`; a row of --seq_len tokens
holds any pair when --seq_len >= 2 x --max_length. A side longer than it is an error (--truncation error, the
default, the message gives how many and the longest), or is cut, never silently (the log says how many were):

    left   the prompt's start, the same tokens from both sides (they keep one prompt), the completions whole; a pair
           whose completion alone (with one token of prompt) is longer than --max_length is an error
    right  each side's end: the prompt whole, the completions' ends; a pair whose prompt leaves no token of
           completion is an error

TRL cuts each side on its own; `left` here keeps the two prompts equal, as the preference between the two answers is
about one context. --max_prompt_length (TRL's) cuts a longer prompt's start first, from both sides, whatever
--truncation says; --max_length then applies to what is left.

A pair whose two sides are the same (data/preference.py stores it as two stand-ins that score nothing) has no
preference to learn: it is left out of the rows, and the log names how many and the first rows; a dataset of only
such pairs is a ConfigError naming them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from ..errors import ConfigError
from ..sp.sharding import IGNORE_INDEX
from .packing import first_fit_decreasing
from .sources import Row, build_batch


class PairRow(NamedTuple):
    """One row of pairs: the packed-sample fields of sources.Row, `segments` (seq_len,) unshifted like the labels,
    and the dataset indices of its pairs (for the reference log-probs)."""

    ids: torch.Tensor
    valid: int
    docs: list
    labels: torch.Tensor
    segments: torch.Tensor
    pairs: list


def _rows(mask: np.ndarray, shown: int = 5) -> str:
    """The dataset rows (pair indices) where `mask` holds, the first few: "rows 3, 7 and 12 more"."""
    rows = np.flatnonzero(mask)
    text = ", ".join(str(r) for r in rows[:shown])
    return f"row{'s' * (len(rows) > 1)} {text}" + (f" and {len(rows) - shown:,} more" if len(rows) > shown else "")


class PreferenceSamples:
    """Rows of exactly `seq_len` tokens made of whole pairs of a preference store (data/preference.py); pair i is
    the dataset's row i. Pairs whose two sides are the same are left out (`identical`), and refused when no other
    is left."""

    def __init__(self, store, seq_len: int, max_length: int, truncation: str, packing: bool, pad_id: int,
                 length_flag: str = "--seq_len", max_prompt_length: Optional[int] = None, dataset: str = ""):
        if 2 * max_length > seq_len:
            raise ConfigError(f"{length_flag} {seq_len} holds both sides of a pair: it must be at least 2 x "
                              f"--max_length ({max_length}); raise {length_flag} or lower --max_length")
        self.store, self.seq_len, self.max_length, self.truncation = store, seq_len, max_length, truncation
        self.max_prompt_length, self.pad_id, self.dataset = max_prompt_length, pad_id, dataset
        self._of = f" of --dataset {dataset}" if dataset else ""
        n = len(store.doc_starts) // 2  # --max_tokens can end the store between the sides of a pair
        starts = np.asarray(store.doc_starts[:2 * n], dtype=np.int64)
        ends = np.append(store.doc_starts[1:], len(store.tokens))[:2 * n]
        self.starts, self.lengths = starts.reshape(n, 2), (ends - starts).reshape(n, 2)
        scored = np.add.reduceat(np.asarray(store.trained), np.asarray(store.doc_starts, dtype=np.int64),
                                 dtype=np.int64)[:2 * n].reshape(n, 2)
        self.identical = (scored == 0).all(axis=1)  # data/preference.py's stand-ins: nothing to score
        if self.identical.all():
            raise ConfigError(f"--dataset {dataset}: {'every one' if n > 1 else 'the one'} of its {n:,} pair(s) has "
                              f"the same chosen and rejected completion ({_rows(self.identical)}): such a pair has "
                              f"no preference to learn (its loss and gradient do not move); give pairs whose "
                              f"completions differ")
        self.prompts = np.asarray([int(np.argmax(store.trained[s:e])) for s, e in zip(starts, ends)],
                                  dtype=np.int64).reshape(n, 2)
        self.head, self.tail = self._cuts()
        self.kept = self.lengths - self.head[:, None] - self.tail
        self.kept[self.identical] = 0
        self.truncated = int(((self.head > 0) | (self.tail.sum(axis=1) > 0)).sum())
        pairs = np.flatnonzero(~self.identical)
        if packing:
            order, self.row_starts = first_fit_decreasing(self.kept[pairs].sum(axis=1), seq_len)
            self.order = pairs[order]
        else:
            self.order, self.row_starts = pairs, np.arange(len(pairs) + 1)

    def _cuts(self) -> tuple[np.ndarray, np.ndarray]:
        """(pairs,) tokens cut from the prompt's start (the same from both sides: --max_prompt_length, --truncation
        left) and (pairs, 2) from each side's end (--truncation right)."""
        prompts, limit, counted = self.prompts[:, 0], self.max_length, ~self.identical
        head = np.zeros_like(prompts)
        if self.max_prompt_length is not None:  # TRL's max_prompt_length: a prompt keeps its last tokens
            head = np.maximum(prompts - self.max_prompt_length, 0)
        lengths = self.lengths - head[:, None]
        longest = lengths.max(axis=1)
        long = (longest > limit) & counted
        tail = np.zeros_like(self.lengths)
        if long.any() and self.truncation == "error":
            raise ConfigError(f"{int(long.sum())} preference pair(s) have a side (prompt + completion) longer than "
                              f"--max_length {limit} ({_rows(long)}{self._of}; the longest has "
                              f"{int(longest[long].max())} tokens): raise --max_length (and --seq_len, at least "
                              f"twice it), or cut them with --truncation left (the prompt's start, from both sides), "
                              f"--truncation right (the completions' ends) or --max_prompt_length")
        if self.truncation == "left":
            head = head + np.where(long, longest - limit, 0)
            bad = long & (head >= prompts)  # the completion alone, with one prompt token, is longer
            if bad.any():
                completion = (self.lengths - self.prompts).max(axis=1)[bad].max()
                raise ConfigError(f"{int(bad.sum())} preference pair(s) have a completion that does not fit in "
                                  f"--max_length {limit} with a token of its prompt ({_rows(bad)}{self._of}; "
                                  f"the longest completion has {int(completion)} tokens): "
                                  f"--truncation left cuts only prompts; raise --max_length or use --truncation "
                                  f"right")
        elif self.truncation == "right":
            bad = long & (prompts - head >= limit)
            if bad.any():
                raise ConfigError(f"{int(bad.sum())} preference pair(s) have a prompt of at least --max_length "
                                  f"{limit} tokens ({_rows(bad)}{self._of}; the longest has "
                                  f"{int((prompts - head)[bad].max())}): --truncation right would leave no "
                                  f"completion; raise --max_length, give --max_prompt_length, or use --truncation "
                                  f"left")
            tail = np.where(counted[:, None], np.maximum(lengths - limit, 0), 0)
        return head, tail

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    @property
    def num_pairs(self) -> int:
        """The store's pairs (the dataset's rows), the identical ones included: the reference's table is indexed
        by row."""
        return len(self.lengths)

    def pairs(self, i: int) -> list[int]:
        """Indices of the pairs in row i."""
        return self.order[self.row_starts[i]:self.row_starts[i + 1]].tolist()

    def _piece(self, pair: int, side: int) -> slice:
        start, length, tail = (int(a[pair, side]) for a in (self.starts, self.lengths, self.tail))
        return slice(start + int(self.head[pair]), start + length - tail)

    def sample(self, i: int) -> PairRow:
        """Row i: its pairs' sides in order (chosen, rejected, next pair's chosen, ...), then the padding."""
        pieces = [self._piece(p, side) for p in self.pairs(i) for side in (0, 1)]
        ids = np.concatenate([np.asarray(self.store.tokens[s], dtype=np.int64) for s in pieces])
        trained = np.concatenate([np.asarray(self.store.trained[s], dtype=bool) for s in pieces])
        # piece k is side k % 2 of the row's pair k // 2: its sequence number is k
        local = np.concatenate([np.full(s.stop - s.start, k) for k, s in enumerate(pieces)])
        valid = len(ids)
        out = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        out[:valid] = torch.from_numpy(ids)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        labels[:valid] = torch.from_numpy(np.where(trained, ids, IGNORE_INDEX))
        segments = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        segments[:valid] = torch.from_numpy(np.where(trained, local, IGNORE_INDEX))
        docs = [s.stop - s.start for s in pieces] + ([self.seq_len - valid] if valid < self.seq_len else [])
        return PairRow(out, valid, docs, labels, segments, self.pairs(i))

    def describe(self) -> str:
        """One line for the log: pairs, rows, fill, what was cut and what was left out."""
        used = ~self.identical
        text = (f"{int(used.sum()):,} pairs ({int(self.lengths[used].sum()):,} tokens, the prompt repeated in both "
                f"sides) -> {len(self):,} rows of {self.seq_len:,} "
                f"({int(self.kept.sum()) / max(1, len(self) * self.seq_len):.0%} filled), sides of at most "
                f"--max_length {self.max_length:,}")
        if self.max_prompt_length is not None:
            text += f", prompts of at most --max_prompt_length {self.max_prompt_length:,}"
        if self.truncated:
            text += f", {self.truncated:,} cut (--truncation {self.truncation}, --max_prompt_length)" \
                if self.max_prompt_length is not None else f", {self.truncated:,} cut (--truncation {self.truncation})"
        if self.identical.any():
            text += (f"; {int(self.identical.sum()):,} left out: their chosen and rejected completions are the same "
                     f"({_rows(self.identical)})")
        return text


class PreferenceSource:
    """Rows of pairs for the trainer (`num_samples`, `get(index)` as the other sources)."""

    def __init__(self, samples: PreferenceSamples):
        self.samples = samples
        self.num_samples = len(samples)

    def get(self, index: int) -> PairRow:
        return self.samples.sample(index)


def preference_batch(rows: list[PairRow], reference: Optional[np.ndarray] = None) -> dict:
    """Rows of pairs -> sources.build_batch's packed batch (documents kept apart) and: `segments` (b, s), the
    micro-batch's sequence of every scored token (2 p + side, pairs numbered across the rows; -100 elsewhere);
    `pair_ids` (P,), the pairs' dataset indices; `scored` (P, 2), each side's scored tokens; `conversations`, the
    pairs; and `reference` (P, 2) fp64, the reference log-probs of each side, where they are given ((pairs, 2) for
    the whole dataset)."""
    batch = build_batch([Row(r.ids, r.valid, r.docs, r.labels) for r in rows], packing=True)
    segments, offset = torch.full_like(batch["labels"], IGNORE_INDEX), 0
    for r, row in enumerate(rows):
        segments[r] = torch.where(row.segments >= 0, row.segments + 2 * offset, IGNORE_INDEX)
        offset += len(row.pairs)
    segments[batch["labels"] == IGNORE_INDEX] = IGNORE_INDEX  # a document's first token is never scored
    segments[:, 0] = IGNORE_INDEX  # nor a row's
    scored = torch.bincount(segments[segments >= 0], minlength=2 * offset).view(offset, 2)
    pair_ids = torch.tensor([p for row in rows for p in row.pairs], dtype=torch.long)
    batch.update(segments=segments, pair_ids=pair_ids, scored=scored, conversations=offset)
    if reference is not None:
        batch["reference"] = torch.from_numpy(np.asarray(reference[pair_ids.numpy()], dtype=np.float64))
    return batch
