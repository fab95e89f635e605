"""Conversation and instruction data (SFT): formats, what is trained in each, and the pipeline to samples.

Formats (--data_format, detected from the columns by default, in this order):

    messages           a list of {role, content}, rendered with the chat template (data/chat.py)
    prompt_completion  `prompt` and `completion`: two strings (tokenized one after the other, EOS after the
                       completion), or two message lists (rendered with the template as one conversation)
    tokens             pre-tokenized `input_ids`, with optional `labels` (unshifted, -100 where not trained) or
                       `assistant_masks` (1 = trained)
    text               raw text, the corpus path of data/corpus.py (documents joined, cut into samples)

What is trained (--loss_on): `assistant` (every assistant turn, the default for messages), `completion` (what the
completion adds to the prompt, the default for prompt/completion), `all` (every token; text's only choice). Data
already tokenized keeps its own `labels` or `assistant_masks` (all tokens without either), unless --loss_on all.

Each conversation is rendered and tokenized once (`datasets.map`, --num_proc) into the token store
(token_store.py) with its trained mask; the key adds the format, the template's text and --loss_on to the text
corpus's. --seq_len and --truncation are applied when samples are cut from the store (data/packing.py), so they are
not in the key: one store serves every length and truncation.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ConfigError
from .chat import assistant_mask, completion_mask, encode, load_chat_template, rendered_ids
from .corpus import dataset_columns, unreadable_dataset_is_a_config_error
from .packing import ConversationSamples
from .token_store import build_token_store, cache_settings, store_key

DATA_FORMATS = ("auto", "messages", "prompt_completion", "tokens", "text")
LOSS_ON = ("auto", "assistant", "completion", "all")
TRUNCATION = ("error", "left", "right")
SFT_FORMAT = 1  # bump when rendering or masking rules change what is stored
_NEEDS = {"messages": ["messages"], "prompt_completion": ["prompt", "completion"], "tokens": ["input_ids"]}
_LOSS_ON = {"messages": ("assistant", "all"), "prompt_completion": ("completion", "assistant", "all"),
            "text": ("all",)}


def detect_format(columns: list[str], requested: str, text_column: Optional[str]) -> str:
    """The data format of a dataset with these columns; a forced format must find its columns."""
    if requested == "text" or (requested == "auto" and text_column):
        return "text"
    if requested != "auto":
        missing = [c for c in _NEEDS[requested] if c not in columns]
        if missing:
            raise ConfigError(f"--data_format {requested} needs the column(s) {missing}; the dataset has {columns}")
        return requested
    for fmt, needs in _NEEDS.items():
        if all(c in columns for c in needs):
            return fmt
    if "text" in columns:
        return "text"
    raise ConfigError(f"no 'text' column in the dataset (columns: {columns}), nor the columns of another format "
                      f"(conversations: `messages`; instructions: `prompt` and `completion`; tokens: `input_ids`): "
                      f"name the text column with --text_column, or the format with --data_format")


def resolve_loss_on(fmt: str, requested: str, columns: list[str]) -> str:
    """What is trained, for this format: --loss_on or the format's default. For tokens: `labels`,
    `assistant_masks` (the column that says so) or `all`."""
    if fmt == "tokens":
        given = next((c for c in ("labels", "assistant_masks") if c in columns), None)
        if requested == "all" or (requested == "auto" and given is None):
            return "all"
        if given is None:
            raise ConfigError(f"--loss_on {requested}: pre-tokenized data says what to train with a `labels` or "
                              f"`assistant_masks` column, and this dataset has neither ({columns}); use --loss_on all")
        return given
    if requested == "auto":
        return _LOSS_ON[fmt][0]
    if requested not in _LOSS_ON[fmt]:
        raise ConfigError(f"--loss_on {requested} does not apply to {fmt} data: use one of "
                          f"{', '.join(_LOSS_ON[fmt])} (or auto: {_LOSS_ON[fmt][0]})")
    return requested


# ---------------------------------------------------------------- one row -> ids and trained mask

class RowEncoder:
    """The `datasets.map` function: a batch of rows -> `input_ids` and `trained` (1 = a target). Picklable, for
    --num_proc. A row that cannot be encoded is a ConfigError naming its index and --dataset."""

    def __init__(self, fmt: str, tokenizer, template: Optional[str], loss_on: str):
        self.fmt, self.tokenizer, self.template, self.loss_on = fmt, tokenizer, template, loss_on

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        from jinja2 import TemplateError

        out = {"input_ids": [], "trained": []}
        for j, index in enumerate(indices):
            row = {k: v[j] for k, v in batch.items()}
            try:
                ids, trained = getattr(self, f"_{self.fmt}")(row)
            except ConfigError as e:
                raise ConfigError(f"row {index} of --dataset: {e}") from None
            except TemplateError as e:  # the template's own checks (raise_exception) and undefined values
                raise ConfigError(f"row {index} of --dataset: the chat template (--chat_template) fails on it: "
                                  f"{type(e).__name__}: {e}") from None
            out["input_ids"].append(np.asarray(ids, dtype=np.int64))
            out["trained"].append(np.asarray(trained, dtype=np.int8))  # 1 byte per token in datasets' cache
        return out

    def _messages(self, row: dict) -> tuple[list, list]:
        messages = _messages(row["messages"], "messages")
        if self.loss_on == "all":
            ids = rendered_ids(self.tokenizer, self.template, messages)
            return ids, [1] * len(ids)
        return assistant_mask(self.tokenizer, self.template, messages)

    def _prompt_completion(self, row: dict) -> tuple[list, list]:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if self.loss_on == "assistant":
                raise ConfigError("--loss_on assistant needs message lists; prompt and completion are strings: use "
                                  "--loss_on completion or all")
            head, tail = encode(self.tokenizer, prompt), encode(self.tokenizer, completion)
            eos = self.tokenizer.eos_token_id
            tail += [eos] if eos is not None and tail[-1:] != [eos] else []  # the model learns to stop
            return head + tail, [int(self.loss_on == "all")] * len(head) + [1] * len(tail)
        prompt, completion = _messages(prompt, "prompt"), _messages(completion, "completion")
        if self.loss_on == "completion":
            return completion_mask(self.tokenizer, self.template, prompt, completion)
        if self.loss_on == "assistant":
            return assistant_mask(self.tokenizer, self.template, prompt + completion)
        ids = rendered_ids(self.tokenizer, self.template, prompt + completion)
        return ids, [1] * len(ids)

    def _tokens(self, row: dict) -> tuple[list, list]:
        if row["input_ids"] is None or (self.loss_on != "all" and row[self.loss_on] is None):
            raise ConfigError(f"`input_ids` or `{self.loss_on}` is empty (null)")
        ids = [int(t) for t in row["input_ids"]]
        if self.loss_on == "all":
            return ids, [1] * len(ids)
        given = list(row[self.loss_on])
        if len(given) != len(ids):
            raise ConfigError(f"`{self.loss_on}` has {len(given)} entries and `input_ids` {len(ids)}")
        if self.loss_on == "assistant_masks":
            if any(m not in (0, 1) for m in given):
                raise ConfigError("`assistant_masks` must hold 0 and 1 (1 = trained)")
            return ids, [int(m) for m in given]
        wrong = next((t for t, (label, i) in enumerate(zip(given, ids)) if label != -100 and label != i), None)
        if wrong is not None:
            raise ConfigError(f"`labels` must be the input_ids, unshifted, with -100 where not trained; at position "
                              f"{wrong} the label is {given[wrong]} and the token {ids[wrong]}")
        return ids, [int(label != -100) for label in given]


def _messages(value, column: str) -> list:
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) and "role" in m for m in value):
        raise ConfigError(f"`{column}` must be a non-empty list of {{role, content}} objects, got {str(value)[:80]!r}")
    return [{k: v for k, v in m.items() if v is not None} for m in value]  # Arrow fills absent keys with None


# ---------------------------------------------------------------- the pipeline

def uses_template(fmt: str, corpus) -> bool:
    """Messages need the chat template; so do prompt/completion message lists, but not strings."""
    if fmt != "prompt_completion":
        return fmt == "messages"
    features = getattr(corpus, "features", None)
    if features and "prompt" in features:
        return getattr(features["prompt"], "dtype", None) not in ("string", "large_string")
    first = next(iter(corpus), None)  # a streamed dataset whose features are not known up front
    return first is not None and not isinstance(first.get("prompt"), str)


def sft_samples(corpus, fmt: str, tokenizer, seq_len: int, *, dataset: str, split: str, cache_dir: str,
                chat_template: Optional[str] = None, loss_on: str = "auto", truncation: str = "error",
                packing: bool = False, num_proc: Optional[int] = None, max_tokens: Optional[int] = None,
                length_flag: str = "--seq_len") -> tuple[ConversationSamples, object, dict]:
    """Rows of a loaded dataset -> the cached store of conversations -> samples of `seq_len` tokens. Returns the
    samples, the store and the settings that keyed it."""
    with unreadable_dataset_is_a_config_error(dataset):
        columns = dataset_columns(corpus)
        loss = resolve_loss_on(fmt, loss_on, columns)
        template = load_chat_template(chat_template, tokenizer) if uses_template(fmt, corpus) else None
        if chat_template and fmt == "tokens":
            raise ConfigError(f"--chat_template applies to messages and prompt/completion data; --dataset {dataset} "
                              f"is already tokenized")
        kwargs = {"batched": True, "with_indices": True, "remove_columns": columns}
        if not getattr(corpus, "_ex_iterable", None):  # map-style: multiprocess, progress bar, disk cache
            kwargs.update(num_proc=num_proc, desc="rendering conversations" if template else "tokenizing")
        tokenized = corpus.map(RowEncoder(fmt, tokenizer, template, loss), **kwargs)
        fingerprint = getattr(tokenized, "_fingerprint", None) or f"{dataset}:{split}:stream"
        extra = {"sft_format": SFT_FORMAT, "data_format": fmt, "chat_template": template, "loss_on": loss}
        settings = cache_settings(fingerprint, tokenizer, dataset, split, fmt, max_tokens, extra)
        store = build_token_store(tokenized, None, cache_dir, store_key(settings), max_tokens, settings,
                                  trained=True)
    if len(store.doc_starts) == 0:
        raise ConfigError(f"--dataset {dataset}: no conversation with any token (empty dataset?)")
    samples = ConversationSamples(store, seq_len, truncation, packing, tokenizer.pad_token_id or 0, length_flag)
    return samples, store, settings
