"""What the simulated model "writes": one word per token, thinking first, and the prompt-token estimate."""

from __future__ import annotations

THINK_WORD = "hmm "     # one thinking token
ANSWER_WORD = "tok "    # one answer token
THINK_ID, ANSWER_ID = 8, 7


def estimate_tokens(text: str) -> int:
    """Prompt tokens of a text without a tokenizer: about 4 characters a token, at least 1."""
    return max(1, len(text) // 4)


def content_text(content: object) -> str:
    """An OpenAI message content: a string, or a list of parts of which the text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def split(tokens: int, reasoning: int) -> tuple[int, int]:
    """(thinking, answer) tokens among the first ``tokens`` of a response that thinks for ``reasoning``."""
    think = min(tokens, reasoning)
    return think, tokens - think


def inline_text(tokens: int, reasoning: int) -> str:
    """The raw text: ``<think>...</think>`` then the answer; the closing tag once the answer starts."""
    think, answer = split(tokens, reasoning)
    if not think:
        return ANSWER_WORD * answer
    return "<think>" + THINK_WORD * think + ("</think>" if answer else "") + ANSWER_WORD * answer


def separated(tokens: int, reasoning: int) -> tuple[str | None, str]:
    """(reasoning_content, content) as a reasoning parser splits them."""
    think, answer = split(tokens, reasoning)
    return (THINK_WORD * think if reasoning else None), ANSWER_WORD * answer


def output_ids(tokens: int, reasoning: int) -> list[int]:
    think, answer = split(tokens, reasoning)
    return [THINK_ID] * think + [ANSWER_ID] * answer
