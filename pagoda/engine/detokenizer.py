"""Incremental detokenization: output token ids in, final text pieces out, at a constant cost per token.

The text of a request is defined as tokenizer.decode(output_ids, skip_special_tokens=...), decoded
without the prompt: the pieces returned by add_tokens() and finish() join to exactly that string.

Like vLLM's detokenize_incrementally, each step decodes only a short window of tokens:
ids[prefix_offset:] and ids[prefix_offset:read_offset]; the text the new tokens add is the
difference. The already-emitted tokens kept in front of the window (the prefix) give the decoder
the context it needs at the seam (a Metaspace leading space, a UTF-8 character split across
tokens). Text is held back while it may still change:
  - it ends in U+FFFD: a multi-byte character is still incomplete (a later token may finish it);
  - the last token is a byte-fallback token (<0xNN>): the ByteFallback decoder turns a whole run
    of such tokens into U+FFFDs if the run is not valid UTF-8 as a whole, so a later byte token
    can change the text of earlier ones;
  - the window's text does not extend the prefix's text (a decoder quirk): emit nothing yet.
finish() flushes what is held by decoding the whole output once, so the join is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

_REPLACEMENT_CHAR = "\ufffd"


def _is_byte_token(token: str | None) -> bool:
    """A SentencePiece-style byte-fallback token such as <0xE3>."""
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


class IncrementalDetokenizer:
    """Per-request detokenizer state. Not thread-safe; one per request (or per sequence of n > 1)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        # The prompt is not used as decode context: the output text is defined as the decode of
        # the output ids alone (so a Metaspace tokenizer drops the first output token's leading
        # space, as tokenizer.decode(output_ids) does). It is accepted for interface stability.
        del prompt_token_ids
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window; ids before it are never decoded again
        self._read_offset = 0  # ids before it have had their text emitted
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset]), cached
        self._text = ""
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far: the join of every piece returned."""
        return self._text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def _is_skipped(self, token_id: int) -> bool:
        """A special token that decode() drops: it does not end a byte-fallback run."""
        return (
            self._skip_special_tokens
            and not self._decode([token_id])
            and bool(self._tokenizer.decode([token_id], skip_special_tokens=False))
        )

    def _ends_in_byte_run(self) -> bool:
        """Whether the last new token the decoder sees is a byte-fallback token.

        Skipped special tokens never reach the decoder, so they are looked through. Tokens before
        read_offset need not be checked: when the offsets advanced, the last token the decoder saw
        was not a byte token.
        """
        for token_id in reversed(self._ids[self._read_offset:]):
            if _is_byte_token(self._tokenizer.id_to_token(token_id)):
                return True
            if not self._is_skipped(token_id):
                return False
        return False

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Appends newly generated ids; returns the text they make final (possibly "")."""
        if self._finished:
            raise RuntimeError("add_tokens() called after finish()")
        self._ids.extend(token_ids)
        if len(self._ids) == self._read_offset or self._ends_in_byte_run():
            return ""
        new_text = self._decode(self._ids[self._prefix_offset:])
        prefix_text = self._prefix_text
        if (
            len(new_text) <= len(prefix_text)
            or new_text.endswith(_REPLACEMENT_CHAR)
            or not new_text.startswith(prefix_text)
        ):
            return ""  # nothing final yet: keep the window open (the offsets stay)
        piece = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        self._text += piece
        return piece

    def finish(self) -> str:
        """Flushes the text held back (e.g. a trailing incomplete character, which decodes to U+FFFD).

        Decodes the whole output once, so that the join of all pieces equals that decode exactly.
        """
        if self._finished:
            return ""
        self._finished = True
        full = self._decode(self._ids)
        if full.startswith(self._text):
            piece = full[len(self._text):]
        else:
            # Cannot happen for the decoders we know of; emitted text cannot be taken back, so
            # fall back to the window's difference.
            window = self._decode(self._ids[self._prefix_offset:])
            piece = window[len(self._prefix_text):] if window.startswith(self._prefix_text) else ""
        self._text += piece
        return piece
