"""Tokenizer: a thin wrapper over the Rust fast tokenizer (`tokenizers.Tokenizer`), adding the ids that
end generation, BOS handling as the model's files say, and chat templates rendered in jinja2's sandbox
(templates ship with model files: untrusted code). Built from a Hugging Face folder or GGUF metadata."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

MAX_TEMPLATE_BYTES = 64 * 1024
MAX_RENDERED_BYTES = 1024 * 1024
# Bound on the size of `a ** b` inside templates: a huge power would hang the renderer.
_MAX_POWER_BITS = 1 << 16

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, as transformers' GGUF conversion uses them.
# Types missing here (gpt2, smollm, ...) get the GPT-2 regex built into `ByteLevel`.
# Llama 3 and Qwen2 differ only in digit grouping (runs of up to 3 digits vs single digits).
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GGUF_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"),
                    _WORDS + r"|\p{N}{1,3}" + _REST),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _WORDS + r"|\p{N}" + _REST),
}


class Tokenizer:
    """The engine's tokenizer. `hf` is the raw fast tokenizer; everything else is derived metadata."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_token_ids: Iterable[int | None] = (),
        add_bos_token: bool = False,
        add_eos_token: bool = False,
    ) -> None:
        """`add_bos_token` / `add_eos_token`: add them in `encode` (GGUF files); HF folders leave both
        False because tokenizer.json's post-processor adds whatever the model wants."""
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        eos = set(extra_eos_token_ids)
        if eos_token_id is not None:
            eos.add(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.chat_template = chat_template
        vocab = hf.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        special = {i for i, token in hf.get_added_tokens_decoder().items() if token.special}
        special.update(i for i in (bos_token_id, eos_token_id, *special_token_ids) if i is not None)
        self.all_special_ids: frozenset[int] = frozenset(special)
        self._add_bos = add_bos_token
        self._add_eos = add_eos_token
        self._template: jinja2.Template | None = None  # compiled on first use

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # HF folders: tokenizer.json's post-processor adds BOS/EOS. GGUF: we add them as
        # tokenizer.ggml.add_bos_token says, but not twice when the text already starts with BOS
        # (e.g. a rendered chat template that writes {{ bos_token }} itself).
        ids = list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)
        bos, eos = self.bos_token_id, self.eos_token_id
        if add_special_tokens and self._add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        if add_special_tokens and self._add_eos and eos is not None and ids[-1:] != [eos]:
            ids.append(eos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render `messages` with the model's chat template, with the variables transformers passes."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        context: dict[str, Any] = {
            "messages": _validated_messages(messages),
            "add_generation_prompt": bool(add_generation_prompt),
        }
        # Like transformers, leave a missing special token undefined (renders as "") rather than "None".
        for name, token_id in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if token_id is not None:
                context[name] = self.hf.id_to_token(token_id)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return _render_limited(self._template, context)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the optional generation/special-token files."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{folder} has no tokenizer.json")
        hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")

        def token_id(name: str) -> int | None:
            content = _token_content(config.get(name, special_map.get(name)))
            return hf.token_to_id(content) if content is not None else None

        return cls(
            hf,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            extra_eos_token_ids=_int_list(generation.get("eos_token_id")),  # int or list in the file
            chat_template=_hf_chat_template(folder, config),
            special_token_ids=(token_id("unk_token"), token_id("pad_token")),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF `tokenizer.*` metadata (keys as in the file, values as plain Python)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens", [])]
        if not tokens:
            raise ValueError("GGUF file has no tokenizer.ggml.tokens")
        if kind == "gpt2":
            hf, spelled = _byte_level_bpe(meta, tokens)
        elif kind == "llama":
            hf, spelled = _sentencepiece_bpe(meta, tokens), tokens
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2, llama")

        def ggml_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos, eos, unk, pad = map(ggml_id, ("bos_token_id", "eos_token_id", "unknown_token_id",
                                           "padding_token_id"))
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or []]
        _add_gguf_added_tokens(hf, spelled, types, (bos, eos, unk, pad))
        # End-of-turn/end-of-message tokens also end generation (llama.cpp's "end of generation" set).
        extra_eos = [i for i in (ggml_id("eot_token_id"), ggml_id("eom_token_id")) if i is not None]
        template = meta.get("tokenizer.chat_template")
        return cls(hf, bos_token_id=bos, eos_token_id=eos, extra_eos_token_ids=extra_eos,
                   chat_template=str(template) if template is not None else None,
                   special_token_ids=(unk, pad),
                   # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
                   add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
                   add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)))


