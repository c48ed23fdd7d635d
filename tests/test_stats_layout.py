"""The conf and stats hashes have one schema (shared/stats.py): every Lua script and every Python
module reads and writes only its fields. Parses the scripts (no Redis needed for that part)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from budgetq.shared import budget, jobs
from budgetq.shared.config import DatasetConfig
from budgetq.shared.stats import ENDING_STATS, REOPEN_STATS, REQUEUE_STATS, Conf, Stat

ROOT = Path(__file__).resolve().parent.parent
LUA = sorted((ROOT / "shared" / "lua").glob("*.lua"))
WRITES = {"HINCRBY", "HSET", "HSETNX", "HDEL", "HINCRBYFLOAT"}
READS = {"HGET", "HMGET"}
# Counted from Python, not by any script: retries (worker/recorder.py), invalid, filtered and
# enqueued rows (producer/run/producer.py), AbandonedJobError recoveries (maintenance).
PYTHON_STATS = {Stat.RETRIED, Stat.INVALID, Stat.RECOVERED, Stat.ENQUEUED, Stat.FILTERED}
# Conf fields no script reads: bookkeeping for status and the producer.
PYTHON_CONF = {Conf.REGISTERED_AT, Conf.ID_SCHEME, Conf.ID_FIELD, Conf.SOURCE_ENDED, Conf.CFG_LIMIT,
               Conf.SOURCE_ROWS, Conf.SOURCE_ESTIMATED, Conf.SOURCE_LIMIT, Conf.INTERRUPTED, Conf.OWN_BUDGET,
               Conf.QUALITY, Conf.SAMPLES}


@dataclass
class Fields:
    literal: dict[str, set[str]] = field(default_factory=lambda: {"conf": set(), "stats": set()})
    written: dict[str, set[str]] = field(default_factory=lambda: {"conf": set(), "stats": set()})
    from_argv: dict[str, set[int]] = field(default_factory=lambda: {"conf": set(), "stats": set()})


def _header_keys(src: str) -> dict[int, str]:
    """KEYS index -> 'conf' | 'stats', from the script's header comment."""
    header = "\n".join(line for line in src.splitlines() if line.startswith("--"))
    keys_doc = header.split("KEYS:", 1)[1].split("ARGV:", 1)[0] if "KEYS:" in header else ""
    return {int(n): what for n, what in re.findall(r"(\d+) (?:budgetq )?(conf|stats)\b", keys_doc)}


def _calls(src: str) -> list[list[str]]:
    """Arguments (as source text) of every redis.call(...), nested parentheses respected."""
    code = "\n".join(line.split("--", 1)[0] for line in src.splitlines())
    out = []
    for m in re.finditer(r"redis\.call\(", code):
        depth, args, cur = 1, [], ""
        for ch in code[m.end():]:
            if ch in "({[":
                depth += 1
            elif ch in ")}]":
                depth -= 1
                if depth == 0:
                    break
            if ch == "," and depth == 1:
                args.append(cur.strip())
                cur = ""
            else:
                cur += ch
        args.append(cur.strip())
        out.append(args)
    return out


# Item scripts sum their stats counters in a Lua table and write it once per call:
# ``bump('field', n)`` (commit.lua) or ``stats[a[N]]`` (finish.lua: a field from item argument N),
# then ``for field, by in pairs(stats) do redis.call('HINCRBY', KEYS[k], field, by) end``.
DEFERRED_FIELD = "field"


def lua_fields(path: Path) -> Fields:
    src = path.read_text()
    which = _header_keys(src)
    got = Fields()
    code = "\n".join(line.split("--", 1)[0] for line in src.splitlines())
    for name in re.findall(r"\bbump\('([^']*)'", code):
        got.literal["stats"].add(name)
        got.written["stats"].add(name)
    for n in re.findall(r"\bstats\[a\[(\d+)\]\]", code):
        got.from_argv["stats"].add(int(n))
    for args in _calls(src):
        cmd = args[0].strip("'\"").upper()
        if len(args) < 2 or cmd not in WRITES | READS:
            continue
        m = re.fullmatch(r"KEYS\[(\d+)\]", args[1])
        if not m or int(m.group(1)) not in which:
            continue
        h = which[int(m.group(1))]
        names = args[2::2] if cmd == "HSET" else args[2:] if cmd in ("HMGET", "HDEL") else args[2:3]
        for a in names:
            if a == DEFERRED_FIELD and cmd == "HINCRBY" and h == "stats":
                continue  # the fields summed above
            if lit := re.fullmatch(r"'([^']*)'", a):
                got.literal[h].add(lit.group(1))
                if cmd in WRITES:
                    got.written[h].add(lit.group(1))
            elif argv := re.fullmatch(r"ARGV\[(\d+)\]", a):
                got.from_argv[h].add(int(argv.group(1)))
            else:
                raise AssertionError(f"{path.name}: field {a!r} of {cmd} on {h} is neither a literal nor ARGV")
    return got


