"""Turn one raw row into the chat messages to send: a prompt field, a messages list or ShareGPT.

A conversation that already holds assistant turns is regenerated from its last user turn
(regenerate: last): trailing assistant turns are dropped, earlier turns stay as context;
irregular shapes are normalised or rejected by producer/reading/conversations.py. With regenerate:
all, ``split_turns`` then drops every assistant turn and splits the user turns into the first
request and the turns asked after it. A ``system_prompt`` from
the config is prepended unless the conversation already starts with a system turn.
Errors are ValueErrors whose message names the field, the turn index and the value.
"""

from __future__ import annotations

from typing import Any

from budgetq.producer.reading.conversations import normalise
from budgetq.shared.config import DatasetConfig
from budgetq.shared.json_kind import kind
from budgetq.shared.schema import Message

# OpenAI-style messages: the role names as they are.
CHAT_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
# ShareGPT `from` values (and role names, for files that use role/content).
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


def _prompt(row: dict[str, Any], field: str) -> list[Message]:
    if field not in row:
        raise ValueError(f"missing field {field!r}")
    prompt = row[field]
    if not isinstance(prompt, str):
        raise ValueError(f"field {field!r} is {kind(prompt)}, not a string")
    if not prompt.strip():
        raise ValueError(f"field {field!r} is empty")
    return [Message(role="user", content=prompt)]


def _pick(turn: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    """The first of ``keys`` present with a non-null value (Arrow rows carry every key)."""
    for key in keys:
        if turn.get(key) is not None:
            return key, turn[key]
    return None, None


def _turns(row: dict[str, Any], field: str, sharegpt: bool) -> list[Message]:
    if field not in row:
        raise ValueError(f"missing field {field!r}")
    raw = row[field]
    if not isinstance(raw, list):
        raise ValueError(f"field {field!r} is {kind(raw)}, not a list")
    if not raw:
        raise ValueError(f"field {field!r} is empty")
    roles = SHAREGPT_ROLES if sharegpt else CHAT_ROLES
    role_keys = ("from", "role") if sharegpt else ("role",)
    text_keys = ("value", "content") if sharegpt else ("content",)
    msgs: list[Message] = []
    for i, turn in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise ValueError(f"{where} is {kind(turn)}, not an object")
        role_key, role = _pick(turn, role_keys)
        if role_key is None:
            raise ValueError(f"{where} has no {' or '.join(repr(k) for k in role_keys)}")
        if not isinstance(role, str) or role.lower() not in roles:
            raise ValueError(f"{where}: unknown role {role!r} in {role_key!r} (known: {', '.join(roles)})")
        text_key, text = _pick(turn, text_keys)
        if text_key is None:
            raise ValueError(f"{where} has no {' or '.join(repr(k) for k in text_keys)}")
        if not isinstance(text, str):
            raise ValueError(f"{where}.{text_key} is {kind(text)}, not a string")
        msgs.append(Message(role=roles[role.lower()], content=text))
    return normalise(msgs, field)  # one rule set for irregular conversations


def row_to_messages(ds: DatasetConfig, row: dict[str, Any]) -> list[Message]:
    """The messages to send for ``row``; raises ValueError naming what is wrong."""
    if ds.messages_field:
        msgs = _turns(row, ds.messages_field, sharegpt=False)
    elif ds.conversations_field:
        msgs = _turns(row, ds.conversations_field, sharegpt=True)
    else:
        msgs = _prompt(row, ds.prompt_field or "prompt")
    if ds.system_prompt and msgs[0].role != "system":
        msgs.insert(0, Message(role="system", content=ds.system_prompt))
    return msgs


def split_turns(msgs: list[Message]) -> tuple[list[Message], list[Message]]:
    """regenerate: all: (the first request: [system], first user turn; the later user turns).

    The dataset's assistant turns are dropped, the way SpecForge's
    scripts/regenerate_train_data.py (``call_sglang``) builds its context: system turns kept,
    assistant turns skipped, each user turn asked with the model's own answers before it.
    ``msgs`` is already normalised, so user turns are never adjacent in the source.
    """
    head = [m for m in msgs if m.role == "system"]
    users = [m for m in msgs if m.role == "user"]
    return [*head, users[0]], users[1:]


def prompt_chars(msgs: list[Message]) -> int:
    """What the length filter measures: characters of every message sent, system prompt included."""
    return sum(len(m.content) for m in msgs)
