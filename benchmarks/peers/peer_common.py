"""What the TRL peer scripts share: the per-step timer they report, and the random token rows with the tokenizer
that carries them (the peers train on the same generated tokens as our benchmarks; the text does not matter)."""
import time

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, TrainerCallback


class StepTimer(TrainerCallback):
    """Each optimizer step's seconds (CUDA synchronised at both ends) in `times`; prints a line per step with the
    peak GPU memory when `speak` (rank 0 only, under several ranks)."""

    def __init__(self, speak: bool = True):
        self.times, self.speak = [], speak

    def on_step_begin(self, *a, **k):
        torch.cuda.synchronize()
        self.t = time.perf_counter()

    def on_step_end(self, *a, **k):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t)
        if self.speak:
            print(f"step {len(self.times)}: {self.times[-1]:.2f} s, peak "
                  f"{torch.cuda.max_memory_allocated()/2**30:.1f} GiB", flush=True)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A three-token tokenizer: TRL wants one for padding and EOS; the rows are ids already."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>")),
        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def random_rows(vocab_size: int, seq_len: int, count: int) -> Dataset:
    """`count` rows of `seq_len` random ids in [3, vocab_size), seeded: the same rows in every run."""
    g = torch.Generator().manual_seed(0)
    return Dataset.from_dict({"input_ids": [torch.randint(3, vocab_size, (seq_len,), generator=g).tolist()
                                            for _ in range(count)]})
