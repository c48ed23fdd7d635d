"""The ``transformers`` capture backend: the target model in the features worker, no JSON anywhere.

The worker loads features.model once; each claimed job queues its token ids here, a loop packs
what is queued into batches by token count (padding included, features.model.max_batch_tokens)
and runs one forward pass per batch in a thread (torch releases the GIL: the event loop keeps
claiming, XADDing and heartbeating meanwhile). What a pass caught becomes bytes in a second thread
while the next pass runs (``keep``, then ``unpack``): the forward thread does nothing but passes.
The bytes are views of the batch's host tensors, sent to Redis without a copy; on an accelerator one
copy per tensor per batch brings them to host memory. Forward hooks sit on exactly the layers needed:

- EAGLE-3's three aux layers, numbered as SpecForge numbers them: the output of decoder layer i,
  default ``[1, L // 2 - 1, L - 4]`` (SpecForge specforge/modeling/target/eagle3_target_model.py
  ``Eagle3TargetModel.set_aux_hidden_states_layers``; its HF backend ``generate_eagle3_data``
  hooks those layers' outputs). SGLang captures the same tensors: sglang/srt/models/llama.py
  ``set_eagle3_layers_to_capture`` sets ``layers_to_capture = [2, L // 2, L - 3]`` (or ``id + 1``
  for given ids) and ``LlamaModel.forward`` captures the residual stream at the *input* of those
  layers, which is the output of the layer before. Concatenated in that order: ``[tokens, 3H]``;
- the target (``hidden_state``): the final norm's output, what SGLang's ``return_hidden_states``
  returns for Llama (``LlamaModel.forward`` returns the normed states to the logits processor,
  sglang/srt/layers/logits_processor.py ``_get_hidden_states_to_store``) and what SpecForge's
  offline training feeds its lm_head.

In the model's own ``output_hidden_states`` numbering (embeddings first) these are
``hidden_states[i + 1]`` for aux layer i and ``hidden_states[-1]`` for the target: tests check the
bytes written equal those, bit for bit. The lm_head is not loaded (AutoModel): no logits needed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from budgetq.hidden_states.capture.captured import Captured
from budgetq.hidden_states.capture.decode import HiddenStatesError
from budgetq.hidden_states.schema import FeaturesPayload, wire_dtype
from budgetq.shared.config import Config
from budgetq.shared.config_features import FeaturesModelConfig
from budgetq.shared.errors import ConfigError

log = logging.getLogger("budgetq.features")
# Set (bench/features.py): each forward pass appends a JSON line with its timings and sample lengths to this file.
PASS_LOG_ENV = "BUDGETQ_FEATURES_PASS_LOG"


def _torch() -> Any:
    """torch, imported when this backend is used: the http backend's workers never load it (the capture extra)."""
    import torch

    return torch


def torch_dtype(name: str) -> Any:
    return getattr(_torch(), name)  # float16, bfloat16, float32


