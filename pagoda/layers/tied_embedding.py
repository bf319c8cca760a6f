"""A token embedding tied to a linear layer (a tied lm_head: the same (vocab, hidden) weight) whose packed form
holds that weight's values exactly: the embedding reads its rows from the packed form, so that the plain weight can
be freed instead of staying beside it (the default model's: 108 MiB in float32, 54 MiB in bfloat16).

Two packed forms qualify: the float tiles (pagoda/layers/linear.py's prepack_linears, always exact) and a Q8_0
lm_head's records (pagoda/layers/q4_linear.py's quantize_linears, where the weight was Q8_0 to begin with: the
default model's embedding is Q8_0 in its GGUF file, so its float32 values come back bit for bit; other weights keep
their plain copy). A row gathered from either is a strided read (one element a panel column or record), ~8x slower
than a plain row's copy (10-12 ms for a 2,048-token step in float32, 8 ms from Q8_0 records, ad hoc): ~0.3-0.5% of
a run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# How the rows are laid out, for the one-call decode forward's embed_row (pagoda/model/one_stream.cpp)
ROWS, TILES, Q8_0 = 0, 1, 2


def tied_embeddings(model: nn.Module, layer: nn.Linear) -> list[tuple[nn.Module, str, nn.Embedding]] | None:
    """The embeddings that hold the layer's weight as theirs (a tied lm_head's), each with its parent module and
    name there: [] where nothing else holds it, None where something other than a plain embedding does (one with
    max_norm, which rewrites its rows, or any other module or parameter slot)."""
    w = layer.weight
    holders = sum(p is w for _, p in model.named_parameters(remove_duplicate=False))
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if child is not layer and isinstance(child, nn.Embedding) and child.weight is w]
    if holders != 1 + len(found) or any(e.max_norm is not None for _, _, e in found):
        return None
    return found


class TiedEmbedding(nn.Module):
    """An embedding whose rows come from its tied linear's packed weight: rows(packed(), ids, dim) gives weight[ids]
    as the freed weight held it; packed() is looked up at each call (move_weights_to_huge_pages replaces the packed
    tensors); layout (TILES or Q8_0) tells the one-call forward how to read it. `weight` is the linear's (empty)
    parameter, for code that asks the embedding's dtype."""

    def __init__(self, embedding: nn.Embedding, linear: nn.Linear, packed: Callable[[], torch.Tensor],
                 rows: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], layout: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = linear.weight
        self._packed, self._rows, self.layout = packed, rows, layout

    @property
    def packed(self) -> torch.Tensor:
        return self._packed()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}); got {int(ids.min())} to "
                             f"{int(ids.max())}")
        return self._rows(self.packed, ids, self.embedding_dim)


def tie_to_packed(linear: nn.Linear, embeddings: list[tuple[nn.Module, str, nn.Embedding]],
                  packed: Callable[[], torch.Tensor], rows: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
                  layout: int) -> int:
    """Free the linear's plain weight (an empty parameter of its dtype stays, as for layers without a tie) and put
    TiedEmbeddings reading packed() in the embeddings' places (tied_embeddings's list); returns the bytes freed."""
    nbytes = free_weight(linear)
    for parent, name, embedding in embeddings:
        setattr(parent, name, TiedEmbedding(embedding, linear, packed, rows, layout))
    return nbytes


def free_weight(linear: nn.Linear) -> int:
    """Replace a linear's plain weight, which its packed form makes unread, by an empty parameter of its dtype (for
    code that looks at dtypes); returns the bytes freed."""
    w = linear.weight
    linear.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
    return w.numel() * w.element_size()
