"""The embedded default data: generated token sequences that a tiny model learns in seconds, no download needed.

Each sequence is made of blocks of 4 tokens: the first token of a block is uniform over the vocabulary, each of the
next three is a fixed random permutation of the token before it. A model that has learnt the permutation predicts
3 tokens in 4 exactly, so the loss falls from ln(V) towards ln(V)/4. Sample i depends only on (seed, i), so the same
seed gives the same data whatever sp_size, dp_size or world size is.
"""

from __future__ import annotations

from typing import Optional

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


def build_batch(rows: list[tuple[torch.Tensor, int, Optional[list[int]]]], packing: bool) -> dict:
    """Whole sequences -> input_ids, labels (unshifted; -100 where nothing may be predicted), position_ids and, when
    packing, each row's document lengths. Padding after `valid` is never a target. With packing, positions restart
    at each document and a document's first token is not a target (its context would be the previous document)."""
    input_ids = torch.stack([ids for ids, _, _ in rows])
    labels = input_ids.clone()
    positions = torch.arange(input_ids.shape[1]).repeat(len(rows), 1)
    docs = [] if packing else None
    for r, (_, valid, lengths) in enumerate(rows):
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
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "docs": docs}


def trainable_tokens(batch: dict) -> int:
    """Labels that are targets once shifted (position t predicts token t + 1): what the loss averages over."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


class SyntheticSource:
    num_samples = None

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.data = SyntheticTokens(vocab_size, seq_len, seed)

    def get(self, index: int):
        ids = self.data.sample(index)
        return ids, len(ids), None


class CorpusSource:
    def __init__(self, samples, packing: bool):
        self.samples, self.packing = samples, packing
        self.num_samples = len(samples)

    def get(self, index: int):
        ids, valid = self.samples.sample(index)
        return ids, valid, self.samples.document_lengths(index, valid) if self.packing else None
