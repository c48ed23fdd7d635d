"""SpecForge's own data code (``specforge`` on PyPI), importable in tests without torch.

``load_specforge`` downloads the pinned wheel with ``pip download --no-deps`` (into
``$BUDGETQ_TEST_CACHE`` or ~/.cache/budgetq-tests; or takes ``$BUDGETQ_SPECFORGE_WHEEL``, a
wheel already on disk), unpacks it, and imports ``specforge.data.preprocessing`` (with
``parse`` and ``template``) from it, nothing vendored into the project. SpecForge needs torch
and its distributed helpers at import time: for the duration of the import, ``torch`` is a
small numpy-backed stub holding exactly what preprocessing's CPU path calls (``zeros``,
``ones_like``, ``long``, ``Tensor``), and ``specforge.distributed`` a stub of two getters the
online path never calls. The stubs leave ``sys.modules`` afterwards, so the rest of the test
session sees no torch. The tokenizer must hand back numpy arrays where SpecForge asks for
"pt" tensors: ``numpy_tensors`` does that for one tokenizer instance.

``load_specforge_offline`` imports SpecForge's offline training data path (the manifest reader, the
feature store, the loader, the EAGLE-3 normalisation and collator) from the same wheel with the real
torch, which it needs: the transformers capture backend's tests (tests/test_capture_hf.py) load
budgetq's ``specforge-offline`` export through it.

Also ``validate_row``: SpecForge's validator contract, restated (its scripts/ are not in
the wheel or the sdist, so it cannot be imported from the registry).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

SPECFORGE_VERSION = "0.2.0"   # pinned: the field contract the tests check is this release's


class SpecForgeUnavailable(RuntimeError):
    """The wheel could not be downloaded (no network, no index): tests skip with this reason."""


def _cache() -> Path:
    return Path(os.environ.get("BUDGETQ_TEST_CACHE") or Path.home() / ".cache" / "budgetq-tests")


def _wheel() -> Path:
    given = os.environ.get("BUDGETQ_SPECFORGE_WHEEL")
    if given:
        if not Path(given).is_file():
            raise SpecForgeUnavailable(f"BUDGETQ_SPECFORGE_WHEEL={given} is not a file")
        return Path(given)
    where = _cache() / f"specforge-{SPECFORGE_VERSION}"
    found = sorted(where.glob("specforge-*.whl"))
    if found:
        return found[0]
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           f"specforge=={SPECFORGE_VERSION}", "-d", str(where)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SpecForgeUnavailable(f"pip download specforge=={SPECFORGE_VERSION} failed: {exc}") from None
    found = sorted(where.glob("specforge-*.whl"))
    if done.returncode or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SpecForgeUnavailable(f"pip download specforge=={SPECFORGE_VERSION} failed: {tail[0]}")
    return found[0]


def _unpacked(wheel: Path) -> Path:
    """The wheel's files, unpacked once into the cache."""
    root = _cache() / f"specforge-{SPECFORGE_VERSION}-src"
    if not (root / "specforge" / "data" / "preprocessing.py").exists():
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(root)
    return root


def _torch_stub() -> dict[str, types.ModuleType]:
    """What ``import torch`` must provide for specforge.data's CPU preprocessing, on numpy."""
    torch = types.ModuleType("torch")
    torch.Tensor = np.ndarray
    torch.long = np.int64
    torch.zeros = lambda n, dtype=None: np.zeros(n, dtype=dtype or np.float32)
    torch.ones_like = np.ones_like
    nn = types.ModuleType("torch.nn")
    functional = types.ModuleType("torch.nn.functional")
    nn.functional = functional
    torch.nn = nn
    utils = types.ModuleType("torch.utils")
    data = types.ModuleType("torch.utils.data")
    data.Dataset = type("Dataset", (), {})
    utils.data = data
    torch.utils = utils
    dist = types.ModuleType("torch.distributed")
    torch.distributed = dist
    return {"torch": torch, "torch.nn": nn, "torch.nn.functional": functional, "torch.utils": utils,
            "torch.utils.data": data, "torch.distributed": dist}


def _package(name: str, path: Path) -> types.ModuleType:
    """A package shell: its submodules import from ``path`` without running its __init__."""
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    return mod


def load_specforge() -> types.SimpleNamespace:
    """SpecForge's preprocessing, parse and template modules from the PyPI wheel."""
    root = _unpacked(_wheel())
    distributed = types.ModuleType("specforge.distributed")
    distributed.get_draft_sp_group = distributed.get_sp_ring_group = lambda *a, **k: None
    shells = {"specforge": _package("specforge", root / "specforge"),
              "specforge.data": _package("specforge.data", root / "specforge" / "data"),
              "specforge.distributed": distributed}
    # SpecForge's other imports, loaded first: they probe for torch and must find none.
    import datasets  # noqa: F401
    import tqdm  # noqa: F401
    import transformers  # noqa: F401

    stubs = _torch_stub()
    saved = {name: sys.modules.get(name) for name in [*stubs, *shells]}
    sys.modules.update(stubs)
    sys.modules.update(shells)
    try:
        pre = importlib.import_module("specforge.data.preprocessing")
        parse = importlib.import_module("specforge.data.parse")
        template = importlib.import_module("specforge.data.template")
    finally:
        for name, mod in saved.items():
            if name.startswith("specforge"):
                continue   # specforge's own modules stay importable (datasets' map pickles by name)
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return types.SimpleNamespace(preprocessing=pre, parse=parse, template=template, root=root)


