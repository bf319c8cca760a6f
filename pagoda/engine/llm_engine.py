"""LLMEngine: add_request / abort_request / step over scheduler, model runner and output processor."""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.config import EngineConfig, ModelConfig
from pagoda.core.kv_cache_manager import KVCacheManager, cdiv
from pagoda.core.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagoda.core.scheduler import Scheduler
from pagoda.engine.output_processor import ParentState, new_parent
from pagoda.layers.attention import PagedKVCache, get_attention_backend
from pagoda.layers.linear import enable_gemv, prepack_linears, should_prepack, tiles_of
from pagoda.layers.q4_linear import packed_of, quantize_linears
from pagoda.model.loader import load_model
from pagoda.outputs import RequestOutput
from pagoda.profiler import NULL_PROFILER, StepProfiler
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.worker.host_memory import (
    HeapReleaser,
    copy_releasing,
    huge_page_tensors,
    huge_pages_enabled,
    keep_freed_memory,
    release_free_heap,
    sole_holder,
)
from pagoda.worker.kv_cache import KVCachePlan, allocate_kv_cache, default_kv_cache_memory, plan_kv_cache
from pagoda.worker.model_runner import ModelRunner
from pagoda.worker.offload import OffloadStore
from pagoda.worker.offload import bytes_per_block as offload_bytes_per_block

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    """What the engine found out at start-up (never written back into the config)."""

    max_model_len: int
    max_request_tokens: int  # prompt + output of one request: max_model_len, or less if the cache is smaller
    kv: KVCachePlan


@dataclass
class EngineStats:
    num_prompt_tokens_computed: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    # Summed after each step while track_kv_usage is on (KVCacheManager.slot_usage): KV slots that
    # hold a token, and slots in blocks held by requests. Their ratio is how much of the memory
    # requests hold is real tokens (what PagedAttention's paper measured at 20-38% for earlier systems).
    kv_slots_filled: int = 0
    kv_slots_held: int = 0


def move_weights_to_huge_pages(model: nn.Module, release_every: int = 64 << 20) -> int:
    """Copy the model's parameters, packed weights (--quantization) and tiles (prepack_linears) into one
    huge-page region (host_memory.huge_page_tensors: a decode step streams through all of them), each old copy
    dropped as its new one takes its place and the free heap handed back before and every release_every bytes
    moved (HeapReleaser), and return the bytes moved. Call before anything keeps a weight's address (the fused and
    one-call paths). The tiles on 4 KiB pages had made one float32 stream's step 1.45x slower than the GEMV's on huge
    pages (the hardware prefetchers stop at each page's end; BENCHMARKS.md, "Float32 linears on tiles of our own").
    Copying everything first and freeing after had made the move the start-up's peak: float32 1,611 MiB resident
    against 1,241 while loading; and a tensor copied whole beside its old copy still did (the float32 model's tied
    lm_head tiles, 108 MiB), so where nothing but the model holds a tensor its old pages go back to the kernel as
    each chunk is copied (host_memory.copy_releasing)."""
    params = [p for p in model.parameters() if p.numel()]  # tied weights once
    packed = [q for q in map(packed_of, model.modules()) if q is not None]
    tiled = [m for m in model.modules() if tiles_of(m) is not None]
    owners: list[tuple[Any, str]] = [(p, "data") for p in params] + [(q, "w") for q in packed] + \
        [(m, "_pagoda_tiles") for m in tiled]
    release_free_heap()  # first the holes the load and the packing left (their copies of the weights freed)
    slots = huge_page_tensors((getattr(o, a).shape, getattr(o, a).dtype) for o, a in owners)
    moved, releaser = 0, HeapReleaser(release_every)
    for (owner, attr), slot in zip(owners, slots, strict=True):
        old = getattr(owner, attr)  # a parameter's `.data` is an alias of it
        copy_releasing(slot, old, release=sole_holder(old, alias=attr == "data"))
        del old
        setattr(owner, attr, slot)  # where nothing else held the old copy, it is freed here
        nbytes = slot.numel() * slot.element_size()
        moved += nbytes
        releaser.freed(nbytes)
    release_free_heap()
    return moved


