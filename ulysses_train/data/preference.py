"""Preference data (DPO, SimPO, ORPO): prompt / chosen / rejected rows -> two documents per pair in the token store.

Formats (TRL's preference formats, detected from the columns; --method dpo|simpo|orpo reads nothing else):

    explicit prompt    `prompt`, `chosen`, `rejected`: three strings, or three message lists (conversational)
    implicit prompt    `chosen` and `rejected` only: the prompt is their longest common prefix (of characters for
                       strings, without a space it ends on; of whole messages for message lists), as TRL's
                       `extract_prompt` takes it

Each pair is stored as two documents, prompt + chosen and prompt + rejected: the prompt is repeated in both (the
attention keeps documents apart, so chosen and rejected never see each other; sharing one copy of the prompt would
need a mask in which both completions attend to one prompt, which the packed-document kernels do not express).
What is scored is the completion, as SFT's `--loss_on completion` trains it (data/sft.py):

- strings: prompt and completion tokenized one after the other (no special tokens added), EOS after the completion;
- message lists: rendered with the chat template as one conversation, the completion being what it adds to the
  prompt rendered with the generation prompt (data/chat.py: `completion_mask`; the separator after the end-of-turn
  token is not scored, as in SFT; TRL scores it too).

A row whose completion is empty, whose prompt is empty (the completion's first token would have no context), whose
two renderings do not share the prompt's tokens, or whose columns mix strings and message lists is a ConfigError
naming the row. --max_length and --truncation are applied when pairs are cut from the store (data/pair_packing.py),
so they are not in the store's key.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ConfigError
from .chat import completion_mask, encode, load_chat_template
from .corpus import dataset_columns, unreadable_dataset_is_a_config_error
from .token_store import build_token_store, cache_settings, store_key

PREFERENCE_FORMAT = 1  # bump when encoding or checking rules change what is stored


def preference_columns(columns: list[str], method: str, dataset: str) -> bool:
    """Whether the pairs carry an explicit `prompt`; a ConfigError naming --method when `chosen` or `rejected` is
    missing."""
    missing = [c for c in ("chosen", "rejected") if c not in columns]
    if missing:
        raise ConfigError(f"--method {method} trains on preference pairs: --dataset {dataset} needs the columns "
                          f"`chosen` and `rejected` (and `prompt`, or a prompt they share as a prefix); it has "
                          f"{columns}, missing {missing}")
    return "prompt" in columns


def implicit_prompt(chosen, rejected) -> tuple:
    """(prompt, chosen, rejected) from a pair whose prompt is their longest common prefix: of characters for strings
    (a space it would end on goes to the completions), of whole messages for message lists. TRL's `extract_prompt`
    splits the same way wherever the two differ."""
    n = min(len(chosen), len(rejected))
    split = next((i for i in range(n) if chosen[i] != rejected[i]), n)
    if isinstance(chosen, str) and split > 0 and chosen[split - 1] == " ":
        split -= 1
    return chosen[:split], chosen[split:], rejected[split:]


def _message_list(value, what: str) -> list:
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) and "role" in m for m in value):
        raise ConfigError(f"the {what} must be a non-empty list of {{role, content}} objects (or every column a "
                          f"string), got {str(value)[:80]!r}")
    return [{k: v for k, v in m.items() if v is not None} for m in value]  # Arrow fills absent keys with None


class PairEncoder:
    """The `datasets.map` function (batched): each row -> two rows of the store, prompt + chosen then prompt +
    rejected, with `trained` 1 on the completion's tokens. Picklable, for --num_proc."""

    def __init__(self, tokenizer, template: Optional[str], explicit_prompt: bool, dataset: Optional[str] = None):
        self.tokenizer, self.template, self.explicit_prompt, self.dataset = tokenizer, template, explicit_prompt, dataset

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        from jinja2 import TemplateError

        out = {"input_ids": [], "trained": []}
        for j, index in enumerate(indices):
            try:
                docs = self.encode_pair({k: v[j] for k, v in batch.items()})
            except ConfigError as e:
                raise ConfigError(f"{self._where(index)}: {e}") from None
            except TemplateError as e:
                raise ConfigError(f"{self._where(index)}: the chat template (--chat_template) fails on it: "
                                  f"{type(e).__name__}: {e}") from None
            for ids, trained in docs:
                out["input_ids"].append(np.asarray(ids, dtype=np.int64))
                out["trained"].append(np.asarray(trained, dtype=np.int8))
        return out

    def _where(self, index: int) -> str:
        return f"pair {index} (row {index} of --dataset" + (f" {self.dataset})" if self.dataset else ")")

    def encode_pair(self, row: dict) -> list[tuple[list, list]]:
        """[(ids, trained) of prompt + chosen, the same of prompt + rejected]."""
        chosen, rejected = row["chosen"], row["rejected"]
        if chosen is None or rejected is None:
            raise ConfigError("`chosen` or `rejected` is empty (null)")
        prompt, chosen, rejected = (row["prompt"], chosen, rejected) if self.explicit_prompt else \
            implicit_prompt(chosen, rejected)
        if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
            docs = self._strings(prompt, chosen, rejected)
        elif any(isinstance(v, str) for v in (prompt, chosen, rejected)) or prompt is None:
            raise ConfigError("`prompt`, `chosen` and `rejected` must be all strings or all message lists "
                              "(TRL's standard and conversational formats)")
        else:
            docs = self._messages(prompt, chosen, rejected)
        for (ids, trained), side in zip(docs, ("chosen", "rejected")):
            if not any(trained):
                raise ConfigError(f"the {side} completion is empty: it has no token to score")
            if trained[0]:
                raise ConfigError("the prompt is empty: the completions' first tokens would have no context to be "
                                  "scored from; give each pair a prompt")
        return docs

    def _strings(self, prompt: str, chosen: str, rejected: str) -> list[tuple[list, list]]:
        head, eos = encode(self.tokenizer, prompt), self.tokenizer.eos_token_id
        docs = []
        for completion in (chosen, rejected):
            tail = encode(self.tokenizer, completion)
            tail += [eos] if tail and eos is not None and tail[-1] != eos else []  # the model learns to stop
            docs.append((head + tail, [0] * len(head) + [1] * len(tail)))
        return docs

    def _messages(self, prompt, chosen, rejected) -> list[tuple[list, list]]:
        prompt = _message_list(prompt, "prompt")
        docs = [completion_mask(self.tokenizer, self.template, prompt, _message_list(c, side))
                for c, side in ((chosen, "chosen completion"), (rejected, "rejected completion"))]
        starts = [trained.index(1) if 1 in trained else len(ids) for ids, trained in docs]
        if docs[0][0][:starts[0]] != docs[1][0][:starts[1]]:
            raise ConfigError("the prompt renders to different tokens before the chosen and the rejected completion "
                              "(--chat_template): their prompts must be the same")
        return docs


