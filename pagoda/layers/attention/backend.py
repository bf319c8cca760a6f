"""The attention backend interface and the per-step metadata every backend reads.

A step's tokens are flattened: sequence i owns query rows [query_start_loc[i], query_start_loc[i+1]).
Its K/V for this step are written to the paged cache at `slot_mapping`; then each query attends
causally to the whole context of its sequence (earlier chunks already in the cache included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagoda.layers.attention.paged_kv import PagedKVCache

# Decodes are attended to in groups of similar context length: one padded batch per group. A group
# grows while its padded size stays within this factor of its real size. Backends whose kernels stop at
# each sequence's length (cpp) take all decodes as one group (their `decode_group_padding` is inf).
DECODE_GROUP_PADDING = 1.25


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # (Bd,) int64 query rows
    block_tables: torch.Tensor  # (Bd, max_blocks) int64, padded with block 0 (masked out)
    seq_lens: torch.Tensor  # (Bd,) int64
    whole_step: bool = False  # rows are 0..T-1 in order: the step is this group's decodes alone
    # (first, last + 1) where rows are consecutive and ascending, as a step's decodes are when they come before its
    # prompt chunks (the scheduler's order): the backend then slices q and out instead of gathering and scattering
    # rows (torch's index and index_put, ~50 us together at 128 rows, once per layer)
    row_range: tuple[int, int] | None = None
    # The blocks the longest sequence's context takes (the table's width, but where the scheduler gave blocks ahead
    # for several decode steps a call): the cpp kernel cuts contexts into spans by it, so that a step's outputs do
    # not depend on blocks given ahead. 0: the table's width.
    span_width: int = 0


@dataclass
class PromptChunks:
    """A step's prompt chunks as flat int64 tensors, for kernels that take them all in one call: chunk s has counts[s]
    query rows from row starts[s], the context length seq_lens[s] (also as a list) and its block table from
    tables[table_starts[s]]."""
    starts: torch.Tensor
    counts: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_list: list[int]
    tables: torch.Tensor
    table_starts: torch.Tensor


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset for each new token
    query_start_loc: list[int]  # (B + 1,) row offsets of each sequence's queries
    seq_lens: list[int]  # (B,) context length of each sequence after this step
    block_tables: dict[int, torch.Tensor]  # the prompt chunks' (prefill_idx) block tables (num_blocks_i,) int64
    decode_groups: list[DecodeGroup]  # sequences with exactly one query (decodes), batched
    prefill_idx: list[int]  # sequences with more than one query
    _prompt_chunks: PromptChunks | None = field(default=None, init=False, repr=False)

    def prompt_chunks(self) -> PromptChunks:
        """The prompt chunks (prefill_idx) as PromptChunks, built at the first call of the step (its first layer's)
        and kept for the others."""
        if self._prompt_chunks is None:
            idx, qsl = self.prefill_idx, self.query_start_loc
            tables = [self.block_tables[i] for i in idx]
            lens = [self.seq_lens[i] for i in idx]
            table_starts = [0]
            for t in tables[:-1]:
                table_starts.append(table_starts[-1] + t.numel())
            self._prompt_chunks = PromptChunks(
                starts=torch.tensor([qsl[i] for i in idx], dtype=torch.long),
                counts=torch.tensor([qsl[i + 1] - qsl[i] for i in idx], dtype=torch.long),
                seq_lens=torch.tensor(lens, dtype=torch.long), seq_lens_list=lens,
                tables=torch.cat(tables) if tables else torch.empty(0, dtype=torch.long),
                table_starts=torch.tensor(table_starts[:len(idx)], dtype=torch.long))
        return self._prompt_chunks



def build_attention_metadata(seqs: list[tuple[list[int], int, int]], block_size: int,
                             group_padding: float | None = None) -> AttentionMetadata:
    """seqs: (block table, start position, new tokens) per sequence, in batch order. group_padding: how
    much padding a decode group may have (default DECODE_GROUP_PADDING; inf: all decodes in one group).

    Built from Python lists, a tensor per field rather than a few torch ops per sequence: this runs at every
    step, and each torch call costs microseconds (tens on a cold cache; 64 decodes took 2.4-2.9 ms when each
    sequence's slots were computed with torch ops, BENCHMARKS.md)."""
    slots: list[int] = []
    qsl, seq_lens = [0], []
    for table, start, n in seqs:
        pos, end = start, start + n
        while pos < end:  # block by block: a range of consecutive slots in each
            block, offset = divmod(pos, block_size)
            take = min(block_size - offset, end - pos)
            base = table[block] * block_size + offset
            slots.extend(range(base, base + take))
            pos += take
        qsl.append(qsl[-1] + n)
        seq_lens.append(end)
    lengths = [len(t) for t, _, _ in seqs]
    decodes = [i for i, (_, _, n) in enumerate(seqs) if n == 1]
    padding = DECODE_GROUP_PADDING if group_padding is None else group_padding
    members = _group_by_length(decodes, lengths, padding)
    groups = [_decode_group(g, seqs, qsl, seq_lens, block_size) for g in members]
    if len(groups) == 1 and len(decodes) == len(seqs):  # its rows are 0..B-1 in order
        groups[0].whole_step = members[0] == list(range(len(seqs)))
    prefill_idx = [i for i, (_, _, n) in enumerate(seqs) if n > 1]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long), query_start_loc=qsl, seq_lens=seq_lens,
        block_tables={i: torch.tensor(seqs[i][0], dtype=torch.long) for i in prefill_idx},
        decode_groups=groups, prefill_idx=prefill_idx)


