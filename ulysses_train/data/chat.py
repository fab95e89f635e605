"""Chat templates and the assistant mask: which tokens of a rendered conversation the model is trained to write.

A conversation is rendered with a Jinja chat template (the tokenizer's own, or --chat_template FILE) and tokenized
as transformers' `apply_chat_template` does it (special-token strings as the template variables, the text encoded
without added special tokens). Its assistant tokens are found in one of two ways, in this order:

1. Generation markers: a template that wraps what the assistant writes in `{% generation %}` ...
   `{% endgeneration %}` gives the mask directly (`apply_chat_template(..., return_assistant_tokens_mask=True,
   return_dict=True)`: every token overlapping a marked span; tokenizers without offsets, i.e. not `is_fast`, go
   to 2).
2. Growing prefixes, for templates without markers: for each assistant message i, messages[:i] rendered with
   add_generation_prompt=True must be a prefix, token for token, of messages[:i+1] rendered, which must be a prefix
   of the whole conversation rendered; the assistant's turn is the difference.

What is trained (both ways alike): every assistant turn's content and its end-of-turn token (`<|im_end|>`,
`<|eot_id|>`, `</s>`), so the model learns to stop; not the turn's header (`<|im_start|>assistant\\n`, which the
generation prompt writes at inference), and not the separator a template writes after the end-of-turn token
(ChatML's newline), which the model never generates. A template with markers says this itself by marking
`content + end-of-turn` (Qwen's and TRL's training templates do); with prefixes, the difference is taken without
its trailing tokens that decode to whitespace only. System, user and tool turns are never trained. The tests
check that ChatML with and without markers gives the same mask.

A template where neither way finds the assistant's tokens (markers that mark nothing, renderings that are not
prefixes of each other, such as templates that render the last assistant turn unlike earlier ones) is a
ConfigError naming --chat_template. So are markers that enclose tokens outside the assistant's messages (around a
user turn, or around everything): with the growing prefixes, which know where each message's rendering starts and
ends, every marked token is checked to lie in an assistant message's rendering.

A template runs on each row under a time limit (RENDER_TIMEOUT_S per rendering: nested loops can take for ever),
and whatever it raises (`1/0`, an `{% include %}`, the sandbox's range limit) is a TemplateFailure, which the data
layer names with the row, the file and the flag.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Optional

import numpy as np

from ..deadline import DeadlineExceeded, deadline
from ..errors import ConfigError

RENDER_TIMEOUT_S = 30.0  # one rendering of one conversation takes milliseconds, even at a million tokens
_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
FIX = ("give a template (--chat_template FILE) that wraps each assistant turn's content and end-of-turn token in "
       "{% generation %} ... {% endgeneration %}, or whose rendering of a conversation grows by whole turns")


class TemplateMismatch(Exception):
    """The prefix method cannot split a conversation into turns; the message says where."""


class TemplateFailure(Exception):
    """The chat template raised, or ran past RENDER_TIMEOUT_S, on a conversation; the message says how."""


@contextlib.contextmanager
def _template_runs():
    """The template's own failures, and a rendering that does not end, as TemplateFailure."""
    try:
        with deadline(RENDER_TIMEOUT_S):
            yield
    except DeadlineExceeded:
        raise TemplateFailure(f"did not finish rendering the conversation within {RENDER_TIMEOUT_S:g} s (loops "
                              f"that never end, or far too many?)") from None
    except (ConfigError, TemplateMismatch):
        raise
    except Exception as e:  # noqa: BLE001 - whatever the template's code raises: 1/0, include, the sandbox's limits
        raise TemplateFailure(f"fails on the conversation: {type(e).__name__}: {e}") from None