def uses_template(corpus) -> bool:
    """Message lists need the chat template, strings do not (the first row decides: the encoder checks every row)."""
    features = getattr(corpus, "features", None)
    if features and "chosen" in features:
        return getattr(features["chosen"], "dtype", None) not in ("string", "large_string")
    first = next(iter(corpus), None)
    return first is not None and not isinstance(first.get("chosen"), str)


def preference_store(corpus, tokenizer, *, method: str, dataset: str, split: str, cache_dir: str,
                     chat_template: Optional[str] = None, num_proc: Optional[int] = None,
                     max_tokens: Optional[int] = None):
    """Rows of a loaded dataset -> the cached store of pairs (documents 2i and 2i + 1 are pair i's chosen and
    rejected sides). Returns the store and the settings that keyed it."""
    with unreadable_dataset_is_a_config_error(dataset):
        columns = dataset_columns(corpus)
        explicit = preference_columns(columns, method, dataset)
        template = load_chat_template(chat_template, tokenizer) if uses_template(corpus) else None
        kwargs = {"batched": True, "with_indices": True, "remove_columns": columns}
        if not getattr(corpus, "_ex_iterable", None):  # map-style: multiprocess, progress bar, disk cache
            kwargs.update(num_proc=num_proc, desc="encoding preference pairs")
        tokenized = corpus.map(PairEncoder(tokenizer, template, explicit, dataset), **kwargs)
        fingerprint = getattr(tokenized, "_fingerprint", None) or f"{dataset}:{split}:stream"
        extra = {"preference_format": PREFERENCE_FORMAT, "explicit_prompt": explicit, "chat_template": template}
        settings = cache_settings(fingerprint, tokenizer, dataset, split, "preference", max_tokens, extra)
        store = build_token_store(tokenized, None, cache_dir, store_key(settings), max_tokens, settings,
                                  trained=True)
    if len(store.doc_starts) < 2:
        raise ConfigError(f"--dataset {dataset}: no preference pair (empty dataset?)")
    return store, settings


def preference_source(settings, corpus, tokenizer, dataset: str, split: str, row_len: int, log):
    """The rows of pairs of a loaded dataset for the trainer (data/load.py; `settings` a DataSettings): the store,
    then --max_length (default half a row), --truncation and --packing (several pairs per row) applied as the pairs
    are cut into rows."""
    from .pair_packing import PreferenceSamples, PreferenceSource

    data, sft, pref, length_flag = settings.data, settings.sft, settings.pref, settings.length_flag
    store, settings = preference_store(corpus, tokenizer, method=pref.method, dataset=dataset, split=split,
                                       cache_dir=data.data_cache_dir, chat_template=sft.chat_template,
                                       num_proc=data.num_proc, max_tokens=data.max_tokens)
    samples = PreferenceSamples(store, row_len, pref.max_length or row_len // 2, sft.truncation, data.packing,
                                tokenizer.pad_token_id or 0, length_flag)
    template = " (chat template)" if settings["chat_template"] else ""
    log(f"data: preference pairs{template}, {'explicit' if settings['explicit_prompt'] else 'implicit'} prompt: "
        f"{samples.describe()} (cache {'hit' if store.cache_hit else 'written'}, packing {data.packing})")
    return PreferenceSource(samples)
