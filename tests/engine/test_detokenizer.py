"""IncrementalDetokenizer: the pieces join to exactly tokenizer.decode(output_ids), for any ids.

Small tokenizers are built here from hand-made vocabularies (trained ones are not deterministic
across runs, which would make hypothesis failures hard to reproduce):
  - byte-level BPE (GPT-2 style), whose merges include partial UTF-8 sequences (the first bytes of
    emoji and CJK characters);
  - SentencePiece-like BPE (Metaspace pre-tokenizer with prepend_scheme "first", byte fallback for
    every character outside its small alphabet), with either a Llama-2 style decoder (Replace,
    ByteFallback, Fuse, Strip) or a ByteFallback + Metaspace decoder.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pagoda.engine.detokenizer import IncrementalDetokenizer

WORDS = [
    " the", "the", " brown", " dog", "ing", " héllo", " wörld", " café",
    " 日本", "日本語", " 東京", " 😀", "😀😃",
]
# Characters that stress multi-byte handling: CJK, emoji (with ZWJ / skin tone / flags), combining marks.
TRICKY = list("日本語中文東京テキスト😀😃👍🏽🇯🇵👨‍👩‍👧🦀é\u0301\u0308\u0303ßÆø ") + ["\u200d", "\U0001f3fd"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _chain_merges(words: list[list[str]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges that build each word (a list of vocab units) left to right; adds new tokens to vocab."""
    merges: list[tuple[str, str]] = []
    for units in words:
        cur = units[0]
        for unit in units[1:]:
            if cur + unit not in vocab:
                vocab[cur + unit] = len(vocab)
                merges.append((cur, unit))
            cur += unit
    return merges


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _byte_level() -> Tokenizer:
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    # Partial UTF-8 pieces: " " + the first two bytes of every emoji, and of 日 / 本.
    words = [w.encode() for w in WORDS] + [b" \xf0\x9f", b"\xf0\x9f\x98", b"\xe6\x97", b"\xe6\x9c"]
    merges = _chain_merges([[b2u[b] for b in w] for w in words], vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>"])
    tok.add_tokens(["<tool>"])  # a non-special added token: never skipped
    return tok


def _sentencepiece_like(decoder: decoders.Decoder) -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for ch in "▁abcdefghijklmnopqrstuvwxyzéö日本東京😀":  # everything else falls back to bytes
        vocab[ch] = len(vocab)
    words = [list(w.replace(" ", "▁")) for w in WORDS if "語" not in w and "😃" not in w]
    merges = _chain_merges(words, vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoder
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


TOKENIZERS = {
    "byte_level": _byte_level(),
    "sp_llama2": _sentencepiece_like(
        decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    ),
    "sp_metaspace": _sentencepiece_like(
        decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    ),
}
NAMES = sorted(TOKENIZERS)


def _id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    assert token_id is not None
    return token_id


def _token(tok: Tokenizer, token_id: int) -> str:
    token = tok.id_to_token(token_id)
    assert token is not None
    return token


def _special_ids(tok: Tokenizer) -> list[int]:
    return [i for i, t in tok.get_added_tokens_decoder().items() if t.special]


def _stream(tok: Tokenizer, ids: Sequence[int], chunks: Sequence[int], skip: bool) -> tuple[list[str], str]:
    """Feeds ids in chunks of the given sizes (cycled); returns the pieces and the finish() piece."""
    det = IncrementalDetokenizer(tok, prompt_token_ids=[5, 6, 7], skip_special_tokens=skip)
    pieces: list[str] = []
    pos, k = 0, 0
    while pos < len(ids):
        size = max(1, chunks[k % len(chunks)]) if chunks else 1
        pieces.append(det.add_tokens(ids[pos:pos + size]))
        pos, k = pos + size, k + 1
    last = det.finish()
    assert det.text == "".join(pieces) + last
    return pieces, last


def _check_pieces(full: str, pieces: list[str], last: str) -> None:
    assert "".join(pieces) + last == full
    # Each U+FFFD a piece holds is one the full decode has at that same spot (implied by the
    # join; checked piecewise to make failures readable).
    pos = 0
    for piece in pieces:
        for j, ch in enumerate(piece):
            if ch == "\ufffd":
                assert full[pos + j] == "\ufffd"
        pos += len(piece)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("skip", [True, False])
@SETTINGS
@given(data=st.data())
def test_random_ids_join_to_full_decode(name: str, skip: bool, data: st.DataObject) -> None:
    tok = TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=40), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=5), label="chunks")
    pieces, last = _stream(tok, ids, chunks, skip)
    _check_pieces(tok.decode(ids, skip_special_tokens=skip), pieces, last)


