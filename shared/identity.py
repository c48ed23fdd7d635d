"""Prompt ids and RQ job ids: one scheme, stable, collision-free, always RQ-legal.

- A **dataset name** fullmatches ``[A-Za-z0-9_]+(-[A-Za-z0-9_]+)*`` and has at most 64
  characters: no ``--``, no leading or trailing ``-``.
- A **prompt id** is any non-empty string (any Unicode but lone surrogates, which UTF-8
  cannot encode; any length), or an integer (a float only when it is integral, e.g. 3.0 from
  an Arrow int column with nulls -> 3). Booleans, lists, objects and null are rejected
  (``IdError``). An integer id stays an integer in the output row (``id_value``); its *key*,
  what job ids, done sets and the duplicate check use, is its string form (``id_text``: 12 ->
  "12"), so an integer id and the same digits as a string are one prompt, and state written
  when ids were strings only stays valid.
- A **job id** is ``<dataset>--<enc(id)>``. ``enc(id)`` is the id itself when it fullmatches
  ``[A-Za-z0-9_][A-Za-z0-9_-]{0,99}`` (readable in rq-dashboard), else
  ``-<32 hex of sha256(id)>-<readable ASCII prefix>``. The dataset name holds no ``--`` and
  does not end in ``-``, so the first ``--`` splits a job id unambiguously; a readable
  ``enc`` never starts with ``-`` and a hashed one always does, so the two never meet;
  two hashed ids collide only if 128 bits of sha256 do. Job ids never hold ``.`` (the
  worker appends ``.<hex>`` per attempt to make SGLang rids).
- An **answer id** (``samples: N``, docs/datasets.md "Samples per prompt"): a prompt's first answer
  keeps the prompt's id; its k-th (k >= 2) is the string ``<id>#<k>`` (``p7#2``, ``12#3``). A
  dataset with ``samples`` above 1 refuses, as an invalid row, every id that itself ends in
  ``#<digits>`` (``answer_suffix``), so an answer id can never be another prompt's id: the ids of
  such a dataset's prompts and the suffixed ids of their answers are disjoint sets by construction.
  Every answer then has its own job id, done-set member and row, through the rules above.
- ``legacy_job_id`` is the formula of earlier versions (``<dataset>-<clean>``), kept only so
  a producer can recognise jobs and done-set members written before the change
  (see producer/run/migrate.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from budgetq.shared.json_kind import kind

NAME_MAX = 64
NAME_PATTERN = re.compile(r"[A-Za-z0-9_]+(?:-[A-Za-z0-9_]+)*")
READABLE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,99}")
RQ_JOB_ID = re.compile(r"[A-Za-z0-9_-]+")  # rq.job.JOB_ID_PATTERN, fullmatch
SEPARATOR = "--"
# A dataset's hidden-states (features) jobs run under the name <ds><FEATURES_SUFFIX> (shared/keys.py
# features_name): no dataset may be named so, which keeps their queues and job ids apart.
FEATURES_SUFFIX = "-features"
HASH_HEX = 32
PREFIX_MAX = 40
# Conf-hash field naming the id scheme a dataset's Redis state was written with.
SCHEME_FIELD = "id_scheme"
# Conf-hash field recording where a dataset's ids come from (JSON: a field name, or null for
# content hashes), so a restart keeps them whatever the config's default (producer/run/id_rule.py).
ID_FIELD_FIELD = "id_field"
SCHEME = "2"
SCHEME_MIGRATED = "1+2"   # state of the old scheme exists: old job ids are recognised too
# The suffix that makes an answer id (k >= 2); ids matching it are refused where samples > 1.
ANSWER_SUFFIX = re.compile(r"#[0-9]+\Z")
SEED_MAX = 2**31  # derived seeds fit every engine's seed field (llama.cpp's is 32-bit, SGLang's and vLLM's int)
_UNSAFE = re.compile(r"[^A-Za-z0-9_]+")
_SURROGATE = re.compile("[\ud800-\udfff]")


def has_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


PromptId = str | int


class IdError(ValueError):
    """A prompt id or a dataset name that cannot be used; the message names it."""


def check_name(name: str) -> str:
    """``name`` if it is a valid dataset name, else IdError naming the value and the rule."""
    if not isinstance(name, str) or len(name) > NAME_MAX or not NAME_PATTERN.fullmatch(name):
        shown = name if not isinstance(name, str) or len(name) <= 80 else name[:80] + "..."
        why = f"is longer than {NAME_MAX} characters" if isinstance(name, str) and len(name) > NAME_MAX \
            else "may hold only letters, digits and '_', in parts joined by single '-'"
        raise IdError(f"dataset name {shown!r} {why}")
    if name.endswith(FEATURES_SUFFIX):
        # <ds>-features names dataset ds's hidden-states jobs (their queue, job ids and stats):
        # a dataset of that name would share them.
        raise IdError(f"dataset name {name!r} may not end in {FEATURES_SUFFIX!r}: that suffix names the "
                      f"hidden-states jobs of dataset {name[:-len(FEATURES_SUFFIX)]!r}")
    return name


def prompt_id(value: Any, field: str) -> str:
    """The key (string form) of an id field's value; IdError naming the field, type and value."""
    return id_text(id_value(value, field))