def _group_by_length(idx: list[int], lengths: list[int], padding: float) -> list[list[int]]:
    """Split sequences (sorted by blocks) so that padding each group to its longest wastes little. With no limit
    (inf) all in one group, in batch order: sorted, its rows would have to be gathered at every layer."""
    if padding == float("inf"):
        return [idx] if idx else []
    groups: list[list[int]] = []
    blocks = 0
    for i in sorted(idx, key=lambda i: lengths[i]):
        n = lengths[i]  # the longest so far in its group: sorted ascending
        if groups and (len(groups[-1]) + 1) * n <= padding * (blocks + n):
            groups[-1].append(i)
            blocks += n
        else:
            groups.append([i])
            blocks = n
    return groups


def _decode_group(idx: list[int], seqs: list[tuple[list[int], int, int]], qsl: list[int],
                  seq_lens: list[int], block_size: int) -> DecodeGroup:
    width = max(len(seqs[i][0]) for i in idx)
    padded = [list(seqs[i][0]) + [0] * (width - len(seqs[i][0])) for i in idx]
    rows = [qsl[i] for i in idx]
    consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeGroup(rows=torch.tensor(rows, dtype=torch.long),
                       block_tables=torch.tensor(padded, dtype=torch.long),
                       seq_lens=torch.tensor([seq_lens[i] for i in idx], dtype=torch.long),
                       row_range=(rows[0], rows[0] + len(rows)) if consecutive else None,
                       span_width=-(-max(seq_lens[i] for i in idx) // block_size))


class AttentionBackend(Protocol):
    name: str

    @property
    def decode_group_padding(self) -> float:
        """How much padding a batched decode group may have (build_attention_metadata's group_padding)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: (T, Hq, D); k, v: (T, Hkv, D), written to kv_cache at meta.slot_mapping -> (T, Hq, D)."""
        ...

    def warmup(self, kv_cache: PagedKVCache, num_q_heads: int, dtype: torch.dtype, scale: float) -> float:
        """One-off start-up work for this cache layout (compilation); returns its seconds."""
        ...


class PagedAttentionBackend:
    """The step loop every backend shares: write this step's K/V, then attend decode groups batched
    and prompt chunks one sequence at a time. Subclasses say how to attend."""

    name = "base"

    @property
    def decode_group_padding(self) -> float:
        return DECODE_GROUP_PADDING  # read at each step: `bench.decode_step --no-grouping` sets it

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write(kv_cache, meta.slot_mapping, q, k, v)
        if len(meta.decode_groups) == 1 and meta.decode_groups[0].whole_step:  # e.g. one stream decoding
            return self.decode(q, kv_cache, meta.decode_groups[0], scale)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            if group.row_range is not None:
                lo, hi = group.row_range
                out[lo:hi] = self.decode(q[lo:hi], kv_cache, group, scale)
            else:
                out[group.rows] = self.decode(q[group.rows], kv_cache, group, scale)
        self.prefill_chunks(out, q, k, v, kv_cache, meta, scale)
        return out

    def prefill_chunks(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: PagedKVCache, meta: AttentionMetadata, scale: float) -> None:
        """The step's prompt chunks (meta.prefill_idx) into their rows of out: one at a time (prefill_into), unless a
        backend can take them together."""
        for i in meta.prefill_idx:
            lo, hi = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            self.prefill_into(out[lo:hi], q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, meta.block_tables[i],
                              meta.seq_lens[i], scale)

    def warmup(self, kv_cache: PagedKVCache, num_q_heads: int, dtype: torch.dtype, scale: float) -> float:
        return 0.0

    def write(self, kv_cache: PagedKVCache, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """This step's k, v (T, Hkv, D) to the cache at slots (T,); q (T, Hq, D) for its shapes."""
        kv_cache.write(slots, k, v)

    def decode(self, q: torch.Tensor, kv_cache: PagedKVCache, group: DecodeGroup, scale: float) -> torch.Tensor:
        """q (Bd, Hq, D): one query per sequence of the group -> (Bd, Hq, D)."""
        raise NotImplementedError

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache,
                block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
        """q (n, Hq, D), this chunk's k/v (n, Hkv, D), already in the cache; the chunk's last query sits
        at position seq_len - 1 -> (n, Hq, D)."""
        raise NotImplementedError

    def prefill_into(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_cache: PagedKVCache, block_table: torch.Tensor, seq_len: int, scale: float) -> None:
        """prefill, its result written to out (n, Hq, D): the step's rows of the chunk. Backends whose kernels can
        write there directly say so."""
        out.copy_(self.prefill(q, k, v, kv_cache, block_table, seq_len, scale))


def resolve_attention_backend(name: str, model_dtype: torch.dtype) -> str:
    """'auto' -> the backend measured fastest for this dtype (BENCHMARKS.md): the C++ decode kernel for
    float32 and 16-bit models; the compiled (inductor) kernel for float64 ones, which the C++ kernel does
    not take. Other names pass through."""
    if name != "auto":
        return name
    return "compiled" if model_dtype == torch.float64 else "cpp"


def get_attention_backend(name: str = "sdpa", model_dtype: torch.dtype = torch.float32,
                          quantized: bool = False) -> AttentionBackend:
    """auto: chosen by dtype (resolve_attention_backend); sdpa: torch's fused attention; cpp: decodes by a
    C++ kernel that reads the paged cache in place, prompts as sdpa; compiled: likewise with a kernel
    generated by torch.compile; torch: the plain reference the others are tested against.
    quantized: the model's linears are quantized (CppAttentionBackend's bf16_prompts)."""
    from pagoda.layers.attention.compiled import CompiledAttentionBackend
    from pagoda.layers.attention.cpp import CppAttentionBackend
    from pagoda.layers.attention.sdpa import SDPAAttentionBackend
    from pagoda.layers.attention.torch_ref import TorchAttentionBackend

    resolved = resolve_attention_backend(name, model_dtype)
    if resolved == "compiled":
        return CompiledAttentionBackend(strict=name == "compiled")
    if resolved == "cpp":
        return CppAttentionBackend(strict=name == "cpp", bf16_prompts=quantized)
    backends: dict[str, type] = {"sdpa": SDPAAttentionBackend, "torch": TorchAttentionBackend}
    if resolved not in backends:
        raise ValueError(f"attention backend must be one of auto, compiled, cpp, {', '.join(sorted(backends))}; "
                         f"got {name!r}")
    return backends[resolved]()  # type: ignore[no-any-return]
