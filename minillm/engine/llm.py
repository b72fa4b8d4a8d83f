"""``LLM``: the engine for a fixed batch of prompts, vLLM's offline API in miniature.

    llm = LLM("checkpoints/cpu")                       # or LLM(model) for a GPT module
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, temperature=0))
    print(outs[0].text)

Every prompt is queued at once; the engine then steps until all are done, so the batch the
model sees is as large as memory and budgets allow, and shrinks only as requests finish.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minillm.engine.build import build_engine
from minillm.engine.config import EngineConfig
from minillm.decoding.logprobs import TokenLogprobs
from minillm.model.gpt import GPT
from minillm.decoding.sampling import SamplingParams
from minillm.data.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    """One prompt's result: the generated text and tokens, and why generation ended; with
    ``SamplingParams.logprobs``, one :class:`TokenLogprobs` per generated token, and with
    ``prompt_logprobs``, one per prompt token after the first."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLM:
    """A model and an engine around it (:func:`~minillm.engine.build.build_engine` says what
    ``model``, ``device``, ``dtype``, ``quantize`` and ``speculative_draft`` take); the other
    keywords are :class:`EngineConfig` fields. With ``tensor_parallel_size`` or
    ``pipeline_parallel_size`` > 1 the engine starts worker processes: ``close()`` the ``LLM``
    (or use it in a ``with``) to stop them. Launched by ``torchrun`` (every rank running the
    same script), rank 0's ``LLM`` uses the launch's other ranks as its workers, and on each
    of those ranks this constructor serves rank 0 and then ends the process, never returning."""

    def __init__(
        self,
        model: GPT | str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        tokenizer: Tokenizer | None = None,
        speculative_draft: GPT | str | Path | None = None,
        num_speculative_tokens: int = 4,
        speculative_disable_by_batch_size: int | None = None,
        quantize: str | None = None,
        **engine_options: object,
    ) -> None:
        self.engine = build_engine(
            model, EngineConfig(**engine_options), device=device, dtype=dtype, quantize=quantize,  # type: ignore[arg-type]
            speculative_draft=speculative_draft, num_speculative_tokens=num_speculative_tokens,
            speculative_disable_by_batch_size=speculative_disable_by_batch_size, tokenizer=tokenizer,
        )
        self._next_id = 0

    def close(self) -> None:
        """Stop what the engine started (a tensor-parallel model's workers); idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Complete every prompt; outputs come back in the prompts' order."""
        batch = _as_prompt_list(prompts)
        per_prompt = params if isinstance(params, list) else [params or SamplingParams()] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(per_prompt)} SamplingParams")
        ids, texts, logprobs, order = {}, {}, {}, []
        for prompt, p in zip(batch, per_prompt):
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            ids[rid] = self.engine.add_request(rid, prompt, p)
            texts[rid], logprobs[rid] = [], []
            order.append(rid)
        finished: dict[str, str] = {}
        bar = tqdm(total=len(batch), desc="generate", unit="req", disable=not use_tqdm)
        start, before = time.perf_counter(), self.engine.stats()
        while self.engine.has_unfinished:
            for out in self.engine.step():
                texts[out.request_id].append(out.new_text)
                logprobs[out.request_id] += out.logprobs or []
                if out.finished:
                    finished[out.request_id] = out.finish_reason or ""
                    bar.update(1)
            bar.set_postfix_str(_rates(before, self.engine.stats(), time.perf_counter() - start), refresh=False)
        bar.close()
        return [
            CompletionOutput(
                ids[r].token_ids[: ids[r].prompt_len], ids[r].output_ids, "".join(texts[r]), finished[r],
                logprobs[r], ids[r].prompt_logprobs,
            )
            for r in order
        ]


def _as_prompt_list(prompts: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)  # type: ignore[arg-type]


def _rates(before, after, seconds: float) -> str:
    """Prefill and decode tokens per second since ``before``, for the progress bar."""
    seconds = max(seconds, 1e-9)
    prefill = (after.prefill_tokens - before.prefill_tokens) / seconds
    decode = (after.generated_tokens - before.generated_tokens) / seconds
    return f"prefill {prefill:,.0f} tok/s, decode {decode:,.0f} tok/s"