def id_text(pid: PromptId) -> str:
    """The key of a prompt id: the string itself, or an integer's decimal digits."""
    return pid if isinstance(pid, str) else str(pid)


def id_value(value: Any, field: str) -> PromptId:
    """An id field's value as the output row keeps it (a string, or an integer); IdError
    naming the field, type and value."""
    if isinstance(value, str):
        if value == "":
            raise IdError(f"id field {field!r} is empty")
        if lone := _SURROGATE.search(value):
            # json.loads accepts "\ud800"; no UTF-8 file, JSON row or HTTP body can hold it.
            raise IdError(f"id field {field!r} holds a lone surrogate ({lone.group()!a}), "
                          "which UTF-8 cannot encode")
        return value
    if isinstance(value, bool):
        raise IdError(f"id field {field!r} is a boolean ({value}), not a string or integer")
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise IdError(f"id field {field!r} is a non-integral number ({value!r}), not a string or integer")
    if hasattr(value, "item") and not isinstance(value, list | dict):  # numpy scalars
        return id_value(value.item(), field)
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:60] + "..."
    raise IdError(f"id field {field!r} is {kind(value)} ({shown}), not a string or integer")


def _utf8(text: str) -> bytes:
    # JSON may carry lone surrogates ("\ud800"); they must still hash, stably.
    return text.encode("utf-8", "surrogatepass")


def digest(pid: PromptId) -> bytes:
    """16 bytes identifying a prompt id (what the duplicate check keeps per id)."""
    return hashlib.sha256(_utf8(id_text(pid))).digest()[:16]


def encode_id(pid: PromptId) -> str:
    """The id part of a job id: the id itself if readable and RQ-legal, else a hash + prefix."""
    pid = id_text(pid)
    if READABLE.fullmatch(pid):
        return pid
    head = _UNSAFE.sub("_", pid.encode("ascii", "ignore").decode())[:PREFIX_MAX].strip("_")
    tail = f"-{head}" if head else ""
    return f"-{hashlib.sha256(_utf8(pid)).hexdigest()[:HASH_HEX]}{tail}"


def job_id(dataset: str, pid: PromptId) -> str:
    """The RQ job id of prompt ``pid`` of ``dataset``: unique per (dataset, id), stable."""
    return f"{dataset}{SEPARATOR}{encode_id(pid)}"


def split_job_id(jid: str) -> tuple[str, str]:
    """(dataset, encoded id) of a job id made by ``job_id``."""
    ds, sep, enc = jid.partition(SEPARATOR)
    if not sep:
        raise IdError(f"job id {jid!r} has no {SEPARATOR!r}")
    return ds, enc


def legacy_job_id(dataset: str, pid: PromptId) -> str:
    """The job id earlier versions gave (``<ds>-<clean>``): only to recognise their state."""
    pid = id_text(pid)
    clean = "".join(c if c.isalnum() or c in "_-" else "_" for c in pid)
    if clean != pid or len(clean) > 100:
        clean = clean[:60] + "-" + hashlib.sha256(_utf8(pid)).hexdigest()[:16]
    return f"{dataset}-{clean}"


def stable_id(row: dict[str, Any]) -> str:
    """A prompt id from the row's content, stable across runs and machines."""
    blob = json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(_utf8(blob)).hexdigest()[:24]


def answer_id(pid: PromptId, sample: int) -> PromptId:
    """The id of answer ``sample`` (1-based) of prompt ``pid``: the prompt's own id for the first,
    ``<id>#<sample>`` for the others (an integer id's later answers are strings: ``12#2``)."""
    if sample < 1:
        raise ValueError(f"sample index {sample} is not >= 1")
    return pid if sample == 1 else f"{id_text(pid)}#{sample}"


def answer_suffix(pid: PromptId) -> bool:
    """Whether ``pid`` looks like an answer id (ends in ``#<digits>``): refused where samples > 1."""
    return ANSWER_SUFFIX.search(id_text(pid)) is not None


def answer_seed(base: int | None, dataset: str, pid: PromptId, sample: int) -> int:
    """The sampling seed of answer ``sample`` of prompt ``pid``: a hash of the dataset's own seed
    (``sampling.seed``, 0 when unset), its name, the prompt's id and the sample index, so every
    answer samples differently and a rerun sends the same seed again."""
    blob = json.dumps([base or 0, dataset, id_text(pid), sample], ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(_utf8(blob)).digest()[:8], "big") % SEED_MAX