# ---- chat templates -------------------------------------------------------------------------------


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, plus: a bound on `*` and `**` so `'a' * 10**12` cannot exhaust memory or CPU, and
    unsafe attribute access (`''.__class__`) is an error instead of a silently empty value."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(count, int):
                    if len(seq) * count > MAX_RENDERED_BYTES:
                        raise jinja2.exceptions.SecurityError("chat template builds too long a sequence")
        elif isinstance(left, int) and isinstance(right, int) and left not in (-1, 0, 1):
            if abs(right) * left.bit_length() > _MAX_POWER_BITS:
                raise jinja2.exceptions.SecurityError("chat template computes too large a power")
        return super().call_binop(context, operator, left, right)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"chat template accessed unsafe attribute {attribute!r} of a {type(obj).__name__}"
        )


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` markers; they only render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping (jinja's default escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    if len(source.encode("utf-8")) > MAX_TEMPLATE_BYTES:
        raise ValueError(f"chat template is larger than {MAX_TEMPLATE_BYTES} bytes; refusing to compile it")
    env = _ChatTemplateEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


def _render_limited(template: jinja2.Template, context: dict[str, Any]) -> str:
    # Render chunk by chunk so a runaway template is stopped soon after it passes the limit.
    parts: list[str] = []
    size = 0
    try:
        for chunk in template.generate(**context):
            size += len(chunk.encode("utf-8"))
            if size > MAX_RENDERED_BYTES:
                raise ValueError(f"chat template output is larger than {MAX_RENDERED_BYTES} bytes")
            parts.append(chunk)
    except jinja2.TemplateError as exc:  # includes SecurityError from the sandbox and raise_exception()
        raise ValueError(f"chat template failed: {exc}") from exc
    return "".join(parts)


def _validated_messages(messages: object) -> list[dict[str, str]]:
    """Plain copies of the messages (the template sees only str values), or a ValueError naming the field."""
    if not isinstance(messages, list):
        raise ValueError("messages must be a list of {'role': str, 'content': str} dicts")
    clean: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict with str 'role' and 'content'")
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                raise ValueError(f"messages[{index}].{field} must be a string")
        for key, value in message.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"messages[{index}].{key} must be a string")
        clean.append({str.__str__(k): str.__str__(v) for k, v in message.items()})
    return clean


# ---- Hugging Face folders -------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _int_list(value: Any) -> list[int]:
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    # Newer transformers saves the template to chat_template.jinja; older ones inline it in the config,
    # either as a string or as a list of named templates.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


# ---- GGUF metadata --------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # control bytes, space...: shifted past 255
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str]) -> tuple[tokenizers.Tokenizer, list[str]]:
    """Byte-level BPE (GPT-2 style) as transformers builds it; returns it and the tokens as spelled in it."""
    table = _bytes_to_unicode()
    alphabet = set(table.values())
    # A token using characters outside the byte alphabet is respelled byte by byte, as transformers does.
    spelled = [t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8")) for t in tokens]
    merges = _parse_merges(meta.get("tokenizer.ggml.merges"))
    if not merges:
        raise ValueError("GGUF gpt2 tokenizer needs tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(spelled)}
    bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False)
    hf = tokenizers.Tokenizer(bpe)
    split = _GGUF_SPLITS.get(str(meta.get("tokenizer.ggml.pre", "")))
    if split is None:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    hf.decoder = decoders.ByteLevel()
    return hf, spelled


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """SentencePiece-style BPE with byte fallback (llama 1/2, mistral), as transformers' LlamaTokenizer."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _parse_merges(meta.get("tokenizer.ggml.merges"))
    if not merges:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("GGUF llama tokenizer needs tokenizer.ggml.scores (one per token) or merges")
        merges = _merges_from_scores(vocab, dict(zip(tokens, (float(s) for s in scores), strict=True)))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                         byte_fallback=True, dropout=None))
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    hf.decoder = decoders.Sequence(steps)
    return hf


def _parse_merges(raw: Any) -> list[tuple[str, str]]:
    """GGUF merges are "left right" strings (a space never occurs inside a token of a BPE vocab)."""
    merges: list[tuple[str, str]] = []
    for merge in raw or []:
        parts = str(merge).split(" ")
        if len(parts) != 2:
            raise ValueError(f"GGUF merge {merge!r} is not a 'left right' pair")
        merges.append((parts[0], parts[1]))
    return merges


def _merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges from a scored vocabulary (transformers' `generate_merges`, same order): every split of
    a token into two vocabulary tokens is a merge; higher-scored results merge first."""
    found: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_gguf_added_tokens(hf: tokenizers.Tokenizer, spelled: list[str], types: list[int],
                           special_ids: Iterable[int | None]) -> None:
    """CONTROL tokens (and bos/eos/unk/pad) become special added tokens, USER_DEFINED ones plain added
    tokens, so "<|im_start|>" stays one id. Only tokens spelled in the vocabulary under their own id:
    anything else would be appended as a new id, past the model's embedding table."""
    vocab = hf.get_vocab(with_added_tokens=False)
    control = {i for i, kind in enumerate(types) if kind == _CONTROL}
    control.update(i for i in special_ids if i is not None)
    special = [AddedToken(spelled[i], normalized=False, special=True)
               for i in sorted(control) if vocab.get(spelled[i]) == i]
    user = [AddedToken(spelled[i], normalized=False, special=False)
            for i, kind in enumerate(types) if kind == _USER_DEFINED and vocab.get(spelled[i]) == i]
    if special:
        hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)