def load_specforge_offline() -> types.SimpleNamespace:
    """SpecForge's offline training data path, with the real torch (it ``torch.load``s the .ckpt files), as
    its trainer assembles it (specforge/launch.py, the offline runtime; the EAGLE-3 providers,
    specforge/algorithms/eagle3/data.py): ``OfflineManifestReader`` lists the files,
    ``LocalFeatureStore`` reads them, ``FeatureDataLoader`` applies ``normalize_offline_sample`` and
    collates with ``DataCollatorWithPadding``; also the older ``OfflineEagle3Dataset``.

    Imported from the same wheel in module shells of its own: ``load_specforge`` may have left its
    torch-stubbed ``specforge.*`` modules in ``sys.modules``, and they stay as they were.
    ``specforge.distributed`` is a stub (its real module imports the training stack; the data path
    without process groups calls none of it)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SpecForgeUnavailable("torch is not installed (SpecForge's offline loader torch.loads files)") from None
    root = _unpacked(_wheel())
    distributed = types.ModuleType("specforge.distributed")
    distributed.get_draft_sp_group = distributed.get_sp_ring_group = lambda *a, **k: None
    distributed.get_sp_ulysses_group = lambda *a, **k: None
    shells = {"specforge": _package("specforge", root / "specforge"),
              "specforge.distributed": distributed}
    wanted = {"preprocessing": "specforge.data.preprocessing", "utils": "specforge.data.utils",
              "eagle3": "specforge.algorithms.eagle3.data",
              "reader": "specforge.runtime.data_plane.offline_reader",
              "store": "specforge.runtime.data_plane.feature_store",
              "loader": "specforge.runtime.data_plane.feature_dataloader"}
    saved = {name: mod for name, mod in sys.modules.items() if name == "specforge" or name.startswith("specforge.")}
    for name in saved:
        del sys.modules[name]
    sys.modules.update(shells)
    try:
        mods = {key: importlib.import_module(name) for key, name in wanted.items()}
    finally:
        for name in [n for n in sys.modules if n == "specforge" or n.startswith("specforge.")]:
            del sys.modules[name]
        sys.modules.update(saved)
    return types.SimpleNamespace(
        OfflineManifestReader=mods["reader"].OfflineManifestReader, LocalFeatureStore=mods["store"].LocalFeatureStore,
        FeatureDataLoader=mods["loader"].FeatureDataLoader,
        normalize_offline_sample=mods["eagle3"].normalize_offline_sample,
        DataCollatorWithPadding=mods["utils"].DataCollatorWithPadding,
        OfflineEagle3Dataset=mods["preprocessing"].OfflineEagle3Dataset,
        list_local_files=mods["preprocessing"].list_local_files, root=root)


def numpy_tensors(tokenizer: Any) -> Any:
    """``tokenizer`` answering ``return_tensors="pt"`` with numpy arrays (there is no torch)."""
    base = type(tokenizer)

    class NumpyTensors(base):  # type: ignore[misc, valid-type]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("return_tensors") == "pt":
                kwargs["return_tensors"] = "np"
            return super().__call__(*args, **kwargs)

    tokenizer.__class__ = NumpyTensors
    return tokenizer


def validate_row(row: dict[str, Any], *, expect_reasoning: bool = False) -> int:
    """SpecForge's row check, restated: scripts/validate_regenerated_data.py ``validate_row``
    with scripts/conversation_validation.py ``validate_conversation`` (sgl-project/SpecForge,
    main as of 2026-12). Raises ValueError with SpecForge's message; returns the assistant count.
    """
    if not isinstance(row.get("id"), str) or not row["id"].strip():
        raise ValueError("id must be a non-empty string")
    if row.get("status") != "success":
        raise ValueError("status must be 'success'")
    messages = row.get("conversations")
    if not isinstance(messages, list) or not messages:
        raise ValueError("conversations must be a non-empty list")
    expected, saw_user = "user", False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {index} must be an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"message {index} content must be a non-empty string")
        if role == "system" and not saw_user:
            continue
        if role not in {"user", "assistant"}:
            raise ValueError(f"message {index} has unsupported role {role!r}")
        if role != expected:
            raise ValueError(f"message {index} expected role {expected!r}, got {role!r}")
        saw_user = True
        expected = "assistant" if role == "user" else "user"
    if not saw_user:
        raise ValueError("conversation has no user message")
    count = 0
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        count += 1
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"assistant message {index} reasoning_content must be a string or null")
        if expect_reasoning and (not isinstance(reasoning, str) or not reasoning.strip()):
            raise ValueError(f"assistant message {index} has empty reasoning_content")
    if count == 0:
        raise ValueError("conversation has no assistant message")
    if messages[-1].get("role") != "assistant":
        raise ValueError("conversation must end with an assistant message")
    return count
