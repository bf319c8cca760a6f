"""Iteration-level scheduler: rebuilds the batch at every model step.

One rule: each request has `num_tokens` (prompt + output) and `num_computed_tokens` (in the KV
cache). Each step hands out a token budget so that computed catches up with total. Order:
1. running requests one token behind (decodes), in priority order;
2. running requests further behind (prompt chunks, or recomputation after preemption);
3. waiting requests, in (priority, preempted-first, tenant usage, arrival) order, while the
   budget, the sequence limit and the KV cache allow. A new request first looks up its prefix in
   the cache and only computes what follows. Tenant usage is the tokens scheduled for the
   request's tenant, decayed each step, so among equal priorities the least-served tenant goes
   first: a tenant flooding the queue cannot starve another (equal weights).
When a running request cannot get a block, the lowest-priority, latest-arrived running request is
preempted (its blocks freed, requeued in front of its priority class, recomputed later); it may be
the request itself. A request alone always fits (admission guarantees prompt + output <= cache), so
the highest-priority oldest request always makes progress: no deadlock.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Iterable

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager, PrefixHit
from pagoda.core.ngram import NgramProposer
from pagoda.core.outputs import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from pagoda.request import Request, RequestStatus

# Per-step decay of each tenant's usage counter: about the last ~100 steps count.
TENANT_USAGE_DECAY = 0.99


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by _waiting_key
        self.running: list[Request] = []
        self.num_preemptions = 0
        # The most decode steps a call runs (_decode_steps): config.num_scheduler_steps, or 1 where the engine's
        # model cannot take several (LLMEngine sets it)
        self.max_decode_steps = config.num_scheduler_steps
        # The most rows a call of several steps or drafts takes (LLMEngine sets it): a step with more runs alone, and
        # no blocks are given ahead for steps that would not run
        self.max_steps_rows = sys.maxsize
        # Draft tokens for decode steps (--num-speculative-tokens; LLMEngine drops it where the runner cannot verify
        # them), and what became of them
        self.proposer = (NgramProposer(config.num_speculative_tokens, config.ngram_prompt_lookup_max,
                                       config.ngram_prompt_lookup_min) if config.num_speculative_tokens else None)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Tokens scheduled per tenant, decayed every step: the least-served tenant is admitted first.
        self.tenant_usage: dict[str | None, float] = {}

    # ---- queue management -------------------------------------------------------------
    @staticmethod
    def _waiting_key(req: Request) -> tuple[int, int, float, str]:
        return (req.priority, 0 if req.status is RequestStatus.PREEMPTED else 1, req.arrival_time,
                req.request_id)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        bisect.insort(self.waiting, req, key=self._waiting_key)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now (abort, stop string): free its blocks, drop it from the queues."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        req.status = status
        return req

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: dict[str, ScheduledSeq] = {}
        budget = self.config.max_num_batched_tokens
        running = sorted(self.running, key=Request.sort_key)
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        chunks = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + chunks:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            ok, returned = self._allocate_or_preempt(req, n, scheduled, out)
            budget += returned  # tokens of victims that had been scheduled earlier in this step
            if ok:
                scheduled[req.request_id] = ScheduledSeq(req, n, req.num_computed_tokens,
                                                         self.kv.block_table(req.request_id))
                budget -= n
        self._schedule_waiting(budget, scheduled)
        out.seqs = list(scheduled.values())
        out.num_steps = self._decode_steps(out.seqs)
        if self.proposer is not None:
            self._propose(out.seqs)
        out.swap_out, out.swap_in = self.kv.take_swaps()
        self._account(out)
        return out

    def _decode_steps(self, seqs: list[ScheduledSeq]) -> int:
        """How many decode steps this step runs (max_decode_steps at most): several only where it is
        decodes alone, of at most the rows such a call takes (max_steps_rows), and nothing waits (a request that
        arrives waits for the whole call; one waiting already would have waited num_scheduler_steps steps), at most
        as many as every request may still generate, and only where each gets the blocks of all of them now (else
        one; blocks already given stay with their requests, which fill them next). Where a request stops early
        (EOS, a stop string), the tokens computed past its end are dropped."""
        n = self.max_decode_steps
        if n == 1 or self.waiting or len(seqs) > self.max_steps_rows or not self._call_decodes(seqs):
            return 1
        for s in seqs:
            req = s.request
            n = min(n, req.max_total_tokens - req.num_tokens)
            if req.params.max_tokens is not None:
                n = min(n, req.params.max_tokens - req.num_output_tokens)
        if n > 1 and all(self.kv.allocate_slots(s.request, n) for s in seqs):
            return n
        return 1

    def _call_decodes(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether the step is decodes alone (each one token that samples): what several decode steps a call and
        draft tokens both ask of a step (any row: the sampler takes every kind in both)."""
        return bool(seqs) and all(s.num_new_tokens == 1 and s.samples for s in seqs)

    def _propose(self, seqs: list[ScheduledSeq]) -> None:
        """Draft tokens for the step's decodes, where it is decodes alone (no waiting request could be admitted
        this step, so drafts take no room from one) of at most speculative_disable_by_batch_size sequences: each
        gets the proposer's drafts where they fit the token budget, the verifying call's rows (max_steps_rows) and
        what the request may still generate past this step's token, and their blocks now (else none)."""
        if len(seqs) > self.config.speculative_disable_by_batch_size or not self._call_decodes(seqs):
            return
        assert self.proposer is not None
        rows = len(seqs)
        room = min(self.config.max_num_batched_tokens, self.max_steps_rows) - rows
        for s in seqs:
            req = s.request
            draft = self.proposer.propose(req, min(room, req.max_reachable_tokens - req.num_tokens - 1))
            if draft and self.kv.allocate_slots(req, 1 + len(draft)):
                s.draft = draft
                s.num_new_tokens += len(draft)
                room -= len(draft)
                self.num_draft_tokens += len(draft)

    def _account(self, out: SchedulerOutput) -> None:
        for tenant in self.tenant_usage:
            self.tenant_usage[tenant] *= TENANT_USAGE_DECAY ** out.num_steps  # per decode step run
        for seq in out.seqs:
            t = seq.request.tenant
            self.tenant_usage[t] = self.tenant_usage.get(t, 0.0) + seq.num_new_tokens * out.num_steps
        if len(self.tenant_usage) > 1024:  # forget tenants that have gone quiet
            self.tenant_usage = {t: u for t, u in self.tenant_usage.items() if u > 1.0}

    def _fair_key(self, req: Request) -> tuple[int, int, float, float, str]:
        """Waiting order: priority, then preempted first, then the tenant served least, then arrival."""
        return (req.priority, 0 if req.status is RequestStatus.PREEMPTED else 1,
                self.tenant_usage.get(req.tenant, 0.0), req.arrival_time, req.request_id)

    def _schedule_waiting(self, budget: int, scheduled: dict[str, ScheduledSeq]) -> int:
        used = 0
        # Fair order only matters with more than one tenant in play (a tenant new to the queue has
        # no usage yet, and must count: it is the one to serve first).
        tenants = set(self.tenant_usage).union(r.tenant for r in self.waiting)
        order = sorted(self.waiting, key=self._fair_key) if len(tenants) > 1 else list(self.waiting)
        for req in order:
            if budget - used <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self._leader_ready(req):
                continue
            hit = self.kv.lookup_prefix(req) if req.num_computed_tokens == 0 else PrefixHit([], [])
            if hit.in_flight:
                continue  # its next prefix block is being computed by a running request: hit it later
            num_cached = hit.num_blocks * self.kv.block_size
            n = min(req.num_tokens - num_cached - req.num_computed_tokens, budget - used)
            if not self.kv.allocate_slots(req, n + num_cached, prefix=hit):
                break  # never preempt running work for a waiting request; keep priority order
            self.kv.record_lookup(req, num_cached)
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = num_cached
            req.num_computed_tokens += num_cached
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = ScheduledSeq(req, n, req.num_computed_tokens,
                                                     self.kv.block_table(req.request_id))
            used += n
        return used

    def _leader_ready(self, req: Request) -> bool:
        """A later sample of an n > 1 request waits until sample 0 has computed the prompt's full
        blocks, so it can share them instead of computing its own copy."""
        leader = req.follows
        if leader is None or leader.is_finished or req.num_computed_tokens > 0:
            return True
        shared = (req.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size
        return leader.num_computed_tokens >= shared

    def _allocate_or_preempt(self, req: Request, n: int, scheduled: dict[str, ScheduledSeq],
                             out: SchedulerOutput) -> tuple[bool, int]:
        """Allocate blocks for `req`, preempting victims until it fits.

        Returns (False if `req` itself was preempted, tokens given back by preempted victims).
        """
        returned = 0
        while not self.kv.allocate_slots(req, n):
            victim = max(self.running, key=Request.sort_key)
            seq = scheduled.pop(victim.request_id, None)
            returned += seq.num_new_tokens if seq else 0
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False, returned
        return True, returned

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=self._waiting_key)

    # ---- after the model ran ------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[tuple[Request, SampledToken]]:
        """Advance computed counts, append sampled tokens, finish requests; returns new tokens."""
        new_tokens: list[tuple[Request, SampledToken]] = []
        for seq in sched.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += seq.num_new_tokens - len(seq.draft)
            self.kv.cache_full_blocks(req)
            first = result.sampled.get(req.request_id)
            if first is None:
                continue
            tokens = [first, *result.more.get(req.request_id, ())]
            if seq.draft:
                self.num_accepted_tokens += len(tokens) - 1
                if self.proposer is not None:
                    self.proposer.record(req.request_id, len(tokens) - 1)
            for i, token in enumerate(tokens):
                if i:  # a later decode step of the same call (SchedulerOutput.num_steps), or the token after an
                    # accepted draft token: its input, the token before, is in the cache now
                    req.num_computed_tokens += 1
                    self.kv.cache_full_blocks(req)
                req.output_token_ids.append(token.token_id)
                new_tokens.append((req, token))
                status = self._check_stop(req, token.token_id)
                if status is not None:
                    self.finish_request(req.request_id, status)
                    break  # the tokens computed past it are dropped
        return new_tokens

    @staticmethod
    def _check_stop(req: Request, token_id: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens and token_id in req.stop_tokens:
            # EOS reports no stop reason, a stop token id itself
            req.stop_reason = None if not p.ignore_eos and token_id in req.eos_token_ids else token_id
            return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= req.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        done = []
        for rid in request_ids:
            req = self.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                done.append(req)
        return done