def load_chat_template(path: Optional[str], tokenizer) -> str:
    """The template text: --chat_template FILE, else the tokenizer's own; a ConfigError naming the flag if there is
    none, the file cannot be read, or the text is not a Jinja template."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat_template {path} cannot be read: {e}") from None
    else:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default")
        if not template:
            raise ConfigError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template, which "
                              f"conversations need: give one with --chat_template FILE (a Jinja file)")
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateError as e:
        where = f"--chat_template {path}" if path else "the tokenizer's chat template (replace it with --chat_template)"
        raise ConfigError(f"{where} is not a valid Jinja template: {e}") from None
    return template


def has_generation_markers(template: str) -> bool:
    return bool(_MARKER.search(template))


# ---------------------------------------------------------------- rendering and tokenizing

def render(tokenizer, template: str, messages: list, generation_prompt: bool = False,
           spans: bool = False) -> tuple[str, list]:
    """The template's text for `messages` and, with `spans`, the character spans its generation markers enclose."""
    from transformers.utils.chat_template_utils import render_jinja_template

    with _template_runs():
        texts, indices = render_jinja_template(conversations=[messages], chat_template=template,
                                               add_generation_prompt=generation_prompt,
                                               return_assistant_tokens_mask=spans,
                                               **dict(getattr(tokenizer, "special_tokens_map", {})))
    return texts[0], (indices[0] if spans else [])


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of rendered text, as apply_chat_template tokenizes it (no BOS/EOS added: the template writes them)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def rendered_ids(tokenizer, template: str, messages: list, generation_prompt: bool = False) -> list[int]:
    if not messages and not generation_prompt:
        return []
    return encode(tokenizer, render(tokenizer, template, messages, generation_prompt)[0])


# ---------------------------------------------------------------- the two ways to the mask

def marker_mask(tokenizer, template: str, messages: list) -> tuple[list[int], list[int]]:
    """(ids, mask) from the template's generation markers: transformers' own for its tokenizers; for the byte
    tokenizer, the marked characters' bytes."""
    from .corpus import ByteTokenizer

    if not isinstance(tokenizer, ByteTokenizer):
        with _template_runs():
            out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    text, spans = render(tokenizer, template, messages, spans=True)
    char_bytes = np.fromiter((len(c.encode("utf-8")) for c in text), dtype=np.int64, count=len(text))
    byte_at = np.concatenate([[0], np.cumsum(char_bytes)])  # first byte of each character
    mask = np.zeros(int(byte_at[-1]), dtype=np.int64)
    for start, end in spans:
        mask[byte_at[start]:byte_at[end]] = 1
    return encode(tokenizer, text), mask.tolist()


def _is_blank(tokenizer, token: int) -> bool:
    return tokenizer.decode([token]).strip() == ""


def turn_span(tokenizer, before: list[int], after: list[int], what: str) -> tuple[int, int]:
    """[start, end) of the tokens `after` adds to `before` (which must be its prefix), without the trailing
    whitespace-only tokens (the separator after the end-of-turn token)."""
    if after[:len(before)] != before:
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        raise TemplateMismatch(f"{what} (they differ at token {at}: {tokenizer.decode(before[at:at + 8])!r} vs "
                               f"{tokenizer.decode(after[at:at + 8])!r})")
    end = len(after)
    while end > len(before) and _is_blank(tokenizer, after[end - 1]):
        end -= 1
    return len(before), end


def prefix_mask(tokenizer, template: str, messages: list) -> tuple[list[int], list[int]]:
    """(ids, mask) by rendering growing prefixes of the conversation; TemplateMismatch if they do not grow."""
    ids = rendered_ids(tokenizer, template, messages)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = rendered_ids(tokenizer, template, messages[:i], generation_prompt=True)
        turn = rendered_ids(tokenizer, template, messages[:i + 1])
        start, end = turn_span(tokenizer, prompt, turn, f"messages[:{i}] rendered with add_generation_prompt=True "
                                                        f"is not a prefix of messages[:{i + 1}] rendered")
        turn_span(tokenizer, turn, ids, f"messages[:{i + 1}] rendered is not a prefix of the whole conversation")
        mask[start:end] = [1] * (end - start)
    return ids, mask


