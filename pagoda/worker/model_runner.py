"""SchedulerOutput -> input tensors + AttentionMetadata -> forward -> logits -> sampled tokens."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import torch

from pagoda.core.outputs import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from pagoda.layers.attention import AttentionMetadata
from pagoda.layers.attention.backend import PagedKVCache, build_attention_metadata
from pagoda.layers.sampler import Sampler, SamplingRow, prompt_logprobs
from pagoda.model.llama import LlamaForCausalLM
from pagoda.profiler import NULL_PROFILER, StepProfiler
from pagoda.worker.offload import OffloadStore


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    sample_rows: list[int]  # row of the last token of each sampling sequence
    sample_seqs: list[ScheduledSeq]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[PagedKVCache],
                 block_size: int, offload: OffloadStore | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.offload = offload  # the second KV tier: copies scheduled by the KV cache manager
        self.block_size = block_size
        self.sampler = Sampler()
        self.profiler: StepProfiler = NULL_PROFILER

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        sample_rows, sample_seqs = [], []
        for seq in sched.seqs:
            start, n = seq.start_pos, seq.num_new_tokens
            ids.extend(seq.request.token_ids(start, start + n))
            positions.extend(range(start, start + n))
            if seq.samples:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        meta = build_attention_metadata([(s.block_table, s.start_pos, s.num_new_tokens) for s in sched.seqs],
                                        self.block_size, self.model.backend.decode_group_padding)
        return StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta,
                          sample_rows, sample_seqs)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.offload is not None:  # outs first: a block spilled this step may be refilled this step
            self.offload.swap_out(sched.swap_out)
            self.offload.swap_in(sched.swap_in)
        prof = self.profiler
        if any(s.draft for s in sched.seqs):
            if (verified := self._verify(sched)) is not None:
                return verified
            sched = _without_drafts(sched)
        with prof.phase("prepare_inputs"):
            inputs = self.prepare(sched)
        if sched.num_steps > 1 and (out := self._decode_steps(sched, inputs)) is not None:
            return out
        with prof.phase("forward"):
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        with prof.phase("sampling"):
            return self._sample(sched, inputs, hidden)

    def _decode_steps(self, sched: SchedulerOutput, inputs: StepInputs) -> ModelRunnerOutput | None:
        """sched.num_steps decode steps in one call of the one-call forward, each sampled in it as a step of its own
        samples (Sampler.fused_steps): the same tokens as steps taken one by one. None (nothing run, nothing drawn)
        where that forward does not take the step or the sampler's C++ pass is not built: the step then runs alone,
        its later blocks filled by the next steps."""
        one_call = self.model.one_stream_forward
        if one_call is None or not one_call.applies(inputs.meta) or len(inputs.sample_seqs) != len(sched.seqs):
            return None
        fused = self.sampler.fused_steps([_row(s) for s in sched.seqs], self.model.lm_head.out_features,
                                         sched.num_steps)
        if fused is None:
            return None
        sample, logprobs, tops = fused
        b = len(sched.seqs)
        # the tokens that stop each row (a row's min_tokens block keeps them from being sampled), and the rows not
        # stopped
        stops = [s.request.stop_tokens for s in sched.seqs]
        running = set(range(b))

        def sample_and_check(step: int, logits: torch.Tensor, ids: int) -> bool:
            """Sample the step; True where every row has stopped (no later step is needed)."""
            sample(step, logits, ids)
            got = (ctypes.c_int64 * b).from_address(ids)
            running.difference_update([i for i in running if got[i] in stops[i]])
            return not running

        with self.profiler.phase("forward"):
            done = one_call.decode_steps([s.block_table for s in sched.seqs], [s.start_pos for s in sched.seqs],
                                         inputs.input_ids.tolist(), self.block_size, sched.num_steps,
                                         sample_and_check)
        if done is None or done[1] == 0:  # no step taken (a position past the rotary tables: the eager path raises)
            return None
        tokens, steps = done
        out = ModelRunnerOutput()
        for i, s in enumerate(sched.seqs):
            out.add(s.request.request_id, [SampledToken(tokens[(k + 1) * b + i], logprobs[k * b + i],
                                                        tops[k][i] if tops else None) for k in range(steps)])
        return out

    def _verify(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """A decode step with draft tokens (speculative decoding): each sequence's last token and drafts as rows of
        one call of the one-call forward (OneStreamForward.verify), then the sampler's check of each sequence's
        drafts (Sampler.verify): the accepted drafts and one token more. None (nothing run, nothing drawn) where
        that forward does not take the rows: the step then runs without its drafts."""
        one_call = self.model.one_stream_forward
        if one_call is None:
            return None
        inputs = [[s.request.token_ids(s.start_pos, s.start_pos + 1)[0], *s.draft] for s in sched.seqs]
        with self.profiler.phase("forward"):
            got = one_call.verify([s.block_table for s in sched.seqs], [s.start_pos for s in sched.seqs], inputs,
                                  self.block_size)
        if got is None:
            return None
        logits, kept = got
        out = ModelRunnerOutput()
        with self.profiler.phase("sampling"):
            row0 = 0
            for s in sched.seqs:
                drafts = s.draft[:kept]
                checked = self.sampler.verify(logits[row0: row0 + len(drafts) + 1], drafts, _row(s))
                row0 += len(drafts) + 1
                out.add(s.request.request_id, [SampledToken(*t) for t in zip(
                    checked.token_ids, checked.logprobs, checked.top_logprobs, strict=True)])
        return out

    def _sample(self, sched: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        if inputs.sample_rows:
            rows_all = inputs.sample_rows == list(range(hidden.shape[0]))  # decode steps: no copy (an op less)
            logits = self._logits(hidden if rows_all else hidden[inputs.sample_rows])
            rows = [_row(s) for s in inputs.sample_seqs]
            sampled = self.sampler(logits, rows)
            for i, s in enumerate(inputs.sample_seqs):
                out.sampled[s.request.request_id] = SampledToken(
                    sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i])
        self._prompt_logprobs(sched, inputs, hidden, out)
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.profiler.phase("logits"):  # the lm_head: inside "sampling", reported apart from it
            logits = self.model.compute_logits(hidden)
        return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()

    def _prompt_logprobs(self, sched: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
                         out: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens: the logits at position i score prompt token i + 1."""
        for i, seq in enumerate(sched.seqs):
            req = seq.request
            k = req.params.prompt_logprobs
            last = min(seq.start_pos + seq.num_new_tokens, req.num_prompt_tokens - 1)
            if k is None or seq.start_pos >= last:
                continue
            row0 = inputs.meta.query_start_loc[i]
            logits = self._logits(hidden[row0: row0 + last - seq.start_pos])
            targets = torch.tensor(req.prompt_token_ids[seq.start_pos + 1: last + 1], dtype=torch.long)
            out.prompt_logprobs[req.request_id] = (seq.start_pos + 1, prompt_logprobs(logits, targets, k))


def _without_drafts(sched: SchedulerOutput) -> SchedulerOutput:
    """The step with its draft tokens left out: each sequence's own token alone (a decode step as any other)."""
    seqs = [ScheduledSeq(s.request, s.num_new_tokens - len(s.draft), s.start_pos, s.block_table) for s in sched.seqs]
    return replace(sched, seqs=seqs)


def _row(seq: ScheduledSeq) -> SamplingRow:
    """What the sampler reads of a request's row this step."""
    r = seq.request
    return SamplingRow(params=r.params, uniforms=r.uniforms, prompt_token_ids=r.prompt_token_ids,
                       output_token_ids=r.output_token_ids, eos_token_ids=r.eos_token_ids, token_array=r.token_array)
