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

Every row is held to the first row's format (strings, or message lists). A row that cannot be a pair is a
ConfigError naming the row, the field and the cause (`--dataset pairs.jsonl row 3, `rejected[0].content` is null:
...`): a null or mistyped value, a message without a string role or content, an empty completion or prompt (the
completion's first token would have no context), two renderings that do not share the prompt's tokens. A pair whose
chosen and rejected sides are the same (as given, or once tokenized) has nothing to learn from: it is stored as two
stand-ins that score nothing, and data/pair_packing.py drops it with a count, or refuses a dataset of only such
pairs. --max_length, --max_prompt_length and --truncation are applied when pairs are cut from the store
(data/pair_packing.py), so they are not in the store's key.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ConfigError
from .chat import completion_mask, encode, load_chat_template
from .corpus import dataset_columns, unreadable_dataset_is_a_config_error
from .token_store import build_token_store, cache_settings, store_key

PREFERENCE_FORMAT = 2  # bump when encoding or checking rules change what is stored


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


IDENTICAL = ([0], [0])  # the store's stand-in for each side of a pair whose two sides are the same: nothing scored


class RowError(ConfigError):
    """A row that cannot be a pair: the field (`rejected[0].content`) and the cause; the encoder adds the row."""

    def __init__(self, field: str, cause: str):
        super().__init__(f"`{field}` {cause}")


def _kind(value) -> str:
    """How an error names a value's type."""
    if isinstance(value, list):
        return "a message list"
    return "null" if value is None else f"{'an' if type(value).__name__[0] in 'aeiou' else 'a'} " \
        f"{type(value).__name__} ({repr(value)[:40]})"


def _message_list(value, field: str) -> list:
    """A conversational column's value, checked message by message; None values dropped (Arrow fills absent keys
    with None)."""
    if not isinstance(value, list):
        raise RowError(field, f"is {_kind(value)}, but the first row's `chosen` is a message list: every value must "
                              f"be a message list (TRL's conversational format), or every one a string")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RowError(f"{field}[{i}]", f"is {_kind(message)}: a message is a {{role, content}} object")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise RowError(f"{field}[{i}].{key}", f"is {_kind(message.get(key))}: every message needs a string "
                                                      f"`{key}`")
    return [{k: v for k, v in m.items() if v is not None} for m in value]


class PairEncoder:
    """The `datasets.map` function (batched): each row -> two rows of the store, prompt + chosen then prompt +
    rejected, with `trained` 1 on the completion's tokens; a pair whose two sides are the same is stored as two
    IDENTICAL stand-ins (data/pair_packing.py counts and drops them). Every row must be in the format of the first
    (`conversational`: message lists, else strings). Picklable, for --num_proc."""

    def __init__(self, tokenizer, template: Optional[str], explicit_prompt: bool, dataset: Optional[str] = None,
                 conversational: Optional[bool] = None):
        self.tokenizer, self.template, self.explicit_prompt, self.dataset = (tokenizer, template, explicit_prompt,
                                                                             dataset)
        self.conversational = template is not None if conversational is None else conversational

    def check_values(self, row: dict, index: int) -> None:
        """The row's values against the format, before the template is loaded (the first row: a row of mixed
        formats is named as such, not as a missing chat template)."""
        try:
            for field in ("prompt", "chosen", "rejected") if self.explicit_prompt else ("chosen", "rejected"):
                self._checked(row, field)
        except ConfigError as e:
            raise ConfigError(f"{self.where(index)}: {e}") from None

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        from jinja2 import TemplateError

        from .chat import TemplateFailure

        out = {"input_ids": [], "trained": []}
        for j, index in enumerate(indices):
            try:
                docs = self.encode_pair({k: v[j] for k, v in batch.items()})
            except ConfigError as e:
                raise ConfigError(f"{self.where(index)}: {e}") from None
            except (TemplateError, TemplateFailure) as e:
                raise ConfigError(f"{self.where(index)}: the chat template (--chat_template) fails on it: "
                                  f"{type(e).__name__}: {e}") from None
            for ids, trained in docs:
                out["input_ids"].append(np.asarray(ids, dtype=np.int64))
                out["trained"].append(np.asarray(trained, dtype=np.int8))
        return out

    def where(self, index: int) -> str:
        return f"--dataset {self.dataset} row {index}" if self.dataset else f"row {index}"

    def _checked(self, row: dict, field: str):
        value = row[field]
        if value is None:
            raise RowError(field, "is null: every row of a dataset with a `prompt` column needs one" if field ==
                           "prompt" else "is null: a pair needs a `chosen` and a `rejected` completion")
        if self.conversational:
            return _message_list(value, field)
        if not isinstance(value, str):
            raise RowError(field, f"is {_kind(value)}, but the first row's `chosen` is a string: every value must be "
                                  f"a string (TRL's standard format), or every one a message list")
        return value

    def encode_pair(self, row: dict) -> list[tuple[list, list]]:
        """[(ids, trained) of prompt + chosen, the same of prompt + rejected], or two IDENTICAL stand-ins."""
        fields = ("prompt", "chosen", "rejected") if self.explicit_prompt else ("chosen", "rejected")
        values = [self._checked(row, field) for field in fields]
        if values[-2] == values[-1]:
            return [IDENTICAL, IDENTICAL]
        prompt, chosen, rejected = values if self.explicit_prompt else implicit_prompt(*values)
        docs = self._messages(prompt, chosen, rejected) if self.conversational else \
            self._strings(prompt, chosen, rejected)
        if docs[0] == docs[1]:  # different text, the same tokens
            return [IDENTICAL, IDENTICAL]
        for (ids, trained), side in zip(docs, ("chosen", "rejected")):
            if not any(trained):
                raise RowError(side, "has an empty completion: it has no token to score")
            if trained[0]:
                raise RowError("prompt", "is empty: the completions' first tokens would have no context to be "
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
        for completion, side in ((chosen, "chosen"), (rejected, "rejected")):
            if not completion:
                raise RowError(side, "has an empty completion (no message after the prompt): it has no token to "
                                     "score")
        if not prompt:
            raise RowError("prompt", "is empty: the completions' first tokens would have no context to be scored "
                                     "from; give each pair a prompt")
        docs = [completion_mask(self.tokenizer, self.template, prompt, c) for c in (chosen, rejected)]
        starts = [trained.index(1) if 1 in trained else len(ids) for ids, trained in docs]
        if docs[0][0][:starts[0]] != docs[1][0][:starts[1]]:
            raise RowError("prompt", "renders to different tokens before the chosen and the rejected completion "
                                     "(--chat_template): their prompts must be the same")
        return docs


def is_conversational(corpus) -> bool:
    """Whether the pairs are message lists (they need the chat template) or strings: the first row's `chosen`
    decides, and the encoder holds every other row to it."""
    first = next(iter(corpus), None)
    return first is not None and isinstance(first.get("chosen"), list)


def preference_store(corpus, tokenizer, *, method: str, dataset: str, split: str, cache_dir: str,
                     chat_template: Optional[str] = None, num_proc: Optional[int] = None,
                     max_tokens: Optional[int] = None):
    """Rows of a loaded dataset -> the cached store of pairs (documents 2i and 2i + 1 are row i's chosen and
    rejected sides). Returns the store and the settings that keyed it."""
    with unreadable_dataset_is_a_config_error(dataset):
        columns = dataset_columns(corpus)
        explicit = preference_columns(columns, method, dataset)
        conversational = is_conversational(corpus)
        first = next(iter(corpus), None)
        if first is not None:
            PairEncoder(tokenizer, None, explicit, dataset, conversational).check_values(first, 0)
        template = load_chat_template(chat_template, tokenizer) if conversational else None
        kwargs = {"batched": True, "with_indices": True, "remove_columns": columns}
        if not getattr(corpus, "_ex_iterable", None):  # map-style: multiprocess, progress bar, disk cache
            kwargs.update(num_proc=num_proc, desc="encoding preference pairs")
        tokenized = corpus.map(PairEncoder(tokenizer, template, explicit, dataset, conversational), **kwargs)
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
    then --max_length (default half a row), --max_prompt_length, --truncation and --packing (several pairs per row)
    applied as the pairs are cut into rows."""
    from .pair_packing import PreferenceSamples, PreferenceSource

    data, sft, pref, length_flag = settings.data, settings.sft, settings.pref, settings.length_flag
    store, settings = preference_store(corpus, tokenizer, method=pref.method, dataset=dataset, split=split,
                                       cache_dir=data.data_cache_dir, chat_template=sft.chat_template,
                                       num_proc=data.num_proc, max_tokens=data.max_tokens)
    samples = PreferenceSamples(store, row_len, pref.max_length or row_len // 2, sft.truncation, data.packing,
                                tokenizer.pad_token_id or 0, length_flag, pref.max_prompt_length, dataset)
    template = " (chat template)" if settings["chat_template"] else ""
    log(f"data: preference pairs{template}, {'explicit' if settings['explicit_prompt'] else 'implicit'} prompt: "
        f"{samples.describe()} (cache {'hit' if store.cache_hit else 'written'}, packing {data.packing})")
    return PreferenceSource(samples)