def assistant_mask(tokenizer, template: str, messages: list) -> tuple[list[int], list[int]]:
    """(ids, mask): 1 on every assistant turn's tokens (module docstring). ConfigError naming --chat_template when
    the template's assistant turns cannot be found."""
    has_assistant = any(m.get("role") == "assistant" for m in messages)
    if has_generation_markers(template) and getattr(tokenizer, "is_fast", True):  # the mask needs token offsets
        ids, mask = marker_mask(tokenizer, template, messages)
        if any(mask) or not has_assistant:
            check_marked_in_assistant_messages(tokenizer, template, messages)
            return ids, mask
    try:
        return prefix_mask(tokenizer, template, messages)
    except TemplateMismatch as e:
        markers = ("its {% generation %} markers mark no token" if has_generation_markers(template)
                   else "it has no {% generation %} markers")
        raise ConfigError(f"--chat_template: cannot find the assistant's tokens: {markers}, and {e}; {FIX}") from None


def message_ends(tokenizer, template: str, messages: list, text: str) -> Optional[list[int]]:
    """Where each message's rendering (header, content, end of turn, separator) ends in `text`, the whole
    conversation rendered: the length of the messages up to it rendered. None when those renderings are not
    prefixes of `text` (then nothing can be said). Characters, not tokens: rendering is cheap, tokenizing each
    prefix would not be."""
    ends = []
    for i in range(len(messages)):
        upto = render(tokenizer, template, messages[:i + 1])[0]
        if not text.startswith(upto):
            return None
        ends.append(len(upto))
    return ends


def check_marked_in_assistant_messages(tokenizer, template: str, messages: list) -> None:
    """A ConfigError naming --chat_template, with the counts, when the template's generation markers enclose text
    outside the assistant's messages: it would be trained while the log says "loss on assistant"."""
    text, spans = render(tokenizer, template, messages, spans=True)
    marked = np.zeros(len(text), dtype=bool)
    for start, end in spans:
        marked[start:end] = True
    if not marked.any():
        return
    ends = message_ends(tokenizer, template, messages, text)
    if ends is None:
        return  # the template does not grow by whole messages: its markers are all there is to go by
    positions = np.flatnonzero(marked)
    owner = np.searchsorted(np.asarray(ends), positions, side="right")  # the message each marked character is in
    roles = np.asarray([str(m.get("role")) for m in messages] + ["(after the last message)"], dtype=object)
    outside = roles[owner] != "assistant"
    if not outside.any():
        return
    where = ", ".join(sorted(set(roles[owner[outside]])))
    raise ConfigError(f"--chat_template: its {{% generation %}} markers enclose {int(outside.sum())} of the "
                      f"conversation's {len(text)} characters outside the assistant's messages (in: {where}; "
                      f"{int((~outside).sum())} marked characters are in assistant messages): they would be trained. "
                      f"Markers must enclose only what the assistant writes (its content and end-of-turn token); "
                      f"fix the template, or remove its markers to find assistant turns by rendering")


def completion_mask(tokenizer, template: str, prompt: list, completion: list) -> tuple[list[int], list[int]]:
    """(ids, mask) of prompt + completion messages: 1 on everything the completion adds to the prompt (rendered
    with add_generation_prompt=True when the completion starts with the assistant's turn), without the trailing
    separator, as for assistant turns."""
    opens = completion[0].get("role") == "assistant"
    head = rendered_ids(tokenizer, template, prompt, generation_prompt=opens)
    ids = rendered_ids(tokenizer, template, prompt + completion)
    try:
        start, end = turn_span(tokenizer, head, ids, f"the prompt rendered{' with add_generation_prompt=True' * opens}"
                                                     f" is not a prefix of prompt + completion rendered")
    except TemplateMismatch as e:
        raise ConfigError(f"--chat_template: cannot find the completion's tokens: {e}; {FIX}") from None
    return ids, [0] * start + [1] * (end - start) + [0] * (len(ids) - end)


def template_source(path: Optional[str]) -> str:
    """How logs name the template in use."""
    return f"--chat_template {os.path.basename(path)}" if path else "the tokenizer's chat template"
