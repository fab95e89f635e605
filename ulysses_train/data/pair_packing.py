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
about one context.
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


class PreferenceSamples:
    """Rows of exactly `seq_len` tokens made of whole pairs of a preference store (data/preference.py)."""

    def __init__(self, store, seq_len: int, max_length: int, truncation: str, packing: bool, pad_id: int,
                 length_flag: str = "--seq_len"):
        if 2 * max_length > seq_len:
            raise ConfigError(f"{length_flag} {seq_len} holds both sides of a pair: it must be at least 2 x "
                              f"--max_length ({max_length}); raise {length_flag} or lower --max_length")
        self.store, self.seq_len, self.max_length, self.truncation = store, seq_len, max_length, truncation
        self.pad_id = pad_id
        n = len(store.doc_starts) // 2  # --max_tokens can end the store between the sides of a pair
        starts = np.asarray(store.doc_starts[:2 * n], dtype=np.int64)
        ends = np.append(store.doc_starts[1:], len(store.tokens))[:2 * n]
        self.starts, self.lengths = starts.reshape(n, 2), (ends - starts).reshape(n, 2)
        self.prompts = np.asarray([int(np.argmax(store.trained[s:e])) for s, e in zip(starts, ends)],
                                  dtype=np.int64).reshape(n, 2)
        self.cut = self._cuts()
        self.kept = self.lengths - self.cut
        self.truncated = int((self.cut.sum(axis=1) > 0).sum())
        pair_lengths = self.kept.sum(axis=1)
        if packing:
            self.order, self.row_starts = first_fit_decreasing(pair_lengths, seq_len)
        else:
            self.order, self.row_starts = np.arange(n), np.arange(n + 1)

    def _cuts(self) -> np.ndarray:
        """(pairs, 2): tokens cut from each side, from its start (left) or its end (right)."""
        longest, limit = self.lengths.max(axis=1), self.max_length
        long = longest > limit
        if long.any() and self.truncation == "error":
            raise ConfigError(f"{int(long.sum())} preference pair(s) have a side (prompt + completion) longer than "
                              f"--max_length {limit} (the longest has {int(longest.max())} tokens): raise "
                              f"--max_length (and --seq_len, at least twice it), or cut them with --truncation left "
                              f"(the prompt's start, from both sides) or --truncation right (the completions' ends)")
        if self.truncation == "left":
            cut = np.where(long, longest - limit, 0)
            bad = cut >= self.prompts[:, 0]  # the completion alone, with one prompt token, is longer
            if bad.any():
                completion = (self.lengths - self.prompts).max(axis=1)[bad].max()
                raise ConfigError(f"{int(bad.sum())} preference pair(s) have a completion that does not fit in "
                                  f"--max_length {limit} with a token of its prompt (the longest completion has "
                                  f"{int(completion)} tokens): --truncation left cuts only prompts; raise "
                                  f"--max_length or use --truncation right")
            return np.repeat(cut[:, None], 2, axis=1)
        if self.truncation == "right":
            bad = long & (self.prompts[:, 0] >= limit)
            if bad.any():
                raise ConfigError(f"{int(bad.sum())} preference pair(s) have a prompt of at least --max_length "
                                  f"{limit} tokens (the longest has {int(self.prompts[bad, 0].max())}): --truncation "
                                  f"right would leave no completion; raise --max_length or use --truncation left")
            return np.maximum(self.lengths - limit, 0)
        return np.zeros_like(self.lengths)

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    @property
    def num_pairs(self) -> int:
        return len(self.lengths)

    def pairs(self, i: int) -> list[int]:
        """Indices of the pairs in row i."""
        return self.order[self.row_starts[i]:self.row_starts[i + 1]].tolist()

    def _piece(self, pair: int, side: int) -> slice:
        start, length, cut = (int(a[pair, side]) for a in (self.starts, self.lengths, self.cut))
        return slice(start + cut, start + length) if self.truncation == "left" else slice(start, start + length - cut)

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
        """One line for the log: pairs, rows, fill and what was cut."""
        text = (f"{self.num_pairs:,} pairs ({int(self.lengths.sum()):,} tokens, the prompt repeated in both sides) "
                f"-> {len(self):,} rows of {self.seq_len:,} ({int(self.kept.sum()) / max(1, len(self) * self.seq_len):.0%}"
                f" filled), sides of at most --max_length {self.max_length:,}")
        if self.truncated:
            text += f", {self.truncated:,} cut (--truncation {self.truncation})"
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