class PackWhileLoading:
    """load_model's hook (ModuleLoaded): each layer's weights packed as soon as they are loaded, into --quantization's
    form (quantize_linears) or else the tiles (prepack_linears, where should_prepack says so, asked at the first
    layer: shapes and dtypes suffice), its float weight freed there, so that the float model is never resident at
    once; the heap is handed back every 64 MiB freed (every 16 MiB lowered q4_1's peak by 2-3% but cost ~0.5 s of
    start-up: pages handed back are faulted in again by the next allocations). `finish` packs what the load left
    (under --quantization, float layers it did not take) and logs what was done. Packing after the whole load had
    the load as the start-up's peak: q4_1 1,219-1,228 MiB against 513-524 resident after it, float32 1,220-1,230
    against 931-941 (BENCHMARKS.md, "The start-up's peak memory, layer by layer")."""

    def __init__(self, mc: ModelConfig) -> None:
        self.mc = mc
        self.releaser = HeapReleaser()
        self.quantized: list[tuple[int, int, float]] = []  # quantize_linears's (layers, bytes, seconds) per call
        self.prepacked: list[tuple[int, range | None]] = []  # prepack_linears's (bytes added, rows served) per call
        self.prepack: bool | None = None  # should_prepack's answer, once asked
        self.compile_seconds = 0.0  # should_prepack's (the tile kernels' build, or their load from the disk cache)

    def _should_prepack(self, model: nn.Module) -> bool:
        if self.prepack is None:
            mc, start = self.mc, time.perf_counter()
            self.prepack = should_prepack(model, mc.torch_dtype, mc.prepack_weights, mc.compile_model)
            self.compile_seconds = time.perf_counter() - start  # it builds the tile kernels
        return self.prepack

    def __call__(self, model: nn.Module, name: str | None = None, module: nn.Module | None = None) -> None:
        if module is not None:  # what the loader freed for these weights (the dequantize's temporaries, a merged
            # projection's parts), counted as their size: q4_1's peak 564-572 MiB against 594-598 uncounted (ad hoc)
            self.releaser.freed(sum(p.numel() * p.element_size() for p in module.parameters(recurse=False)))
        if self.mc.quantization != "none":  # then the tiles only for what it leaves (asked after the load)
            self.quantized.append(quantize_linears(model, self.mc.quantization, freed=self.releaser.freed, only=name))
        elif self._should_prepack(model):
            self.prepacked.append(prepack_linears(model, freed=self.releaser.freed, only=name))

    def finish(self, model: nn.Module) -> float:
        """Pack what the load left, log it, and return the seconds building the kernels and quantizing took."""
        mc = self.mc
        self(model)
        if self.quantized:
            count, nbytes, seconds = (sum(column) for column in zip(*self.quantized, strict=True))
            logger.info("quantization %s: %d linear layers, %.1f MiB of packed weights", mc.quantization, count,
                        nbytes / 2**20)
            if self._should_prepack(model):  # float linears quantizing did not take
                self.prepacked.append(prepack_linears(model, freed=self.releaser.freed))
        if self.prepacked:
            added = sum(a for a, _ in self.prepacked)
            rows = next((r for _, r in reversed(self.prepacked) if r is not None), None)
            if rows is not None:
                upto = f"-{rows.stop - 1}" if rows.stop < 1 << 31 else " or more"
                logger.info("prepacked linear weights for steps of %d%s tokens: %.1f MiB more (the plain weights "
                            "of layers on tiles freed where not shared)", rows.start, upto, added / 2**20)
            else:
                logger.warning("prepack_weights: nothing packed (it applies to float32 weights, and to bfloat16 "
                               "ones where oneDNN supports bfloat16 on this CPU); dtype is %s", mc.torch_dtype)
        return self.compile_seconds + sum(seconds for _, _, seconds in self.quantized)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.keeps_freed_memory = keep_freed_memory()
        backend = get_attention_backend(mc.attention_backend, mc.torch_dtype, mc.quantization != "none")
        packing = PackWhileLoading(mc)  # the load's hook: --quantization or the tiles, layer by layer
        loaded = load_model(mc.model, mc.torch_dtype, backend, mc.max_model_len, packing)
        self.model, self.arch, self.tokenizer = loaded.model, loaded.arch, loaded.tokenizer
        budget = config.cache.kv_cache_memory or default_kv_cache_memory()
        plan = plan_kv_cache(self.arch, mc.torch_dtype, config.cache.block_size, budget, config.cache.kv_cache_dtype,
                             config.cache.kv_cache_scale_granularity, mc.quantization)
        max_model_len = mc.max_model_len or self.arch.max_position_embeddings
        self.limits = EngineLimits(max_model_len, min(max_model_len, plan.num_tokens), plan)
        start = time.perf_counter()
        caches = allocate_kv_cache(self.arch, plan, mc.torch_dtype, config.cache.kv_cache_prefault)
        if config.cache.kv_cache_prefault:
            logger.info("KV cache pages backed in %.1f s (--kv-cache-prefault)", time.perf_counter() - start)
        self.compile_seconds = backend.warmup(caches[0], self.arch.num_heads, mc.torch_dtype, self.arch.head_dim**-0.5)
        self.attention_backend = backend.name  # after warm-up: the backend actually in use
        self.compile_seconds += packing.finish(self.model)  # before the huge pages, which take the packed weights
        if huge_pages_enabled():  # before the paths below, which take the weights' addresses
            moved = move_weights_to_huge_pages(self.model)
            logger.info("weights on huge pages: %.1f MiB", moved / 2**20)
        if mc.compile_model:
            self.compile_seconds += self.model.enable_compiled_forward(caches)
        elif mc.fused_ops:
            self.compile_seconds += self.model.enable_fused_ops(mc.torch_dtype)
            self.compile_seconds += enable_gemv(self.model)  # bfloat16 and float32 linears
            self.compile_seconds += self.model.enable_one_stream_forward(caches)  # where those kernels allow
        offload = self._make_offload_store(caches)
        # whose K/V a cached block holds: q4_1 layers compute other K/V than the float weights
        identity = f"{loaded.identity}:{mc.torch_dtype}:{mc.quantization}:{plan.spec.name}"
        self.kv = KVCacheManager(plan.num_blocks, plan.block_size, config.cache.enable_prefix_caching, identity,
                                 offload.num_slots if offload else 0)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(self.model, caches, plan.block_size, offload)
        if mc.fused_ops:  # outside the forward pass: also with --compile-model
            self.compile_seconds += self.runner.sampler.enable_fused()
        self._enable_calls_of_several_tokens(config)
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}
        self.stats = EngineStats()
        self._rng = random.Random(mc.seed)
        self.profiler: StepProfiler = NULL_PROFILER
        self.track_kv_usage = False  # off by default: it walks every held block table each step
        self._log_startup(loaded.path.name)

    def _make_offload_store(self, caches: list[PagedKVCache]) -> OffloadStore | None:
        """The second KV tier, when --kv-offload-memory is set (it needs prefix caching: blocks are
        found there by hash)."""
        budget = self.config.cache.kv_offload_memory
        if not budget or not self.config.cache.enable_prefix_caching:
            return None
        per_block = offload_bytes_per_block(caches)
        if budget < per_block:
            raise ValueError(f"kv_offload_memory of {budget} bytes holds no block; one block needs {per_block} bytes")
        logger.info("second KV tier: %d blocks in %.1f MiB of host memory", budget // per_block, budget / 2**20)
        return OffloadStore(caches, budget // per_block)

    def _enable_calls_of_several_tokens(self, config: EngineConfig) -> None:
        """Several decode steps in one call (--num-scheduler-steps) and draft tokens verified in one call
        (--num-speculative-tokens) both run through the one-call decode forward with its lm_head in the call and the
        sampler's fused pass: where those are not there, the scheduler plans neither (it would give blocks ahead, or
        propose drafts, that nothing takes); where they are, it plans them for at most the rows the call takes."""
        sched, one_call = self.scheduler, self.model.one_stream_forward
        steps, drafts = config.scheduler.num_scheduler_steps, config.scheduler.num_speculative_tokens
        if steps == 1 and not drafts:
            return
        if one_call is None or not one_call.steps_rows or self.runner.sampler.lib is None:
            flag = f"--num-scheduler-steps {steps}" if steps > 1 else f"--num-speculative-tokens {drafts}"
            logger.warning("%s: off here (decode steps run one at a time: several steps or draft tokens run in a "
                           "call only through the one-call decode forward with its lm_head in the call and the "
                           "sampler's fused pass; the log above says why the forward is off)", flag)
            sched.max_decode_steps = 1
            sched.proposer = None
            return
        sched.max_steps_rows = one_call.steps_rows
        if sched.proposer is not None:  # all but float32 weights, whose rows cost least (NgramProposer's figures)
            sched.proposer.adaptive = config.model.quantization != "none" or config.model.torch_dtype != torch.float32

    def _log_startup(self, name: str) -> None:
        p, lim = self.limits.kv, self.limits
        logger.info("model %s (%s, %d layers, %d kv heads x %d), dtype %s, attention %s", name, self.arch.model_type,
                    self.arch.num_layers, self.arch.num_kv_heads, self.arch.head_dim, self.config.model.torch_dtype,
                    self.attention_backend)
        if not self.keeps_freed_memory:
            logger.info("host allocator: glibc defaults (freed large blocks go back to the kernel)")
        logger.info("KV cache (%s): %.1f MiB budget, %g bytes/token, %d blocks of %d tokens = %d tokens; "
                    "max concurrency at max_model_len %d: %.2f", p.spec.name, p.budget_bytes / 2**20, p.bytes_per_token,
                    p.num_blocks, p.block_size, p.num_tokens, lim.max_model_len, p.max_concurrency(lim.max_model_len))
        if lim.max_request_tokens < lim.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d: one request is "
                           "limited to %d tokens", p.num_tokens, lim.max_model_len, lim.max_request_tokens)

    # ---- requests -----------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.arch.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, *, cache_salt: str | None = None,
                    tenant: str | None = None) -> None:
        """Validate and queue a request; raises ValueError (naming the field) and queues nothing if bad."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if cache_salt is not None and (not isinstance(cache_salt, str) or len(cache_salt) > 1024):
            raise ValueError("cache_salt must be a string of at most 1024 characters")
        text, ids = self.tokenize_prompt(prompt)
        self._check_prompt(ids)
        params.check_vocab(self.arch.vocab_size)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children: list[Request] = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, ids, params, self.tokenizer.eos_token_ids,
                                    self.limits.max_request_tokens, priority, arrival, seed,
                                    cache_salt=cache_salt, tenant=tenant,
                                    follows=children[0] if children else None))
        self.parents[request_id] = new_parent(request_id, text, ids, params, children, self.tokenizer)
        for child in children:
            self.child_to_parent[child.request_id] = request_id
            self.scheduler.add_request(child)

    def _check_prompt(self, ids: list[int]) -> None:
        lim = self.limits
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= lim.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens but max_model_len is {lim.max_model_len}: a prompt "
                             f"must be shorter than max_model_len to leave room for output")
        if len(ids) >= lim.max_request_tokens:
            raise ValueError(f"prompt is {len(ids)} tokens; the whole KV cache holds {lim.kv.num_tokens} tokens "
                             f"({lim.kv.num_blocks} blocks), so it could never run with room to generate")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples) at any time; its blocks are freed at once."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        for seq in parent.seqs:
            self.scheduler.finish_request(seq.request.request_id, RequestStatus.FINISHED_ABORTED)
            self.child_to_parent.pop(seq.request.request_id, None)
            seq.finish(RequestStatus.FINISHED_ABORTED)
        return parent.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one model step; returns outputs of the requests that produced tokens or finished."""
        prof = self.profiler
        with prof.phase("step"):
            with prof.phase("schedule"):
                sched = self.scheduler.schedule()
            if sched.is_empty:
                # Admission guarantees a lone request fits, so an empty step with work queued is a bug.
                assert not self.scheduler.has_unfinished(), "scheduler made no progress with requests queued"
                return []
            self._record_scheduled(sched)
            with prof.phase("execute"):
                result = self.runner.execute(sched)
            with prof.phase("update"):
                new_tokens = self.scheduler.update(sched, result)
            if self.track_kv_usage:
                self._record_kv_usage()
            with prof.phase("output_processing"):
                return self._process_outputs(sched, result, new_tokens)

    def _record_kv_usage(self) -> None:
        filled, held = self.kv.slot_usage({r.request_id: r.num_computed_tokens for r in self.scheduler.running})
        self.stats.kv_slots_filled += filled
        self.stats.kv_slots_held += held

    def enable_profiling(self) -> StepProfiler:
        """Start timing each step's phases (see pagoda/profiler.py); returns the profiler to report."""
        if self.profiler is NULL_PROFILER:
            if self.model.compiled_forward is not None:
                # the profiler times modules with forward hooks, which only the eager forward runs
                logger.warning("profiling: the forward pass runs eagerly from now on (not compiled)")
                self.model.compiled_forward = self.model.compiled_one_stream = None
            self.profiler = StepProfiler()
            self.profiler.attach(self.model)
            self.runner.profiler = self.profiler
        return self.profiler

    def _record_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        for seq in sched.seqs:
            seq.request.metrics.first_scheduled_time = seq.request.metrics.first_scheduled_time or now
            self.stats.num_prompt_tokens_computed += max(
                0, min(seq.start_pos + seq.num_new_tokens, seq.request.num_prompt_tokens) - seq.start_pos)

    def _process_outputs(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                         new_tokens: list[tuple[Request, SampledToken]]) -> list[RequestOutput]:
        self.stats.num_steps += 1
        self.stats.num_generation_tokens += len(new_tokens)
        touched: dict[str, ParentState] = {}
        for child_id, (first, entries) in result.prompt_logprobs.items():
            parent = self.parents[self.child_to_parent[child_id]]
            if parent.seqs[0].request.request_id == child_id:
                parent.add_prompt_logprobs(first, entries)
        now = time.monotonic()
        # tokens of each request still to come in this list (several where a step ran several decode steps)
        left = Counter(req.request_id for req, _ in new_tokens)
        stopped: set[str] = set()  # ended by a stop string at an earlier token of this step
        for req, token in new_tokens:
            left[req.request_id] -= 1
            if req.request_id in stopped:
                self.stats.num_generation_tokens -= 1
                continue
            parent = self.parents[self.child_to_parent[req.request_id]]
            state = next(s for s in parent.seqs if s.request is req)
            req.metrics.first_token_time = req.metrics.first_token_time or now
            if state.add_token(token):  # a stop string matched
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                stopped.add(req.request_id)
                if left[req.request_id]:  # the tokens after it, computed in the same call, are dropped
                    del req.output_token_ids[len(req.output_token_ids) - left[req.request_id]:]
            elif req.is_finished and not left[req.request_id]:  # its last token (EOS, a length) is this one
                state.finish(req.status)
            if req.is_finished:
                req.metrics.finished_time = now
            touched[parent.request_id] = parent
        return self._collect(touched)

    def _collect(self, touched: dict[str, ParentState]) -> list[RequestOutput]:
        outputs = []
        for parent in touched.values():
            outputs.append(parent.output())
            if parent.finished:
                del self.parents[parent.request_id]
                for seq in parent.seqs:
                    self.child_to_parent.pop(seq.request.request_id, None)
        return outputs

    # ---- introspection ------------------------------------------------------------------
    def get_metrics(self) -> dict[str, int | float]:
        pool = self.kv.pool
        return {
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_in_use": pool.num_used_blocks,
            "kv_blocks_cached": pool.num_cached_free_blocks,
            "kv_blocks_free": pool.num_free_blocks,
            "kv_cache_usage": pool.num_used_blocks / pool.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_draft_tokens": self.scheduler.num_draft_tokens,
            "num_accepted_tokens": self.scheduler.num_accepted_tokens,
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "num_prompt_tokens_computed": self.stats.num_prompt_tokens_computed,
            "num_generation_tokens": self.stats.num_generation_tokens,
            "num_steps": self.stats.num_steps,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            **self._offload_metrics(),
        }

    def _offload_metrics(self) -> dict[str, int | float]:
        tier = self.kv.offload
        if tier is None:
            return {}
        return {"kv_offload_blocks_total": tier.num_slots, "kv_offload_blocks_used": len(tier),
                "kv_offload_queries": tier.queries, "kv_offload_hits": tier.hits, "kv_offload_stores": tier.stores}

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False) while requests hold blocks."""
        return self.kv.reset_prefix_cache()

    def kv_demand_blocks(self, prompt_token_ids: list[int], max_tokens: int | None, n: int = 1,
                         cache_salt: str | None = None) -> int:
        """Blocks a new request may need over its life: its prompt (less prefix-cache hits) plus room
        for max_tokens in each of its n samples. For admission control."""
        bs = self.kv.block_size
        out = min(max_tokens or self.limits.max_request_tokens, self.limits.max_request_tokens)
        total = min(len(prompt_token_ids) + out, self.limits.max_request_tokens)
        shared = (len(prompt_token_ids) - 1) // bs  # full prompt blocks: one copy for all n samples
        cached = self.kv.num_cached_blocks(prompt_token_ids, cache_salt)
        return shared - cached + n * (cdiv(total, bs) - shared)

    def kv_free_blocks(self) -> int:
        """Blocks not held by any request (cached-free blocks count: they can be evicted)."""
        return self.kv.pool.num_free_blocks
