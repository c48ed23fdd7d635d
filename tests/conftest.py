"""Fixtures: one private redis-server per test session, flushed per test (never a shared one)."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest
import redis

from budgetq.shared.logs import forget_secrets
from budgetq.simulator.local import LocalRedis, LocalSim
from tests.ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 - hooks (CI=true: no skips)
from tests.vllm_server import (
    SHARED_FLAGS,
    START_TIMEOUT_S,
    VllmServer,
    prestart,
    run_dir,
    shared_server,
    smollm2_hf_dir,
    stop_shared,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _forget_secrets():
    """shared.logs keeps registered secrets in a process-wide set: empty it after every test."""
    yield
    forget_secrets()


@pytest.fixture(scope="session")
def redis_server():
    server = LocalRedis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()  # our private server only
    return redis_server.url


@pytest.fixture
def conn(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url)



@pytest.fixture
def sim_factory():
    """Start `budgetq sim` subprocesses; returns their base URLs; stops them after the test."""
    sims: list[LocalSim] = []

    def start(*extra: str) -> str:
        sims.append(LocalSim(*extra, cwd=ROOT))
        return sims[-1].url

    yield start
    for s in sims:
        s.stop()


@pytest.fixture(scope="session")
def specforge_offline():
    """SpecForge's own offline-data loader (tests/specforge_helper.py), or a skip saying why it cannot run."""
    from tests.specforge_helper import SpecForgeUnavailable, load_specforge_offline

    try:
        return load_specforge_offline()
    except SpecForgeUnavailable as exc:
        pytest.skip(f"SpecForge's own offline loader not run: {exc}")


@pytest.fixture(scope="session")
def vllm(request):
    """One real vLLM server (its CPU build, SmolLM2-135M) for the whole test run, shared by every
    pytest-xdist process (tests/vllm_server.py ``shared_server``); stopped when the run ends."""
    return shared_server(run_dir(request.config))


@pytest.fixture
def vllm_fp32():
    """A vLLM server of the test's own, in float32 (SmolLM2-135M), for tests whose claim is about text or
    timing, not bf16 numerics. On a CPU without AVX-512 BF16 (this machine: AVX2 only) vLLM's bf16 path is
    about 5x slower: 23.2 tok/s against 112.7 in float32, 16 requests in flight, one server at a time,
    quiet machine (docs/vllm.md). tests/test_guard_vllm.py's 96 answers at temperature 0.7 took over
    900 s in the shared bf16 server during a full suite (238 s alone in float32; its 24 greedy answers
    322 s against 105 s), and the pause test's engine steps were long enough that vLLM was last seen
    running 1.07 s after the pause (its bound is 1 s). The shared server stays bf16 for the hidden-state
    tests, whose bounds are bf16's. Its start is outside the tests' func_only timeouts."""
    server = VllmServer(smollm2_hf_dir(), *SHARED_FLAGS, "--dtype", "float32")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def vllm_alone(vllm, request):
    """The run's vLLM server with no other test's requests on it: for a test that reads the
    engine's own gauges (num_requests_running). Other vLLM tests hold the same lock shared."""
    with open(run_dir(request.config) / "vllm-server.use", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield vllm


@pytest.fixture(autouse=True)
def _vllm_shared_use(request):
    """Tests that use the shared server (but not alone) hold its use lock shared."""
    if "vllm" not in request.fixturenames or "vllm_alone" in request.fixturenames:
        yield
        return
    with open(run_dir(request.config) / "vllm-server.use", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        yield


_PRESTART = pytest.StashKey[threading.Thread]()


def _vllm_servers_needed(config: pytest.Config) -> tuple[bool, bool]:
    """(plain, hidden states): which of the run's vLLM servers the selected tests use, where that is plain from
    the command line (the whole suite, or tests/test_vllm_* files; not with a -k or -m filter)."""
    if config.option.keyword or config.option.markexpr or (ROOT / ".venv-vllm.skip").exists():
        return False, False
    paths = [Path(a.split("::")[0]).resolve() for a in config.args] or [Path.cwd()]
    whole = any(p in (ROOT, ROOT / "tests") for p in paths)
    features = whole or any(p.name == "test_vllm_features.py" for p in paths)
    plain = whole or any(p.name.startswith("test_vllm_") and p.name != "test_vllm_features.py" for p in paths)
    return plain, features and not os.environ.get("BUDGETQ_TEST_VLLM_HS_URL")


def pytest_sessionstart(session):
    """The controller (or pytest alone) starts the run's vLLM servers at once, beside the first tests."""
    if not hasattr(session.config, "workerinput") and any(needed := _vllm_servers_needed(session.config)):
        session.config.stash[_PRESTART] = prestart(run_dir(session.config), *needed)


def pytest_sessionfinish(session):
    """The process that outlives the others (xdist's controller, or pytest alone) stops the servers, once a
    start still under way has finished (it would otherwise leave its server running)."""
    if not hasattr(session.config, "workerinput"):
        thread = session.config.stash.get(_PRESTART, None)
        if thread is not None:
            thread.join(2 * START_TIMEOUT_S)
        stop_shared(run_dir(session.config))