# Which of the two hashes each script touches. A new script goes here: its header must name
# the conf / stats key among its KEYS so the checks below see what it does to them.
TOUCHES = {"adjust": set(), "adopt": {"stats"}, "claim": set(), "commit": {"conf", "stats"},
           "finish": {"stats"}, "release": {"stats"}, "reopen": {"stats"}, "requeue": {"stats"},
           "reserve": {"conf", "stats"}, "features_mark": set(),
           "withdraw": {"conf", "stats"}}


def test_the_header_names_the_conf_and_stats_keys_of_every_script_that_touches_them():
    assert {p.stem for p in LUA} == set(TOUCHES), "add the new script to TOUCHES"
    for p in LUA:
        src = p.read_text()
        which = _header_keys(src)
        touched = {which[int(n)] for n in re.findall(r"KEYS\[(\d+)\]", src) if int(n) in which}
        assert touched == TOUCHES[p.stem], p.name


def test_every_field_a_script_reads_or_writes_is_documented():
    for p in LUA:
        f = lua_fields(p)
        assert f.literal["stats"] <= set(Stat), f"{p.name}: undocumented stats fields {f.literal['stats'] - set(Stat)}"
        assert f.literal["conf"] <= set(Conf), f"{p.name}: undocumented conf fields {f.literal['conf'] - set(Conf)}"
        assert not f.from_argv["conf"], f"{p.name}: a conf field from ARGV"


def test_the_documented_fields_are_exactly_the_ones_written():
    by_script = {p.stem: lua_fields(p) for p in LUA}
    # Only finish.lua, requeue.lua and reopen.lua count a field named in ARGV, and their Python
    # wrappers accept only ENDING_STATS / REQUEUE_STATS / REOPEN_STATS (checked below).
    assert {s: f.from_argv["stats"] for s, f in by_script.items() if f.from_argv["stats"]} == \
        {"finish": {16}, "requeue": {3}, "reopen": {3}}
    lua_stats = set().union(*(f.written["stats"] for f in by_script.values()))
    assert lua_stats | ENDING_STATS | REQUEUE_STATS | REOPEN_STATS | PYTHON_STATS == set(Stat)
    lua_conf = set().union(*(f.literal["conf"] for f in by_script.values()))
    assert lua_conf | PYTHON_CONF == set(Conf)


def test_the_python_wrappers_refuse_a_counter_that_is_not_theirs():
    c = jobs.Claimed("D-p0", "e1", b"")
    with pytest.raises(ValueError, match="not an ending counter"):
        jobs.finish("D", c, jobs.JobEnd(jobs.Ending.FAILED, stat=Stat.COMMITTED), 0.0, "w")
    with pytest.raises(ValueError, match="not a requeue counter"):
        jobs.requeue("D", c.member, c.job_id, Stat.SKIPPED)
    with pytest.raises(ValueError, match="not a reopen counter"):
        jobs.reopen("D", "rq:canceled:bq-D", Stat.SKIPPED)
    for reason in jobs.Skip:
        end = jobs.JobEnd.skip(reason)
        # an abort is requeued (requeue.lua counts it), a budget skip ends the job (finish.lua)
        assert end.stat in (REQUEUE_STATS if reason.aborted else ENDING_STATS)
        assert jobs.finish("D", c, end, 0.0, "w").script == ("requeue" if reason.aborted else "finish")
    assert jobs.JobEnd.failed("x").stat in ENDING_STATS


def _python_field_args() -> list[tuple[str, int, ast.expr]]:
    """(file, line, field argument) of every hincrby / hset / hsetnx on a stats or conf key."""
    out = []
    for pkg in ("shared", "worker", "producer", "budgetq", "simulator"):
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("hincrby", "hset", "hsetnx") and len(node.args) >= 2):
                    continue
                key = node.args[0]
                if isinstance(key, ast.Call) and getattr(key.func, "attr", getattr(key.func, "id", "")) in (
                        "stats_key", "conf_key"):
                    out.append((str(path.relative_to(ROOT)), node.lineno, node.args[1]))
    return out


def test_python_writes_only_documented_fields():
    found = _python_field_args()
    assert len(found) >= 4, found  # the scan sees the writers (retries, retry-failed, invalid, pause, ...)
    members = {m.value for m in Stat} | {m.value for m in Conf}
    for where, line, arg in found:
        if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id in ("Stat", "Conf"):
            assert arg.attr in (Stat.__members__ if arg.value.id == "Stat" else Conf.__members__), (where, line)
        elif isinstance(arg, ast.Constant):
            # a literal (modules owned elsewhere still spell some): it must be a member's name
            assert arg.value in members, f"{where}:{line}: {arg.value!r} is not in shared/stats.py"
        else:
            # a variable: its type is Stat / Conf (mypy checks it), e.g. worker/recorder.py's flush
            assert isinstance(arg, ast.Name), f"{where}:{line}: field is {ast.dump(arg)}"


def test_register_dataset_writes_only_conf_fields(conn):
    budget.register_dataset(conn, DatasetConfig(name="D", path="x", budget=1000, sampling={"max_tokens": 64},
                                                prior_mean_tokens=10))
    fields = {k.decode() for k in conn.hkeys("bq:{D}:conf")}
    assert fields and fields <= set(Conf)
