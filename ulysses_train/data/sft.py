"""Conversation and instruction data (SFT): formats, what is trained in each, and the pipeline to samples.

Formats (--data_format, detected from the columns by default, in this order):

    messages           a list of {role, content} (or ShareGPT's `conversations` of {from, value}, or the column
                       --messages_field names: data/messages.py), rendered with the chat template (data/chat.py)
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
from .chat import TemplateFailure, assistant_mask, completion_mask, encode, load_chat_template, rendered_ids
from .corpus import dataset_columns, unreadable_dataset_is_a_config_error
from .messages import messages_column, normalise, parse_role_map, roles
from .packing import ConversationSamples
from .token_store import build_token_store, cache_settings, store_key

DATA_FORMATS = ("auto", "messages", "prompt_completion", "tokens", "text")
LOSS_ON = ("auto", "assistant", "completion", "all")
TRUNCATION = ("error", "left", "right")
SFT_FORMAT = 3  # bump when rendering, masking or checking rules change what is stored
_NEEDS = {"prompt_completion": ["prompt", "completion"], "tokens": ["input_ids"]}
_LOSS_ON = {"messages": ("assistant", "all"), "prompt_completion": ("completion", "assistant", "all"),
            "text": ("all",)}


def detect_format(columns: list[str], requested: str, text_column: Optional[str],
                  messages_field: Optional[str] = None) -> str:
    """The data format of a dataset with these columns; a forced format must find its columns."""
    if requested == "text" or (requested == "auto" and text_column):
        return "text"
    messages = messages_column(columns, messages_field)
    if requested == "messages" or (requested == "auto" and messages):
        if not messages:
            raise ConfigError(f"--data_format messages needs a `messages` or `conversations` column (or name yours "
                              f"with --messages_field); the dataset has {columns}")
        return "messages"
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
                      f"(conversations: `messages`, ShareGPT's `conversations` or --messages_field; instructions: "
                      f"`prompt` and `completion`; tokens: `input_ids`): name the text column with --text_column, or "
                      f"the format with --data_format")


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
    --num_proc. A row that cannot be encoded is a ConfigError naming its index and --dataset (its path, if given).
    Pre-tokenized ids must be integers in [0, vocab_size) (the store holds uint32: anything else would wrap, be
    truncated, or fail the embedding only when its row is drawn)."""

    def __init__(self, fmt: str, tokenizer, template: Optional[str], loss_on: str, vocab_size: Optional[int] = None,
                 dataset: Optional[str] = None, column: str = "messages", role_names: Optional[dict] = None,
                 template_name: str = "the chat template"):
        self.fmt, self.tokenizer, self.template, self.loss_on = fmt, tokenizer, template, loss_on
        self.vocab_size, self.dataset, self.template_name = vocab_size, dataset, template_name
        self.column, self.roles = column, roles(None) if role_names is None else role_names

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        out = {"input_ids": [], "trained": []}
        for j, index in enumerate(indices):
            row = {k: v[j] for k, v in batch.items()}
            try:
                ids, trained = getattr(self, f"_{self.fmt}")(row)
            except ConfigError as e:
                raise ConfigError(f"{self._where(index)}: {e}") from None
            except TemplateFailure as e:  # it raised (its own checks, 1/0, include, the sandbox) or never ended
                raise ConfigError(f"{self._where(index)}: {self.template_name} {e}; fix the row, or the "
                                  f"template (--chat_template)") from None
            out["input_ids"].append(np.asarray(ids, dtype=np.int64))
            out["trained"].append(np.asarray(trained, dtype=np.int8))  # 1 byte per token in datasets' cache
        return out

    def _where(self, index: int) -> str:
        return f"row {index} of --dataset" + (f" {self.dataset}" if self.dataset else "")

    def _messages(self, row: dict) -> tuple[list, list]:
        messages = normalise(row[self.column], self.column, self.roles)
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
        prompt, completion = normalise(prompt, "prompt", self.roles), normalise(completion, "completion", self.roles)
        if self.loss_on == "completion":
            return completion_mask(self.tokenizer, self.template, prompt, completion)
        if self.loss_on == "assistant":
            return assistant_mask(self.tokenizer, self.template, prompt + completion)
        ids = rendered_ids(self.tokenizer, self.template, prompt + completion)
        return ids, [1] * len(ids)

    def _tokens(self, row: dict) -> tuple[list, list]:
        if row["input_ids"] is None or (self.loss_on != "all" and row[self.loss_on] is None):
            raise ConfigError("`input_ids` is empty (null)" if row["input_ids"] is None or self.loss_on == "all"
                              else f"`{self.loss_on}` is empty (null)")
        for name in ("input_ids",) if self.loss_on == "all" else ("input_ids", self.loss_on):
            if not isinstance(row[name], (list, tuple, np.ndarray)):
                raise ConfigError(f"`{name}` is {row[name]!r}, not a list of one entry per token")
        ids = token_ids(row["input_ids"], self.vocab_size)
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


