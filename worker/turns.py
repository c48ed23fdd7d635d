"""regenerate: all: one job asks every user turn of a conversation in order, then commits once.

The loop mirrors SpecForge's scripts/regenerate_train_data.py (``call_sglang`` and
``build_query_kwargs``): system turns are kept, the dataset's assistant turns were already
dropped by the producer, each user turn is sent with the model's own earlier answers as
context, and those answers go into the context *without* their reasoning (SpecForge pops
``reasoning_content`` from earlier assistant turns; the row keeps it on each answer).

All requests of a job go to the client one after another, so the conversation's prefix is
in the server's cache for the next turn. One commit covers them all (worker/process.py
builds the row, commit.lua counts it): exactly-once, resume and the budget are those of any
job. What this costs on failure: a turn that fails (after the client's retries) fails the
whole job, and its retry starts again from turn 1, so up to (turns - 1) answers are generated
again (wasted tokens <= (turns - 1) x max_tokens per retry). A turn cut by max_tokens
(finish_reason length) ends the conversation there: a later turn would build on a cut answer.

api=generate: the first request's input_ids come from the producer; a later turn's need the
chat template applied to the model's own answers, so the worker loads ``server.tokenizer``
(shared/chat_template.py, once per process, only when a job has later turns).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from budgetq.shared.chat_template import encode_chat, load_tokenizer
from budgetq.shared.schema import JobPayload, Message
from budgetq.worker.sglang_client import SGLangClient
from budgetq.worker.sglang_wire import Completion, split_thinking


@dataclass(frozen=True)
class Conversation:
    """Every request of one regenerate: all job, in order; read like one Completion by commit."""

    outs: list[Completion]

    @property
    def prompt_tokens(self) -> int:
        return sum(o.prompt_tokens for o in self.outs)

    @property
    def completion_tokens(self) -> int:
        return sum(o.completion_tokens for o in self.outs)

    @property
    def finish_reason(self) -> str:
        return self.outs[-1].finish_reason   # "length": the conversation was cut there

    @property
    def endpoint(self) -> str:
        return self.outs[-1].endpoint

    @property
    def model(self) -> str:
        return self.outs[-1].model

    @property
    def latency_s(self) -> float:
        return sum(o.latency_s for o in self.outs)

    @property
    def lengths(self) -> list[int]:
        """Each request's completion tokens: what the length estimates learn from."""
        return [o.completion_tokens for o in self.outs]


Result = Completion | Conversation


def lengths(out: Result) -> list[int] | None:
    """Per-request completion lengths for commit.lua (None: a single request)."""
    return out.lengths if isinstance(out, Conversation) else None


def observe(length_model, out: Result) -> None:
    """Feed the decode-rate estimate per request, never a conversation's sum as one request."""
    for o in out.outs if isinstance(out, Conversation) else [out]:
        length_model.observe(o.completion_tokens, o.latency_s)


async def _input_ids(client: SGLangClient, payload: JobPayload, messages: list[Message]) -> list[int]:
    path = client.server.tokenizer
    if not path:  # config validation makes api=generate carry a tokenizer; a hand-made job may not
        raise ValueError("api=generate with turns needs server.tokenizer in the worker's config")
    tok = await asyncio.to_thread(load_tokenizer, path)
    return await asyncio.to_thread(encode_chat, tok, messages, payload.chat_template_kwargs or {})


async def send(client: SGLangClient, payload: JobPayload, job_id: str,
               on_turn: Callable[[int], None] | None = None) -> Result:
    """The job's result: one Completion, or with ``payload.turns`` a Conversation.

    ``on_turn(k)`` is called as request k (1-based) is sent, so the caller can time each
    request on its own (the taper's "generated so far" is per request).
    """
    if not payload.turns:
        return await client.complete(payload, job_id)
    context = list(payload.messages)
    request = payload.model_copy(update={"turns": None})
    outs: list[Completion] = []
    for k in range(1, payload.requests + 1):
        if k > 1:
            answer, _thinking = split_thinking(outs[-1])
            context = [*context, Message(role="assistant", content=answer), payload.turns[k - 2]]
            ids = await _input_ids(client, payload, context) if payload.input_ids is not None else None
            request = payload.model_copy(update={"messages": context, "input_ids": ids, "turns": None,
                                                 "prompt_tokens": None})
        if on_turn is not None:
            on_turn(k)
        out = await client.complete(request, job_id, turn=k)
        outs.append(out)
        if out.finish_reason == "length":
            break
    return Conversation(outs)
