"""The embedded default data: generated token sequences that a tiny model learns in seconds, no download needed.

Each sequence is made of blocks of 4 tokens: the first token of a block is uniform over the vocabulary, each of the
next three is a fixed random permutation of the token before it. A model that has learnt the permutation predicts
3 tokens in 4 exactly, so the loss falls from ln(V) towards ln(V)/4. Sample i depends only on (seed, i), so the same
seed gives the same data whatever sp_size, dp_size or world size is.
"""

from __future__ import annotations

import torch

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


def micro_batch(data: SyntheticTokens, step: int, micro_step: int, grad_accum: int, dp_rank: int, dp_size: int,
                micro_batch_size: int) -> torch.Tensor:
    rows = [data.sample(global_sample_index(step, micro_step, grad_accum, dp_rank, dp_size, micro_batch_size, r))
            for r in range(micro_batch_size)]
    return torch.stack(rows)  # (micro_batch_size, seq_len)