def token_ids(values, vocab_size: Optional[int]) -> list[int]:
    """Pre-tokenized `input_ids` as ints, each checked: an integer (7.0 is 7, 7.5 is refused) in [0, vocab_size)
    (without a vocabulary: what uint32 holds)."""
    values = list(values)
    arr = np.asarray(values) if values else np.zeros(0, np.int64)
    if arr.dtype.kind not in "iuf" or arr.ndim != 1:  # strings, nulls, lists; or ints past int64 (object)
        arr = np.asarray([_integer(k, t) for k, t in enumerate(values)], dtype=object)
    elif arr.dtype.kind == "f":
        fractional = ~np.isfinite(arr) | (arr != np.floor(arr))
        if fractional.any():
            bad = int(np.argmax(fractional))
            raise ConfigError(f"`input_ids`[{bad}] is {values[bad]!r}, not an integer token id")
    limit = vocab_size or 2**32
    outside = (arr < 0) | (arr >= limit)
    if outside.any():
        bad = int(np.argmax(outside))
        what = "the model's vocabulary" if vocab_size else "the range of a token id"
        raise ConfigError(f"`input_ids`[{bad}] is {int(arr[bad])}, outside {what} (0 to {limit - 1}): tokenize the "
                          f"data with the model's tokenizer, or give the --model whose vocabulary it was made for")
    return [int(t) for t in arr.tolist()]


def _integer(k: int, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or (
            isinstance(value, (float, np.floating)) and not float(value).is_integer()):
        raise ConfigError(f"`input_ids`[{k}] is {value!r}, not an integer token id")
    return int(value)


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
                length_flag: str = "--seq_len", vocab_size: Optional[int] = None, messages_field: Optional[str] = None,
                role_map=None) -> tuple[ConversationSamples, object, dict]:
    """Rows of a loaded dataset -> the cached store of conversations -> samples of `seq_len` tokens. Returns the
    samples, the store and the settings that keyed it. Data with no target at all is a ConfigError (require_targets);
    `vocab_size`: the model's, which pre-tokenized ids must fall in; `messages_field` and `role_map`: the layout of
    message lists (data/messages.py)."""
    with unreadable_dataset_is_a_config_error(dataset):
        columns = dataset_columns(corpus)
        column = messages_column(columns, messages_field) if fmt == "messages" else None
        role_names = roles(parse_role_map(role_map))
        loss = resolve_loss_on(fmt, loss_on, columns)
        template = load_chat_template(chat_template, tokenizer) if uses_template(fmt, corpus) else None
        if chat_template and fmt == "tokens":
            raise ConfigError(f"--chat_template applies to messages and prompt/completion data; --dataset {dataset} "
                              f"is already tokenized")
        kwargs = {"batched": True, "with_indices": True, "remove_columns": columns}
        if not getattr(corpus, "_ex_iterable", None):  # map-style: multiprocess, progress bar, disk cache
            kwargs.update(num_proc=num_proc, desc="rendering conversations" if template else "tokenizing")
        name = f"--chat_template {chat_template}" if chat_template else "the tokenizer's chat template"
        encoder = RowEncoder(fmt, tokenizer, template, loss, vocab_size, dataset, column, role_names, name)
        tokenized = corpus.map(encoder, **kwargs)
        fingerprint = getattr(tokenized, "_fingerprint", None) or f"{dataset}:{split}:stream"
        extra = {"sft_format": SFT_FORMAT, "data_format": fmt, "chat_template": template, "loss_on": loss,
                 "messages_column": column, "roles": role_names if fmt != "tokens" else None}
        settings = cache_settings(fingerprint, tokenizer, dataset, split, fmt, max_tokens, extra)
        store = build_token_store(tokenized, None, cache_dir, store_key(settings), max_tokens, settings,
                                  trained=True)
    if len(store.doc_starts) == 0:
        raise ConfigError(f"--dataset {dataset}: no conversation with any token (empty dataset?)")
    samples = ConversationSamples(store, seq_len, truncation, packing, tokenizer.pad_token_id or 0, length_flag)
    require_targets(samples, fmt, loss, dataset, chat_template if template else None, template is not None)
    return samples, store, settings


# ---------------------------------------------------------------- is anything trained?

UNTRAINED_WARN_SHARE = 0.25  # more samples than this without a target: most likely the template or --loss_on


def _why_no_target(fmt: str, loss: str, chat_template: Optional[str], uses_template: bool) -> str:
    if fmt == "tokens":
        return {"labels": "every `labels` entry is -100", "assistant_masks": "every `assistant_masks` entry is 0"}.get(
            loss, "every sequence has a single token")
    if uses_template:
        which = (f"--chat_template {chat_template}" if chat_template else
                 "the tokenizer's chat template (else give one with --chat_template)")
        return (f"do the conversations have assistant turns (roles other than ShareGPT's are named with --role_map), "
                f"and does {which} render them?")
    return "are the completions empty?"


def require_targets(samples: ConversationSamples, fmt: str, loss: str, dataset: str, chat_template: Optional[str],
                    uses_template: bool) -> None:
    """A run whose data has no target would train nothing and report a loss of 0 as if it had: a ConfigError that
    says why it may be and what to change."""
    if samples.target_counts().sum() > 0:
        return
    fix = "fix the data or the template" if uses_template else "fix the data"
    raise ConfigError(f"--dataset {dataset}: no target: none of its {len(samples.lengths):,} conversations has a "
                      f"token the model is trained to write with --loss_on {loss} "
                      f"({_why_no_target(fmt, loss, chat_template, uses_template)}); {fix}, or train every token with "
                      f"--loss_on all")


def untrained_warning(samples: ConversationSamples, dataset: str) -> Optional[str]:
    """A warning when a large share of the samples trains nothing (their steps add nothing to the gradient)."""
    per_sample = samples.sample_targets()
    empty = int((per_sample == 0).sum())
    if not len(per_sample) or empty / len(per_sample) <= UNTRAINED_WARN_SHARE:
        return None
    return (f"--dataset {dataset}: {empty:,} of {len(per_sample):,} samples ({empty / len(per_sample):.0%}) have no "
            f"target (conversations without an assistant turn, or whose trained tokens were cut by --truncation): "
            f"they add nothing to training; check --loss_on and --chat_template, or filter them out")
