"""The offline API: LLM(model=..., **engine options).generate(prompts, params)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagoda.config import DEFAULT_MODEL, EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer

Prompt = str | list[int]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # type: ignore[list-item]  # one prompt given as token ids
    for i, p in enumerate(items):
        if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}")
    return items  # type: ignore[return-value]


class LLM:
    """Engine options are keyword arguments named like the CLI flags, e.g. dtype="float64",
    max_num_batched_tokens=48, kv_cache_memory="512MiB"."""

    def __init__(self, model: str = DEFAULT_MODEL, **options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **options))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: int | Sequence[int] | None = None, cache_salt: str | Sequence[str | None] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        Every prompt is validated before any is queued, so a bad one raises without side effects.
        """
        items = _as_prompt_list(prompts)
        params = self._per_prompt("sampling_params", sampling_params or SamplingParams(), len(items))
        priorities = self._per_prompt("priority", 0 if priority is None else priority, len(items))
        salts = [cache_salt] * len(items) if cache_salt is None or isinstance(cache_salt, str) else list(cache_salt)
        if len(salts) != len(items):
            raise ValueError(f"cache_salt has {len(salts)} entries for {len(items)} prompts")
        for i, prompt in enumerate(items):
            try:
                _, ids = self.engine.tokenize_prompt(prompt)
                self.engine._check_prompt(ids)
                params[i].check_vocab(self.engine.arch.vocab_size)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        request_ids = [f"offline-{next(self._ids)}" for _ in items]
        for rid, prompt, p, prio, salt in zip(request_ids, items, params, priorities, salts, strict=True):
            self.engine.add_request(rid, prompt, p, priority=prio, cache_salt=salt)
        return self._run(request_ids, use_tqdm)

    @staticmethod
    def _per_prompt(name: str, value: Any, n: int) -> list[Any]:
        if isinstance(value, SamplingParams | int):
            return [value] * n
        values = list(value)
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
        return values

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in request_ids]

    def chat(self, conversations: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        tok = self.engine.tokenizer
        prompts: list[Prompt] = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False)  # type: ignore[arg-type]
                                 for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self) -> dict[str, int | float]:
        return self.engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block. Only while nothing is running: returns False otherwise."""
        return self.engine.reset_prefix_cache()
