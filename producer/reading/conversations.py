"""One explicit rule set for irregular conversations, applied before anything is sent.

Every conversation (messages_field or conversations_field) goes through ``normalise`` after
its roles are mapped. The rules, in order (docs/datasets.md, "Normalisation", lists them too):

1. Trailing assistant turns are dropped: the server answers the last user turn again.
   (regenerate: all then drops every assistant turn: producer/reading/mapping.py ``split_turns``.)
2. Empty system turns (blank content) are dropped; an empty user or assistant turn anywhere
   else makes the row invalid (SpecForge would train a bare end-of-turn token on it).
3. System turns are kept only before the first user turn, merged into one (joined by a blank
   line); a system turn after a user turn makes the row invalid.
4. Assistant turns before the first user turn are dropped (nothing asked them; SpecForge
   drops them too, but only after it has cut the rest of the row).
5. Consecutive turns of the same role (two user turns, or two assistant turns in the
   context) are merged into one, joined by a blank line: SpecForge's GeneralParser cuts a
   conversation at the second of two assistant turns, which would drop the generated answer
   and mask old text, and its validator rejects two user turns in a row.
6. What is left must be [system], user, assistant, user, ..., user with a non-empty last user
   turn; anything else is invalid.

The result satisfies SpecForge's ``validate_conversation`` (scripts/conversation_validation.py)
once the generated answer is appended. Errors are ValueErrors naming the field and turn index.
"""

from __future__ import annotations

import json
from typing import Any

from budgetq.shared.schema import Message

JOIN = "\n\n"   # between merged turns: a paragraph break, what a reader of either turn expects
_SENTINEL = "\x00budgetq-system\x00"


def normalise(msgs: list[Message], field: str) -> list[Message]:
    """``msgs`` (roles already mapped to system/user/assistant) under the rules above."""
    end = len(msgs)
    while end and msgs[end - 1].role == "assistant":   # rule 1
        end -= 1
    system: list[str] = []
    turns: list[tuple[int, Message]] = []   # (index in the source, message) after the system block
    for i, m in enumerate(msgs[:end]):
        where = f"{field}[{i}]"
        blank = not m.content.strip()
        if m.role == "system":
            if blank:                                          # rule 2
                continue
            if any(t.role == "user" for _, t in turns):        # rule 3
                raise ValueError(f"{where}: system turn after a user turn (only a leading system prompt is kept)")
            system.append(m.content)
            continue
        if blank:                                              # rule 2
            raise ValueError(f"{where}: empty {m.role} turn")
        if m.role == "assistant" and not any(t.role == "user" for _, t in turns):   # rule 4
            continue
        if turns and turns[-1][1].role == m.role:              # rule 5
            j, prev = turns[-1]
            turns[-1] = (j, Message(role=m.role, content=prev.content + JOIN + m.content))
            continue
        turns.append((i, Message(role=m.role, content=m.content)))
    if not turns:                                              # rule 6
        raise ValueError(f"field {field!r} has no user turn")
    out = [Message(role="system", content=JOIN.join(system))] if system else []
    return out + [m for _, m in turns]


def template_default_system(tokenizer: Any, kwargs: dict[str, Any]) -> str | None:
    """The system prompt ``tokenizer``'s chat template adds when a conversation has none.

    Renders one user turn with a sentinel system prompt and without one: when the second is
    the first with the sentinel replaced by some text, that text is the template's default
    (Qwen2.5: "You are Qwen, created by Alibaba Cloud. ..."). Writing it into the row as an
    explicit system turn renders to the very same prompt, so nothing sent changes, and a
    consumer that inserts its own default (SpecForge does) sees what the model saw.
    """
    user = {"role": "user", "content": "hello"}
    try:
        with_sys = tokenizer.apply_chat_template([{"role": "system", "content": _SENTINEL}, user],
                                                 tokenize=False, add_generation_prompt=True, **kwargs)
        without = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception:  # noqa: BLE001 - a template that rejects a system turn adds none we can find
        return None
    if not isinstance(with_sys, str) or with_sys.count(_SENTINEL) != 1:
        return None
    head, tail = with_sys.split(_SENTINEL)
    if not (without.startswith(head) and without.endswith(tail)) or len(without) < len(head) + len(tail):
        return None
    default = without[len(head):len(without) - len(tail)]
    return default if default.strip() else None


_DEFAULTS: dict[tuple[int, str], str | None] = {}


def with_template_system(msgs: list[Message], tokenizer: Any, kwargs: dict[str, Any]) -> list[Message]:
    """``msgs`` with the template's default system prompt written in, when it adds one."""
    if msgs and msgs[0].role == "system":
        return msgs
    key = (id(tokenizer), json.dumps(kwargs, sort_keys=True, default=str))
    if key not in _DEFAULTS:   # once per tokenizer and kwargs: tokenizers are process-wide singletons
        _DEFAULTS[key] = template_default_system(tokenizer, kwargs)
    default = _DEFAULTS[key]
    return [Message(role="system", content=default), *msgs] if default else msgs


def specforge_problem(row: dict[str, Any]) -> str | None:
    """Why SpecForge's validator would reject ``row`` (a result row as JSON), or None.

    The contract of SpecForge's scripts/validate_regenerated_data.py ``validate_row`` and
    scripts/conversation_validation.py ``validate_conversation``, restated (budgetq's own code):
    a non-empty string id, status "success", a non-empty list of turns each with non-empty
    string content, system turns only before the first user turn, then user and assistant
    strictly alternating from a user turn, ending with an assistant turn whose
    reasoning_content, if any, is a string.
    """
    if not isinstance(row.get("id"), str) or not row["id"].strip():
        return "id must be a non-empty string"
    if row.get("status") != "success":
        return f"status is {row.get('status')!r}, not 'success'"
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        return "conversations must be a non-empty list"
    expected, saw_user = "user", False
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"conversations[{i}] is not an object"
        role, content = turn.get("role"), turn.get("content")
        if not isinstance(content, str) or not content.strip():
            return f"conversations[{i}] ({role}) has empty content"
        if role == "system" and not saw_user:
            continue
        if role != expected:
            return f"conversations[{i}] is {role!r}, expected {expected!r}"
        if role == "assistant" and turn.get("reasoning_content") is not None \
                and not isinstance(turn["reasoning_content"], str):
            return f"conversations[{i}].reasoning_content is not a string"
        saw_user = True
        expected = "assistant" if role == "user" else "user"
    if not saw_user:
        return "conversation has no user turn"
    if expected != "user":   # the last turn seen was a user turn
        return "conversation does not end with an assistant turn"
    return None