text_strategy = st.text(
    st.one_of(st.characters(exclude_categories=["Cs"]), st.sampled_from(TRICKY)), max_size=30
)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("skip", [True, False])
@SETTINGS
@given(data=st.data())
def test_encoded_text_streams_without_broken_chars(name: str, skip: bool, data: st.DataObject) -> None:
    """Real text (with special tokens sprinkled in): no piece ever holds a U+FFFD, and at the end
    nothing is held back unless the output ends inside a byte-fallback run."""
    tok = TOKENIZERS[name]
    text = data.draw(text_strategy, label="text")
    ids = list(tok.encode(text, add_special_tokens=False).ids)
    specials = _special_ids(tok)
    for _ in range(data.draw(st.integers(0, 3), label="num_specials")):
        ids.insert(data.draw(st.integers(0, len(ids)), label="at"), data.draw(st.sampled_from(specials)))
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=4), label="chunks")
    pieces, last = _stream(tok, ids, chunks, skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    _check_pieces(full, pieces, last)
    if "\ufffd" not in full:
        assert all("\ufffd" not in p for p in pieces)
    if "\ufffd" not in full and not _ends_in_byte_run(tok, ids, skip):
        assert last == ""


def _ends_in_byte_run(tok: Tokenizer, ids: Sequence[int], skip: bool) -> bool:
    """Whether the last token that decodes to any text is a byte-fallback token."""
    for i in reversed(ids):
        if _token(tok, i).startswith("<0x"):
            return True
        if tok.decode([i], skip_special_tokens=skip):
            return False
    return False


def test_leading_space_matches_decode_of_output_alone() -> None:
    """Metaspace drops the first output token's leading space, as decode(output_ids) does."""
    for name in ("sp_llama2", "sp_metaspace"):
        tok = TOKENIZERS[name]
        ids = tok.encode("brown dog", add_special_tokens=False).ids
        assert _token(tok, ids[0]) == "▁brown"
        pieces, last = _stream(tok, ids, [1], True)
        assert pieces[0] == "brown"
        assert "".join(pieces) + last == tok.decode(ids) == "brown dog"


@pytest.mark.parametrize("name", NAMES)
def test_split_characters_wait_for_their_last_byte(name: str) -> None:
    """🦀 and 語 are spread over several tokens (partial UTF-8 tokens / byte-fallback tokens): no
    piece shows a broken character, and the text comes out once the character is complete."""
    tok = TOKENIZERS[name]
    ids = tok.encode("x🦀語 y", add_special_tokens=False).ids
    assert len(ids) >= 8
    det = IncrementalDetokenizer(tok, [])
    pieces = [det.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert [p for p in pieces if p] == ["x", "🦀", "語", " ", "y"] if name == "byte_level" else ["x🦀語 y"]
    assert det.finish() == ""


def test_finish_flushes_incomplete_trailing_bytes() -> None:
    tok = TOKENIZERS["sp_llama2"]
    det = IncrementalDetokenizer(tok, [])
    ids = tok.encode("ok", add_special_tokens=False).ids + [_id(tok, "<0xE4>"), _id(tok, "<0xB8>")]
    assert "".join(det.add_tokens([i]) for i in ids) == "ok"
    assert det.finish() == tok.decode(ids)[len("ok"):] == "\ufffd\ufffd"
    assert det.text == tok.decode(ids)
    with pytest.raises(RuntimeError):
        det.add_tokens([1])


class _RecordingTokenizer:
    """Wraps a Tokenizer and records how many ids each decode() call gets."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)


@pytest.mark.parametrize("name", NAMES)
def test_decode_window_stays_small(name: str) -> None:
    """Cost per token does not grow with the output: each step decodes a short window only
    (plus one full decode in finish())."""
    tok = TOKENIZERS[name]
    text = "héllo wörld, naïve café! 日本語のテキスト 東京 😀😃👍🏽 🇯🇵 "
    text += "👨\u200d👩\u200d👧 🦀 e\u0301 the dog. "
    ids = tok.encode(text * 10, add_special_tokens=False).ids
    assert len(ids) > 300
    rec = _RecordingTokenizer(tok)
    det = IncrementalDetokenizer(rec, [])  # type: ignore[arg-type]
    for i in ids:
        det.add_tokens([i])
    # A run of byte-fallback tokens is held (and then decoded) whole, and stays in the window as
    # the next step's prefix; apart from that the window is a few tokens long.
    longest_run, run = 0, 0
    for i in ids:
        run = run + 1 if _token(tok, i).startswith("<0x") else 0
        longest_run = max(longest_run, run)
    assert max(rec.sizes) <= 2 * longest_run + 8
    assert det.text + det.finish() == tok.decode(ids)
