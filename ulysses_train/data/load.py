"""Loading a dataset, or a mixture of several (data/mixture.py), into a sample source: raw text through the token
store (corpus.py), conversations and other SFT formats through sft.py, for --dataset and --eval_dataset alike."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from ..errors import ConfigError
from .chat import template_source
from .corpus import corpus_samples, dataset_columns, load_corpus, load_tokenizer, unreadable_dataset_is_a_config_error
from .mixture import DatasetEntry, MixtureSource, dataset_entries, is_mixture
from .sft import detect_format, resolve_loss_on, sft_samples, untrained_warning
from .sources import ChatSource, CorpusSource


@dataclass(frozen=True)
class DataSettings:
    """What the data layer reads of a run's configuration (train/config/train_config.py): the data group, the groups
    that say which tokens of its rows are trained (sft; pref for preference pairs), and the two values it takes from
    elsewhere. `TrainConfig.data_settings()` makes it."""

    data: Any  # DataConfig
    sft: Any  # SFTConfig
    pref: Any  # PreferenceConfig
    model: Optional[str] = None  # --model: the tokenizer when --tokenizer is not given
    length_flag: str = "--seq_len"  # the flag an over-long sample names (--verify_seq_len under --verify)


def load_source(settings: DataSettings, spec, split: str, seq_len: int, vocab_size: int, rank: int,
                log: Callable[[str], None], flag: str = "dataset"):
    """(tokenizer, source) of `spec` (a dataset, or a mixture's entries), text or conversations, in samples of
    `seq_len`. Rank 0 tokenizes and caches first; the others then read the cache. Rank 0's outcome is broadcast, so a
    bad dataset stops every rank with its message instead of leaving them waiting (without a process group, as in
    `python -m ulysses_train.preview`, this process is rank 0 of 1). `settings`: what the run's configuration
    says of its data; `flag` is the one that named the data (`dataset` or `eval_dataset`), for the log and the
    error messages."""
    loader = _Loader(settings, dataset_entries(spec, flag), split, seq_len, vocab_size, log, flag)
    result = loader.load() if rank == 0 else None
    error = [result if isinstance(result, str) else None]  # only rank 0's error message crosses ranks
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise ConfigError(error[0])
    if rank != 0:
        result = loader.load()  # reads what rank 0 cached
    if isinstance(result, str):
        raise ConfigError(result)
    return result


class _Loader:
    def __init__(self, settings: DataSettings, entries: list[DatasetEntry], split: str, seq_len: int,
                 vocab_size: int, log: Callable[[str], None], flag: str):
        self.settings, self.entries, self.split = settings, entries, split
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.flag = flag
        self.log = log if flag == "dataset" else (lambda m: log(m.replace("data:", "eval data:", 1)))

    def _named(self, message: str) -> str:
        """The data layer's messages name --dataset (and --dataset_split); for --eval_dataset they name its flags."""
        if self.flag == "dataset":
            return message
        return re.sub(r"--dataset\b", "--eval_dataset", message).replace("--dataset_split", "--eval_split")

    def load(self):
        """(tokenizer, source), or the message of the ConfigError that stops the run."""
        try:
            tokenizer = load_tokenizer(self.settings.data.tokenizer, self.settings.model)
            if len(tokenizer) > self.vocab_size:
                raise ConfigError(f"the tokenizer has {len(tokenizer)} ids but the model's vocabulary is "
                                  f"{self.vocab_size}: use a matching --tokenizer or --model_config")
            method = self.settings.pref.method
            if method != "sft" and is_mixture(self.entries):
                raise ConfigError(f"--method {method} trains on one preference dataset: give --dataset one "
                                  f"path (mixtures are for SFT)")
            sources = [self._source(tokenizer, entry) for entry in self.entries]
            if not is_mixture(self.entries):
                return tokenizer, sources[0]
            counts = [entry.count(source.num_samples) for entry, source in zip(self.entries, sources)]
            mixture = MixtureSource(sources, counts, self.settings.data.seed)
            self.log(f"data: a mixture of {len(sources)}, {mixture.num_samples:,} samples a pass: " + "; ".join(
                entry.describe(source.num_samples) for entry, source in zip(self.entries, sources)))
            return tokenizer, mixture
        except ConfigError as e:
            return self._named(str(e))

    def _source(self, tokenizer, entry: DatasetEntry):
        data, dataset = self.settings.data, entry.path
        with unreadable_dataset_is_a_config_error(dataset):
            corpus = load_corpus(dataset, entry.split or self.split, data.streaming)
            if self.settings.pref.method != "sft":  # preference pairs: data/preference.py
                from .preference import preference_source

                return preference_source(self.settings, corpus, tokenizer, dataset, entry.split or self.split,
                                         self.seq_len, self.log)
            fmt = detect_format(dataset_columns(corpus), entry.data_format or data.data_format,
                                entry.text_column or data.text_column, entry.messages_field or data.messages_field)
        if fmt == "text":
            return self._text_source(tokenizer, corpus, entry)
        return self._conversation_source(tokenizer, corpus, fmt, entry)

    def _text_source(self, tokenizer, corpus, entry: DatasetEntry) -> CorpusSource:
        data, sft, split = self.settings.data, self.settings.sft, entry.split or self.split
        if not is_mixture(self.entries):  # in a mixture, these flags are for the conversation datasets
            resolve_loss_on("text", sft.loss_on, [])  # text trains every token
            if sft.chat_template:
                raise ConfigError(f"--chat_template applies to messages and prompt/completion data; {entry.path} is "
                                  f"text")
        samples, store = corpus_samples(entry.path, split, entry.text_column or data.text_column, tokenizer,
                                        self.seq_len, data.data_cache_dir, data.streaming, data.num_proc,
                                        data.max_tokens, data.last_sample == "pad", corpus=corpus)
        self.log(f"data:{self._which(entry)} {len(store.tokens):,} tokens in {len(store.doc_starts):,} documents -> "
                 f"{len(samples):,} samples of {self.seq_len:,} (cache {'hit' if store.cache_hit else 'written'}, "
                 f"packing {data.packing})")
        return CorpusSource(samples, data.packing)

    def _conversation_source(self, tokenizer, corpus, fmt: str, entry: DatasetEntry) -> ChatSource:
        data, sft = self.settings.data, self.settings.sft
        samples, store, settings = sft_samples(
            corpus, fmt, tokenizer, self.seq_len, dataset=entry.path, split=entry.split or self.split,
            cache_dir=data.data_cache_dir, chat_template=sft.chat_template, loss_on=sft.loss_on,
            truncation=sft.truncation, packing=data.packing, num_proc=data.num_proc, max_tokens=data.max_tokens,
            length_flag=self.settings.length_flag, vocab_size=self.vocab_size,
            messages_field=entry.messages_field or data.messages_field,
            role_map=entry.role_map if entry.role_map is not None else data.role_map)
        template = f", {template_source(sft.chat_template)}" if settings["chat_template"] else ""
        column = settings["messages_column"]
        layout = f" (from `{column}`)" if column not in (None, "messages") else ""
        self.log(f"data:{self._which(entry)} {fmt}{layout}, loss on {settings['loss_on']}{template}: "
                 f"{samples.describe()} (cache {'hit' if store.cache_hit else 'written'}, packing {data.packing})")
        warning = untrained_warning(samples, entry.path)
        if warning:
            self.log(f"warning: {self._named(warning)}")
        return ChatSource(samples)

    def _which(self, entry: DatasetEntry) -> str:
        """In a mixture's log, which dataset a line is about."""
        return f" {entry.path}:" if is_mixture(self.entries) else ""
