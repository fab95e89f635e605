"""The embedded default data: generated token sequences that a tiny model learns in seconds, no download needed.

Each sequence is made of blocks of 4 tokens: the first token of a block is uniform over the vocabulary, each of the
next three is a fixed random permutation of the token before it. A model that has learnt the permutation predicts
3 tokens in 4 exactly, so the loss falls from ln(V) towards ln(V)/4. Sample i depends only on (seed, i), so the same
seed gives the same data whatever sp_size, dp_size or world size is.

Every source (SyntheticSource, CorpusSource for text, ChatSource for conversations) has `num_samples` (None: no
end) and `get(index) -> Row`; `build_batch` turns the rows of a micro-step into the batch the loop shards.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Optional

import torch

from ..sp.sharding import IGNORE_INDEX

FIRST_ID = 3  # ids 0..2 are left for pad/eos/unk, as in the byte tokenizer
BLOCK = 4


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        if vocab_size <= FIRST_ID + 1:
            raise ValueError(f"vocab_size {vocab_size} too small for generated data")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        g = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab_size - FIRST_ID, generator=g) + FIRST_ID

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        n_blocks = -(-self.seq_len // BLOCK)
        blocks = torch.empty(n_blocks, BLOCK, dtype=torch.long)
        blocks[:, 0] = torch.randint(FIRST_ID, self.vocab_size, (n_blocks,), generator=g)
        for j in range(1, BLOCK):
            blocks[:, j] = self.successor[blocks[:, j - 1] - FIRST_ID]
        return blocks.flatten()[: self.seq_len]


def global_sample_index(step: int, micro_step: int, grad_accum: int, dp_rank: int, dp_size: int,
                        micro_batch: int, row: int) -> int:
    """Which sample a (step, micro-step, DP rank, row) trains on: every SP group gets its own samples, and the
    global batch of a step is the same set whatever the DP/SP split."""
    return (((step * grad_accum + micro_step) * dp_size + dp_rank) * micro_batch) + row


# ---------------------------------------------------------------- batches from any source

def sample_order(global_index: int, num_samples: Optional[int], seed: int) -> int:
    """Which stored sample the global index trains on: a fresh permutation per epoch, fixed by the seed."""
    if num_samples is None:
        return global_index
    epoch, offset = divmod(global_index, num_samples)
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    return int(torch.randperm(num_samples, generator=g)[offset])


class Row(NamedTuple):
    """What a source gives for one sample: `ids` (seq_len,), the number of `valid` (unpadded) tokens, the lengths
    of the documents or conversations in it (`docs`, the padding one more piece; None: one sequence) and, for
    sources that decide what is trained, unshifted `labels` (seq_len,) with -100 where a token is not a target
    (None: every real token is one). Sources may still return a plain (ids, valid, docs) tuple."""

    ids: torch.Tensor
    valid: int
    docs: Optional[list[int]] = None
    labels: Optional[torch.Tensor] = None


def build_batch(rows: list, packing: bool) -> dict:
    """Whole sequences -> input_ids, labels (unshifted; -100 where nothing may be predicted), position_ids, when
    packing each row's document lengths, and `conversations` (documents or conversations with a token in the batch;
    a row without `docs` counts one). A row's own labels are kept, else its tokens are the labels. Padding after
    `valid` is never a target. With packing, positions restart at each document and a document's first token is not
    a target (its context would be the previous document)."""
    rows = [Row(*row) for row in rows]
    input_ids = torch.stack([row.ids for row in rows])
    labels = torch.stack([row.ids if row.labels is None else row.labels for row in rows]).clone()
    positions = torch.arange(input_ids.shape[1]).repeat(len(rows), 1)
    docs = [] if packing else None
    for r, (_, valid, lengths, _) in enumerate(rows):
        labels[r, valid:] = IGNORE_INDEX
        if packing:
            lengths = lengths or [input_ids.shape[1]]
            docs.append(lengths)
            start = 0
            for n in lengths:
                positions[r, start:start + n] = torch.arange(n)
                if start > 0:
                    labels[r, start] = IGNORE_INDEX
                start += n
    conversations = sum(_pieces(row) for row in rows)
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "docs": docs,
            "conversations": conversations}


def _pieces(row: Row) -> int:
    """Documents (or conversations) with at least one real token in the row."""
    if not row.docs:
        return 1
    starts = itertools.accumulate(row.docs, initial=0)
    return sum(1 for start, n in zip(starts, row.docs) if n > 0 and start < row.valid)


def trainable_tokens(batch: dict) -> int:
    """Labels that are targets once shifted (position t predicts token t + 1): what the loss averages over."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


class SyntheticSource:
    num_samples = None

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.data = SyntheticTokens(vocab_size, seq_len, seed)

    def get(self, index: int) -> Row:
        ids = self.data.sample(index)
        return Row(ids, len(ids))


class CorpusSource:
    """Samples cut from a text corpus; their documents are counted for the metrics and, with packing, kept apart."""

    def __init__(self, samples, packing: bool):
        self.samples, self.packing = samples, packing
        self.num_samples = len(samples)

    def get(self, index: int) -> Row:
        ids, valid = self.samples.sample(index)
        return Row(ids, valid, self.samples.document_lengths(index, valid))


class ChatSource:
    """Conversations (data/packing.py's ConversationSamples): labels only where the model writes (data/sft.py),
    one conversation per sample or packed."""

    def __init__(self, samples):
        self.samples = samples
        self.num_samples = len(samples)

    def get(self, index: int) -> Row:
        ids, labels, valid, docs = self.samples.sample(index)
        return Row(ids, valid, docs, labels)
