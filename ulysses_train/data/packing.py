"""Whole conversations into samples of exactly `seq_len` tokens: one per sample (padded), or packed.

Packing (--packing) is first-fit decreasing: conversations are taken longest first (ties in dataset order) and each
goes into the first sample, in the order the samples were opened, that still has room for it, or opens a new one;
inside a sample the conversations keep their dataset order. It is deterministic (the same lengths and --seq_len give
the same samples on every rank and every run), never splits a conversation, and uses at most 11/9 of the fewest
samples possible, plus one. A segment tree over the samples' free room finds the first that fits in O(log n).
The packed conversations are kept apart by the `docs` mechanism (sources.py, sp/kernels.py): positions restart
at each one, attention never crosses one, and a conversation's first token is never a target.

A conversation longer than `seq_len` is an error (--truncation error, the default: the message gives how many,
the longest and the flag), or is cut to `seq_len` tokens: `left` keeps its end, `right` its start. Never silently.
Padding (after the last conversation) is never trained.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError
from ..sp.sharding import IGNORE_INDEX


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs items of `lengths` (each <= capacity) into bins of `capacity`. Returns (order, starts): bin b holds
    the items order[starts[b]:starts[b + 1]], in index order."""
    n = len(lengths)
    size = 1 << max(0, int(n - 1).bit_length())  # leaves: one per possible bin
    room = [capacity] * (2 * size)  # a node holds the largest free room below it; unopened bins are empty
    bin_of = np.empty(n, dtype=np.int64)
    for item in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        need, node = int(lengths[item]), 1
        while node < size:  # leftmost leaf with room >= need
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        bin_of[item] = node - size
        room[node] -= need
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    order = np.lexsort((np.arange(n), bin_of))  # by bin, then by index
    counts = np.bincount(bin_of, minlength=int(bin_of.max()) + 1 if n else 0)
    return order, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def check_lengths(lengths: np.ndarray, seq_len: int, truncation: str, length_flag: str = "--seq_len") -> int:
    """How many conversations are longer than seq_len; an error unless --truncation says how to cut them."""
    long = int((lengths > seq_len).sum())
    if long and truncation == "error":
        raise ConfigError(f"{long} conversation(s) are longer than {length_flag} {seq_len} (the longest has "
                          f"{int(lengths.max())} tokens): raise {length_flag}, or cut them with --truncation left "
                          f"(keep each one's end) or --truncation right (keep its start)")
    return long


class ConversationSamples:
    """Samples of exactly `seq_len` tokens made of whole conversations of a TokenStore with a trained mask."""

    def __init__(self, store, seq_len: int, truncation: str, packing: bool, pad_id: int,
                 length_flag: str = "--seq_len"):
        self.store, self.seq_len, self.truncation, self.pad_id = store, seq_len, truncation, pad_id
        ends = np.append(store.doc_starts[1:], len(store.tokens))
        self.lengths = ends - store.doc_starts
        self.truncated = check_lengths(self.lengths, seq_len, truncation, length_flag)
        self.kept = np.minimum(self.lengths, seq_len)
        if packing:
            self.order, self.starts = first_fit_decreasing(self.kept, seq_len)
        else:
            self.order, self.starts = np.arange(len(self.kept)), np.arange(len(self.kept) + 1)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def conversations(self, i: int) -> list[int]:
        """Indices of the conversations in sample i."""
        return self.order[self.starts[i]:self.starts[i + 1]].tolist()

    def _piece(self, c: int) -> slice:
        start, length, kept = int(self.store.doc_starts[c]), int(self.lengths[c]), int(self.kept[c])
        return slice(start + length - kept, start + length) if self.truncation == "left" else \
            slice(start, start + kept)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int, list[int]]:
        """(seq_len,) token ids, (seq_len,) unshifted labels (-100 where not trained and on the padding), the number
        of real tokens, and the lengths of the conversations in it (the padding, if any, is one more piece)."""
        pieces = [self._piece(c) for c in self.conversations(i)]
        ids = np.concatenate([np.asarray(self.store.tokens[p], dtype=np.int64) for p in pieces])
        trained = np.concatenate([np.asarray(self.store.trained[p], dtype=bool) for p in pieces])
        valid = len(ids)
        out = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        out[:valid] = torch.from_numpy(ids)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        labels[:valid] = torch.from_numpy(np.where(trained, ids, IGNORE_INDEX))
        docs = [p.stop - p.start for p in pieces] + ([self.seq_len - valid] if valid < self.seq_len else [])
        return out, labels, valid, docs

    def describe(self) -> str:
        """One line for the log: conversations, samples, fill, what was cut and what trains nothing."""
        trained = self.trained_counts()
        text = (f"{len(self.lengths):,} conversations ({int(self.lengths.sum()):,} tokens) -> {len(self):,} samples "
                f"of {self.seq_len:,} ({int(self.kept.sum()) / max(1, len(self) * self.seq_len):.0%} filled, "
                f"{int(trained.sum()):,} tokens trained)")
        if self.truncated:
            text += f", {self.truncated:,} cut to {self.seq_len:,} (--truncation {self.truncation})"
        empty = int((trained == 0).sum())
        return text + (f", {empty:,} with no trained token" if empty else "")

    def target_counts(self) -> np.ndarray:
        """Targets of each conversation in the samples: its trained tokens but the first one kept, which is never a
        target (the label of position t is token t + 1, and no token of the sample before it is its context)."""
        counts = self.trained_counts()
        if len(counts):
            first = self.store.doc_starts + (self.lengths - self.kept if self.truncation == "left" else 0)
            counts -= np.asarray(self.store.trained)[first].astype(np.int64)
        return counts

    def sample_targets(self) -> np.ndarray:
        """Targets of each sample (the sum over its conversations)."""
        counts = self.target_counts()
        return np.add.reduceat(counts[self.order], self.starts[:-1]) if len(self) else np.zeros(0, np.int64)

    def trained_counts(self) -> np.ndarray:
        """Trained tokens of each conversation as it goes into the samples (after truncation)."""
        if len(self.lengths) == 0:
            return np.zeros(0, np.int64)
        counts = np.add.reduceat(np.asarray(self.store.trained), self.store.doc_starts, dtype=np.int64)
        for c in np.flatnonzero(self.kept < self.lengths):
            counts[c] = int(np.asarray(self.store.trained[self._piece(c)]).sum())
        return counts
