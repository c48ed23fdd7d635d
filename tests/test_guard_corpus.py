"""False positives of the degeneration guard on ordinary answers, with its default settings: 0.

The corpus (over 2,000 answers, all on every machine the tests run on):
- the bundled datasets' texts (examples/data: prompts and ShareGPT turns) and the docs (markdown:
  tables, lists, code blocks, commands);
- the simulator's ordinary answers (simulator/texts.py, lengths of the seed's mean 2k);
- the Python standard library's sources cut into answer-sized pieces (code with repeated lines,
  tables of constants, long test data, docstrings), the largest body of real text on any machine;
- legitimately repetitive answers made here: markdown tables with identical rows, checklists,
  code that repeats a line, a small zero matrix, a song's refrain, separators, CSV.
Each answer is streamed the way a server would send it, one token per chunk (a word, a run of
punctuation or of whitespace: roughly what a BPE tokenizer does), with the token count so far.

And the other side: every period from 1 to 300 tokens, after ordinary text, is cut.
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from budgetq.shared.config_quality import GuardConfig
from budgetq.simulator.lengths import LengthModel
from budgetq.simulator.texts import Script
from budgetq.worker.degeneration import LoopGuard

ROOT = Path(__file__).resolve().parent.parent
TOKEN = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
PIECE = 8000   # characters per answer cut from a file (~2k tokens: the seed's mean answer)


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def bundled() -> Iterator[tuple[str, str]]:
    for path in sorted((ROOT / "examples" / "data").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if "prompt" in row:
                yield f"{path.name}:{row['id']}", row["prompt"]
            for turn in row.get("conversations", []):
                yield f"{path.name}:{row['id']}", turn["value"]
    for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for at in range(0, len(text), PIECE):
            yield f"{path.name}@{at}", text[at:at + PIECE]


def stdlib() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for at in range(0, min(len(text), 4 * PIECE), PIECE):
            if len(text) - at >= 200:
                yield f"{path.relative_to(root)}@{at}", text[at:at + PIECE]


def repetitive(rng: random.Random) -> Iterator[tuple[str, str]]:
    """Answers that repeat on purpose, as ordinary answers do, but not without end."""
    names = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    for i in range(60):
        cols = rng.randrange(2, 7)
        head = "| " + " | ".join(rng.choice(names) for _ in range(cols)) + " |\n"
        sep = "|" + "---|" * cols + "\n"
        rows = []
        for _ in range(rng.randrange(10, 60)):
            if rng.random() < 0.3:
                rows.append("|" + "   |" * cols + "\n")   # empty rows, identical
            else:
                rows.append("| " + " | ".join(str(rng.randrange(100)) for _ in range(cols)) + " |\n")
        yield f"table{i}", "Here is the table you asked for:\n\n" + head + sep + "".join(rows) + "\nDone."
    for i in range(40):
        items = [f"- [ ] {rng.choice(names)} {rng.randrange(1000)}\n" for _ in range(rng.randrange(5, 40))]
        yield f"checklist{i}", "Checklist:\n" + "".join(items) + "- [ ] TODO\n" * rng.randrange(1, 12)
    for i in range(40):
        body = "".join(f"    x{j} = 0\n" for j in range(rng.randrange(3, 20)))
        same = "    print('-' * 40)\n" * rng.randrange(2, 10)
        yield f"code{i}", f"```python\ndef reset{i}():\n{body}{same}    return None\n```\n"
    for i in range(20):
        n = rng.randrange(3, 9)
        matrix = "[\n" + "".join("  [" + ", ".join(["0"] * n) + "],\n" for _ in range(n)) + "]\n"
        yield f"matrix{i}", f"The {n}x{n} zero matrix:\n{matrix}"
    for i in range(20):
        chorus = "And we sing la la la, under the open sky,\nand we sing la la la, as the years go by.\n"
        verses = [" ".join(rng.choice(names) for _ in range(20)) + "\n" for _ in range(4)]
        yield f"song{i}", "".join(v + chorus for v in verses) + chorus
    for i in range(20):
        line = rng.choice(["=", "-", "*", "#"]) * rng.choice([40, 60, 80])
        parts = [f"{line}\nSection {k}\n{line}\n" + " ".join(rng.choice(names) for _ in range(30)) + "\n"
                 for k in range(6)]
        yield f"sections{i}", "".join(parts)
    for i in range(20):
        rows = [",".join(rng.choice(["0", "0", "1", "NA"]) for _ in range(8)) + "\n" for _ in range(60)]
        yield f"csv{i}", "a,b,c,d,e,f,g,h\n" + "".join(rows)


def simulated(n: int = 300) -> Iterator[tuple[str, str]]:
    """The simulator's ordinary answers (simulator/texts.py), reasoning then answer, as streamed."""
    lengths = LengthModel(37, 2048, 1.0)
    for i in range(n):
        key = f"corpus-{i}"
        tokens = min(16_384, lengths.draw(key))
        script = Script(37, key, tokens, tokens // 3)
        reasoning, content = script.separated(tokens)
        yield f"sim:{key}", (reasoning or "") + content


def corpus() -> list[tuple[str, str]]:
    return [*bundled(), *repetitive(random.Random(37)), *simulated(), *stdlib()]


def first_verdict(text: str, cfg: GuardConfig) -> str | None:
    guard = LoopGuard(cfg)
    n = 0
    for n, tok in enumerate(tokens(text), start=1):
        if guard.feed(tok, n) is not None:
            break
    v = guard.verdict or guard.flush()
    return None if v is None else f"period {v.period} x{v.repeats}: {v.text[:60]!r}"


def test_no_false_positive_on_ordinary_answers() -> None:
    answers = corpus()
    assert len(answers) >= 2000
    assert sum(1 for name, _ in answers if name.startswith("sim:")) == 300
    cfg = GuardConfig()
    false = [(name, why) for name, text in answers if (why := first_verdict(text, cfg))]
    assert false == []


def test_every_period_up_to_300_tokens_is_cut() -> None:
    """Periods 1..300, each after a piece of an ordinary answer: all cut, within the thresholds of the
    onset (plus the check interval, and the drift of characters per token between text and loop)."""
    cfg = GuardConfig()
    rng = random.Random(300)
    ordinary = [text for _, text in bundled() if len(text) > 2000]
    missed, late = [], []
    for period in range(1, cfg.max_period_tokens + 1):
        prefix = tokens(rng.choice(ordinary)[:rng.randrange(100, 2000)])
        cycle = [f" v{rng.randrange(50_000)}" for _ in range(period)]
        need = max(cfg.min_span_tokens, cfg.min_repeats * period)
        guard = LoopGuard(cfg)
        seq = prefix + cycle * (need // period + 10)
        at = None
        for n, tok in enumerate(seq, start=1):
            if guard.feed(tok, n) is not None:
                at = n
                break
        if at is None:
            missed.append(period)
        elif at - len(prefix) > need * 1.25 + 16:
            late.append((period, at - len(prefix), need))
    assert missed == [] and late == [], (missed, late[:20], len(late))
