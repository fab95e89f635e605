"""Message lists in the field's layouts, read as the chat template expects them: `{role, content}` and the rest of
each message (tool calls, names) passed through.

    messages          OpenAI / TRL: [{"role": "user", "content": ...}, ...]
    conversations     ShareGPT (axolotl, LLaMA-Factory): [{"from": "human", "value": ...}, ...]
    --messages_field  any other column holding such a list (axolotl's `field_messages`)

A message's role is read from `role` or `from`, its text from `content` or `value`. Roles are then mapped:
ShareGPT's names by default (human -> user, gpt -> assistant, observation -> tool, ...), `--role_map from=to,...`
on top. Two roles carry tool use: `tool` (and its aliases) are the tool's results, passed to the template as tool
messages; `function_call` (LLaMA-Factory's name for an assistant turn that calls a tool) becomes an assistant message
whose `tool_calls` hold the call(s) its JSON value names ({"name", "arguments"}, or a list of them). A role the map
does not know is passed through unchanged for the template to render (the assistant's turns are those whose role is
`assistant`, so data whose assistant role is called otherwise trains nothing until --role_map names it).
"""

from __future__ import annotations

import json
from typing import Optional, Union

from ..errors import ConfigError

MESSAGE_COLUMNS = ("messages", "conversations")  # detected in this order
DEFAULT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                 "model": "assistant", "chatgpt": "assistant", "system": "system", "tool": "tool",
                 "observation": "tool", "function": "tool", "ipython": "tool", "function_call": "assistant"}
TOOL_CALL = "function_call"


def parse_role_map(value: Union[str, dict, None]) -> dict:
    """--role_map: `from=to` pairs with commas, or a mapping (YAML, or JSON text)."""
    if not value:
        return {}
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--role_map {value}: not a JSON object ({e})") from None
    if isinstance(value, dict):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    else:
        pairs = [tuple(p.strip() for p in item.split("=", 1)) for item in str(value).split(",") if item.strip()]
    bad = [p for p in pairs if len(p) != 2 or not p[0] or not p[1]]
    if bad:
        raise ConfigError(f"--role_map {value}: give from=to pairs separated by commas, e.g. human=user,gpt=assistant")
    return dict(pairs)


def roles(role_map: Optional[dict]) -> dict:
    """The defaults with --role_map over them."""
    return {**DEFAULT_ROLES, **(role_map or {})}


def messages_column(columns: list[str], messages_field: Optional[str]) -> Optional[str]:
    """The column holding message lists: --messages_field (which must exist), else `messages` or `conversations`."""
    if messages_field:
        if messages_field not in columns:
            raise ConfigError(f"--messages_field {messages_field} is not a column of the dataset; its columns are "
                              f"{columns}")
        return messages_field
    return next((c for c in MESSAGE_COLUMNS if c in columns), None)


def _tool_calls(value) -> list:
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        raise ConfigError(f"a {TOOL_CALL} turn must hold JSON ({{\"name\", \"arguments\"}} or a list of them), got "
                          f"{str(value)[:80]!r}") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, dict) and "name" in c for c in calls):
        raise ConfigError(f"a {TOOL_CALL} turn must name each call's \"name\", got {str(value)[:80]!r}")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
            for c in calls]


def normalise(value, column: str, role_names: dict) -> list[dict]:
    """A row's message list as the template takes it (module docstring). Keys Arrow fills with None for messages
    that lack them are dropped."""
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise ConfigError(f"`{column}` must be a non-empty list of {{role, content}} objects (or ShareGPT's {{from, "
                          f"value}}), got {str(value)[:80]!r}")
    out = []
    for i, message in enumerate(value):
        message = {k: v for k, v in message.items() if v is not None}
        role = message.pop("role", None) or message.pop("from", None)
        if role is None:
            raise ConfigError(f"`{column}`: a message without `role` (or ShareGPT's `from`): {str(message)[:80]!r}")
        if not isinstance(role, str):
            raise ConfigError(f"`{column}`[{i}]: the role is {role!r}, not a string")
        if "content" not in message and "value" in message:
            message["content"] = message.pop("value")
        if "content" in message:
            message["content"] = _content(message["content"], f"`{column}`[{i}].content")
        if role == TOOL_CALL and role_names.get(role) == "assistant":
            message["tool_calls"] = _tool_calls(message.pop("content", None))
        out.append({"role": role_names.get(role, role), **message})
    return out


def _content(value, where: str) -> str:
    """A message's content as text. A list of parts (`[{"type": "text", "text": ...}]`, the multimodal form) has
    its text parts joined in order, as a processor's template writes them one after another: a template that prints
    `{{ content }}` would otherwise render the list's Python repr, and train it. Any other part (an image), or
    content that is neither, is refused: it cannot be rendered as text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            part = {key: v for key, v in part.items() if v is not None} if isinstance(part, dict) else part
            if not isinstance(part, dict) or part.get("type", "text") != "text" or not isinstance(part.get("text"),
                                                                                                    str):
                kind = (repr(part)[:60] if not isinstance(part, dict) else f"a part of type {part.get('type')!r}"
                        if part.get("type", "text") != "text" else f"a text part whose text is {part.get('text')!r}")
                raise ConfigError(f"{where}[{k}] is {kind}: content parts must be text ({{\"type\": \"text\", "
                                  f"\"text\": ...}}); this trainer renders text only")
            texts.append(part["text"])
        return "".join(texts)
    raise ConfigError(f"{where} is {repr(value)[:60]} ({type(value).__name__}): content must be text, a string or "
                      f"a list of {{\"type\": \"text\", \"text\": ...}} parts")
