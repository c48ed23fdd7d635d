"""A tiny chat tokenizer built on the spot (never downloaded), loadable with AutoTokenizer.

Word-level: every whitespace-separated word and every run of punctuation is one token
(unknown words become [UNK], still one token each), so token counts in tests are easy to
predict. The chat template is ChatML-like and honours ``enable_thinking`` the way Qwen3's
does, so ``chat_template_kwargs`` can be tested too.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
BASE_WORDS = ("system", "user", "assistant", "you", "are", "a", "helpful", "hello", "hi", "question",
              "answer", "what", "is", "the", "of", "and", "write", "about", "explain", ".", "?", ",", "!")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def make_tiny_tokenizer(directory: str | Path, words: Iterable[str] = ()) -> str:
    """Build, save (save_pretrained) and return the path of a tiny chat tokenizer.

    ``words`` adds vocabulary beyond BASE_WORDS; any other word maps to [UNK] (one token).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for tok in ["[UNK]", "[PAD]", *SPECIAL_TOKENS, *BASE_WORDS, *words]:
        vocab.setdefault(tok, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",
                                  bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  additional_special_tokens=SPECIAL_TOKENS[2:])
    tok.chat_template = CHAT_TEMPLATE
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(path))
    return str(path)