def default_aux_layers(num_layers: int) -> list[int]:
    """SpecForge's (and SGLang's) EAGLE-3 aux layers of an L-layer model, as decoder-layer outputs."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def aux_layers_for(num_layers: int, given: list[int] | None) -> list[int]:
    layers = default_aux_layers(num_layers) if given is None else list(given)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad or len(set(layers)) != len(layers):
        raise ConfigError(f"features.model.aux_layers {layers}: each must be a distinct decoder layer in "
                          f"[0, {num_layers - 1}] (the model has {num_layers} layers; set features.model.aux_layers)")
    return layers


def decoder_parts(model: Any) -> tuple[Any, Any]:
    """(the decoder layers' ModuleList, the final norm) of a transformers base model (Llama, Qwen, Mistral...)."""
    base = model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model
    layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
    if layers is None or norm is None:
        raise ConfigError(f"{type(model).__name__}: no .layers and .norm to hook (a decoder-only transformers "
                          "model is needed for the transformers capture backend)")
    return layers, norm


class HookedModel:
    """A loaded base model with forward hooks on the aux layers and the final norm; ``run`` is one pass."""

    def __init__(self, model: Any, aux_layers: list[int] | None, out_dtype: str) -> None:
        self.model = model
        self.layers, self.norm = decoder_parts(model)
        self.aux = aux_layers_for(len(self.layers), aux_layers)
        self.out_dtype = torch_dtype(out_dtype)
        self.hidden = int(model.config.hidden_size)
        self.vocab = int(model.config.vocab_size)
        self.device = model.get_input_embeddings().weight.device
        self._got: dict[int | str, Any] = {}
        self.handles = [self.layers[i].register_forward_hook(self._keep(i)) for i in self.aux]
        self.handles.append(self.norm.register_forward_hook(self._keep("norm")))

    def _keep(self, key: int | str) -> Callable[..., None]:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            # Decoder layers return a tensor (transformers 5) or a tuple whose first element it is.
            self._got[key] = output[0] if isinstance(output, tuple) else output
        return hook

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def forward(self, batch: list[list[int]]) -> None:
        """The bare pass over a right-padded batch (the bench times this one with the hooks removed)."""
        torch = _torch()
        longest = max(len(ids) for ids in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, sample in enumerate(batch):
            ids[row, :len(sample)] = torch.tensor(sample, dtype=torch.long)
            mask[row, :len(sample)] = 1
        with torch.inference_mode():
            self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)

    def keep(self, batch: list[list[int]]) -> Kept:
        """The pass with its hooks (the forward thread): the tensors they caught. On an accelerator the rest of
        this batch's device work (cast, concatenation, finiteness) and its one copy to host memory are done
        here, queued behind the pass and before the next one; on the CPU that work is left to ``unpack``,
        which runs in another thread beside the next pass."""
        self._got.clear()
        try:
            self.forward(batch)
            kept = Kept([len(s) for s in batch], self._got["norm"], [self._got[i] for i in self.aux])
        finally:
            self._got.clear()
        if self.device.type != "cpu":
            self._to_host(kept)
        return kept

    def _to_host(self, kept: Kept) -> None:
        """Cast, concatenate the aux layers, flag each sample finite or not, all for the whole batch at once,
        then one copy per tensor to host memory (one device sync per batch, not several per sample)."""
        torch = _torch()
        target = kept.target.to(self.out_dtype).contiguous()
        aux = (torch.cat([t.to(target.device) for t in kept.layers], dim=-1).to(self.out_dtype)
               if kept.layers else None)
        lengths = torch.tensor(kept.lengths, device=target.device)
        padding = torch.arange(target.shape[1], device=target.device)[None, :] >= lengths[:, None]
        finite = torch.isfinite(target).all(-1)
        if aux is not None:
            finite &= torch.isfinite(aux).all(-1)
        kept.finite = (finite | padding).all(-1).cpu().tolist()
        kept.target, kept.aux, kept.layers = target.cpu(), aux.cpu() if aux is not None else None, []

    def unpack(self, kept: Kept) -> list[Captured | HiddenStatesError]:
        """Per sample its target and aux rows (padding cut), as views of the batch's host tensors (no copy:
        the worker's XADD reads them), or why it failed."""
        if kept.finite is None:
            self._to_host(kept)
        assert kept.finite is not None
        torch = _torch()
        target = kept.target.view(torch.int16)  # numpy has no bfloat16: the bytes travel as int16
        aux = kept.aux.view(torch.int16) if kept.aux is not None else None
        out: list[Captured | HiddenStatesError] = []
        for row, n in enumerate(kept.lengths):
            if not kept.finite[row]:
                out.append(HiddenStatesError("hidden states hold NaN or inf"))
                continue
            a = aux[row, :n] if aux is not None else None
            out.append(Captured(_view(target[row, :n]), [n, int(target.shape[-1])],
                                _view(a) if a is not None else None,
                                [n, int(a.shape[-1])] if a is not None else None, endpoint="transformers"))
        return out

    def run(self, batch: list[list[int]]) -> list[Captured | HiddenStatesError]:
        """One pass and its unpacking, in this thread (tests, the warm-up pass)."""
        return self.unpack(self.keep(batch))


@dataclass
class Kept:
    """One pass's tensors on their way from the hooks to the bytes: ``target`` [B, T, H]; ``layers`` the aux
    layers' outputs until ``_to_host`` makes them ``aux`` [B, T, 3H]; ``finite`` per sample, set there too."""

    lengths: list[int]
    target: Any
    layers: list[Any]
    aux: Any = None
    finite: list[bool] | None = None


def _view(t: Any) -> memoryview:
    """The little-endian bytes of a contiguous 2-D int16 tensor on the host, without a copy. The view keeps the
    batch's tensor alive until the sample is XADDed; redis-py sends a memoryview as it is (bytes would be
    copied once more into one packed command)."""
    return memoryview(t.numpy()).cast("B")


def load_model(m: FeaturesModelConfig, out_dtype: str) -> HookedModel:
    from transformers import AutoModel

    kwargs: dict[str, Any] = {"dtype": torch_dtype(m.dtype or out_dtype), "trust_remote_code": m.trust_remote_code}
    if m.attn_implementation:
        kwargs["attn_implementation"] = m.attn_implementation
    if m.device_map:
        kwargs["device_map"] = m.device_map
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists lm_head as unexpected: not loaded on purpose
    hf_logging.disable_progress_bar()   # a bar per load in the worker's log
    try:
        model = AutoModel.from_pretrained(m.path, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"features.model.path {m.path!r}: cannot load the model: {first}") from None
    finally:
        hf_logging.set_verbosity(before)
        hf_logging.enable_progress_bar()
    if not m.device_map:
        model = model.to(m.device)
    model.eval()
    return HookedModel(model, m.aux_layers, out_dtype)


@dataclass
class _Pending:
    ids: list[int]
    future: asyncio.Future
    queued_at: float = field(default_factory=time.monotonic)


def take_batch(pending: list[list[int]], max_tokens: int) -> int:
    """How many of the queued samples (in order) one pass takes: padded size len x longest within
    max_tokens; always at least one (a sample longer than the budget runs alone)."""
    longest, n = 0, 0
    for ids in pending:
        longest = max(longest, len(ids))
        if n and (n + 1) * longest > max_tokens:
            break
        n += 1
    return n


class TransformersBackend:
    name = "transformers"

    def __init__(self, cfg: Config) -> None:
        assert cfg.features.model is not None  # the config validator requires it for this backend
        self.m = cfg.features.model
        self.out_dtype = wire_dtype(cfg.features.dtype)  # fp8 is made from bf16 where the shard is written
        self.pending: list[_Pending] = []
        self.passes = 0            # forward passes run
        self.batched = 0           # samples they carried
        self.pass_log = os.environ.get(PASS_LOG_ENV)

    async def start(self) -> None:
        t0 = time.monotonic()
        self.hooked = await asyncio.to_thread(load_model, self.m, self.out_dtype)
        await asyncio.to_thread(self.hooked.run, [[0] * 8])  # a first pass now: lazy kernel set-up, a broken model
        log.info("features: %s loaded in %.1f s (%d layers, hidden %d, aux layers %s, on %s, %d torch threads)",
                 self.m.path, time.monotonic() - t0, len(self.hooked.layers), self.hooked.hidden, self.hooked.aux,
                 self.hooked.device, _torch().get_num_threads())
        # One pass at a time; a pass's tensors become bytes in a second thread while the next pass runs.
        self.forward_pool = ThreadPoolExecutor(1, thread_name_prefix="budgetq-forward")
        self.unpack_pool = ThreadPoolExecutor(1, thread_name_prefix="budgetq-unpack")
        self.wake = asyncio.Event()
        self.loop_task = asyncio.create_task(self._batches())

    def bytes_per_token(self) -> float:
        return 2.0 * self.hooked.hidden * (1 + len(self.hooked.aux))

    async def capture(self, payload: FeaturesPayload, job_id: str, hold: Callable[[int], None]) -> Captured:
        bad = next((i for i in payload.input_ids if not 0 <= i < self.hooked.vocab), None)
        if bad is not None:
            raise HiddenStatesError(f"token id {bad} is outside the model's vocabulary ({self.hooked.vocab}): "
                                    "server.tokenizer and features.model must be the same model")
        hold(int(len(payload.input_ids) * self.bytes_per_token()))
        p = _Pending(payload.input_ids, asyncio.get_running_loop().create_future())
        self.pending.append(p)
        self.wake.set()
        try:
            return await p.future
        finally:
            if p in self.pending:  # cancelled (the worker stops) before its pass
                self.pending.remove(p)

    async def _next_batch(self) -> list[_Pending]:
        while not self.pending:
            self.wake.clear()
            await self.wake.wait()
        # The other jobs' samples are on their way (claims, payloads): a short wait fills the batch.
        wait = self.m.batch_wait_s - (time.monotonic() - self.pending[0].queued_at)
        if wait > 0 and sum(len(p.ids) for p in self.pending) < self.m.max_batch_tokens:
            await asyncio.sleep(wait)
        n = take_batch([p.ids for p in self.pending], self.m.max_batch_tokens)
        batch, self.pending = self.pending[:n], self.pending[n:]
        return [p for p in batch if not p.future.done()]

    async def _batches(self) -> None:
        loop = asyncio.get_running_loop()
        unpacking: asyncio.Task | None = None
        try:
            while True:
                batch = await self._next_batch()
                if not batch:
                    continue
                started = time.time()
                try:
                    kept, fwd = await loop.run_in_executor(self.forward_pool, _timed, self.hooked.keep,
                                                           [p.ids for p in batch])
                except Exception as exc:  # noqa: BLE001 - out of memory, a device error: these jobs fail, saying why
                    self._fail(batch, f"forward pass of {len(batch)} samples failed: {_reason(exc)}")
                    continue
                if unpacking is not None:
                    # One pass's tensors are unpacked at a time (it ran beside this pass): the worker holds at
                    # most two passes' outputs.
                    await unpacking
                unpacking = asyncio.create_task(self._unpack(batch, kept, started, fwd))
        finally:
            if unpacking is not None:
                unpacking.cancel()
                await asyncio.gather(unpacking, return_exceptions=True)

    async def _unpack(self, batch: list[_Pending], kept: Kept, started: float, fwd: tuple[float, float]) -> None:
        try:
            results, unpacked = await asyncio.get_running_loop().run_in_executor(self.unpack_pool, _timed,
                                                                                 self.hooked.unpack, kept)
        except Exception as exc:  # noqa: BLE001 - a device error surfacing at the copy: these jobs fail, saying why
            self._fail(batch, f"reading the hidden states of {len(batch)} samples failed: {_reason(exc)}")
            return
        del kept
        self.passes += 1
        self.batched += len(batch)
        lengths = [len(p.ids) for p in batch]
        log.debug("features: pass of %d samples, %d tokens: forward %.3f s, unpack %.3f s", len(batch),
                  sum(lengths), fwd[0], unpacked[0])
        if self.pass_log:
            self._log_pass(started, fwd, unpacked, lengths)
        for p, r in zip(batch, results, strict=True):
            if p.future.done():
                continue
            if isinstance(r, Exception):
                p.future.set_exception(r)
            else:
                p.future.set_result(r)

    def _fail(self, batch: list[_Pending], msg: str) -> None:
        log.error("features: %s", msg)
        for p in batch:
            if not p.future.done():
                p.future.set_exception(HiddenStatesError(msg))

    def _log_pass(self, started: float, fwd: tuple[float, float], unpacked: tuple[float, float],
                  lengths: list[int]) -> None:
        """One JSON line per pass (bench/features.py reads them: where the time goes, the batches to replay)."""
        assert self.pass_log is not None
        line = {"start": started, "forward_s": fwd[0], "forward_cpu_s": fwd[1], "unpack_s": unpacked[0],
                "unpack_cpu_s": unpacked[1], "lengths": lengths, "threads": _torch().get_num_threads()}
        with open(self.pass_log, "a") as fh:
            fh.write(json.dumps(line) + "\n")

    async def close(self) -> None:
        if hasattr(self, "loop_task"):
            self.loop_task.cancel()
            await asyncio.gather(self.loop_task, return_exceptions=True)
            self.forward_pool.shutdown(wait=True)
            self.unpack_pool.shutdown(wait=True)
            log.info("features: %d forward passes, %.1f samples each", self.passes,
                     self.batched / self.passes if self.passes else 0.0)


def _timed(fn: Callable[[Any], Any], arg: Any) -> tuple[Any, tuple[float, float]]:
    """``fn(arg)`` and (wall seconds, this thread's CPU seconds) it took."""
    t0, c0 = time.perf_counter(), time.thread_time()
    out = fn(arg)
    return out, (time.perf_counter() - t0, time.thread_time() - c0)


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
