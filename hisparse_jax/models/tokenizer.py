"""The model's own tokenizer: HF `tokenizers` BPE, a jinja2 chat template, and
incremental detokenization for streaming.

From a GGUF (`from_gguf_fields`): the byte-level BPE is rebuilt from the file's
vocabulary and merges. With pre-tokenizer `Sequence([Digits(individual_digits),
ByteLevel(regex)])` (the GGUF's `pre = smollm`) and the control tokens (type 3)
as special tokens, this gives exactly llama.cpp's ids (checked against it in
tests/test_models_llamacpp.py). `pre = qwen2` and the llama3 names split with
llama.cpp's regex for them, as Qwen2's and Llama 3's tokenizer.json do; the
split is checked against that regex (tests/test_models_loader_errors.py), not
against llama.cpp. From an HF folder: tokenizer.json, tokenizer_config.json and
chat_template.jinja."""

from __future__ import annotations

import functools
import json
import os
import re

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


# llama.cpp's split regexes (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2 and
# _LLAMA3; the models' tokenizer.json have the same with (?i:'s|...)), applied as
# those tokenizer.json do: Split(isolated), then ByteLevel without its own regex.
QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
               r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe")  # llama.cpp's names for LLAMA3
PRE_TOKENIZERS = ("smollm", "gpt-2", "qwen2", *LLAMA3_NAMES)


def _pre_tokenizer(pre: str | None, where: str):
    """The GGUF `tokenizer.ggml.pre` names we rebuild (smollm checked against
    llama.cpp; qwen2 and llama3 against their regex, see the module docstring)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    if pre == "gpt-2":  # smollm's regex without the digit split
        return byte_level
    if pre == "qwen2" or pre in LLAMA3_NAMES:
        split = pre_tokenizers.Split(tokenizers.Regex(
            QWEN2_SPLIT if pre == "qwen2" else LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=False)])
    supported = ", ".join(PRE_TOKENIZERS)
    # None and "default" are llama.cpp's fallback (four regexes applied in turn),
    # which we have not matched against llama.cpp
    if pre is None:
        raise ValueError(f"{where}: GGUF lacks tokenizer.ggml.pre (llama.cpp's 'default' "
                         f"split is not supported; supported: {supported})")
    if pre == "default":
        raise ValueError(f"{where}: GGUF pre-tokenizer 'default' (llama.cpp's fallback split) "
                         f"is not supported (supported: {supported})")
    raise ValueError(f"{where}: unsupported GGUF pre-tokenizer {pre!r} (supported: "
                     f"{supported})")


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """ids <-> text. `encode` parses special tokens in the text (as llama.cpp's
    tokenize(special=True)) and adds BOS only if the model asks for it."""

    def __init__(self, hf: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 add_bos: bool = False, eos_ids: tuple[int, ...] = ()):
        self.hf = hf
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos = add_bos
        self.bos_id = hf.token_to_id(bos_token) if bos_token else None
        # Generation stops at EOS and at any end-of-turn/-text marker the vocabulary
        # holds as a special token (ChatML's <|im_end|>, Llama 3's <|eot_id|>, ...).
        special = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        ends = [hf.token_to_id(eos_token) if eos_token else None]
        ends += [special[t] for t in END_TOKENS if t in special]
        self.eos_ids = tuple(dict.fromkeys(i for i in (*eos_ids, *ends) if i is not None))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        # encode_batch lets go of the GIL (encode does not): a long text tokenized in
        # a server's worker thread does not stop its event loop
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for: a byte-level token can be part of a UTF-8
        character, which its decoded text (U+FFFD) does not show."""
        piece = self.hf.id_to_token(int(i))
        if piece is None:
            return b""
        if int(i) in self._added:  # special and added tokens are literal text
            return piece.encode()
        alphabet = self._byte_alphabet
        if alphabet is not None and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        if m := _BYTE_PIECE.fullmatch(piece):  # SentencePiece's byte fallback
            return bytes([int(m[1], 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word marker

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for."""
        return max(1, *(len(self.token_bytes(i)) for i in range(self.vocab_size)))

    def min_tokens(self, text_bytes: int) -> int:
        """A lower bound of the tokens of any text of `text_bytes` UTF-8 bytes, found
        without tokenizing it: text_bytes / max_token_bytes where each token is the
        bytes of the text it consumed (a byte-level vocabulary, no normalizer, no
        added token that strips the spaces beside it); else 0, no bound."""
        return -(-text_bytes // self.max_token_bytes) if self._bytes_bound_exact else 0

    @functools.cached_property
    def _bytes_bound_exact(self) -> bool:
        return (self._byte_alphabet is not None and self.hf.normalizer is None
                and not any(t.lstrip or t.rstrip
                            for t in self.hf.get_added_tokens_decoder().values()))

    @functools.cached_property
    def _added(self) -> frozenset[int]:
        return frozenset(self.hf.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_alphabet(self) -> dict[str, int] | None:
        """GPT-2's printable stand-ins for the 256 bytes, back to bytes, when the
        decoder is byte-level."""
        if not isinstance(self.hf.decoder, decoders.ByteLevel):
            return None
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                     *range(ord("\u00ae"), ord("\u00ff") + 1)]
        rest = [b for b in range(256) if b not in printable]
        return {**{chr(b): b for b in printable},
                **{chr(256 + n): b for n, b in enumerate(rest)}}

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The chat template rendered as transformers does (sandboxed jinja2,
        trim_blocks, lstrip_blocks)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:  # the model's template, broken or refusing these messages
            raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from None

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a chat (the template writes any BOS itself)."""
        return self.encode(self.render_chat(messages), add_bos=False)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)

    # ------------------------------------------------------------ construction

    @classmethod
    def from_gguf_fields(cls, get, where: str = "GGUF") -> Tokenizer:
        """From GGUF metadata; get(key, default) reads one field; errors name `where`."""
        kind = get("tokenizer.ggml.model", None)
        if kind != "gpt2":
            raise ValueError(f"{where}: unsupported GGUF tokenizer model {kind!r} (byte-level "
                             "BPE 'gpt2' only)")
        tokens = get("tokenizer.ggml.tokens", None)
        merges = get("tokenizer.ggml.merges", None)
        if not tokens or merges is None:
            raise ValueError(f"{where}: GGUF tokenizer lacks tokenizer.ggml.tokens or .merges")
        pre = get("tokenizer.ggml.pre", None)
        pre_tokenizer = _pre_tokenizer(pre, where)
        llama3 = pre in LLAMA3_NAMES
        types = get("tokenizer.ggml.token_type", None) or [TOKEN_NORMAL] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        # llama3: a word that is itself a token is taken whole (llama.cpp's and
        # tokenizer.json's ignore_merges)
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                         ignore_merges=llama3)
        hf = tokenizers.Tokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizer
        hf.decoder = decoders.ByteLevel()
        added = [tokenizers.AddedToken(t, special=ty == TOKEN_CONTROL, normalized=False)
                 for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        hf.add_special_tokens([a for a in added if a.special])
        hf.add_tokens([a for a in added if not a.special])

        def token(key):
            i = get(key, None)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        return cls(hf, chat_template=get("tokenizer.chat_template", None),
                   bos_token=token("tokenizer.ggml.bos_token_id"),
                   eos_token=token("tokenizer.ggml.eos_token_id"),
                   # llama.cpp adds BOS for llama3 unless the file says otherwise
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", llama3)))

    @classmethod
    def from_hf_dir(cls, path: str, eos_ids: tuple[int, ...] = ()) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (chat template, BOS/EOS)."""
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ValueError(f"{path}: no tokenizer.json")
        try:
            hf = tokenizers.Tokenizer.from_file(tj)
        except Exception as e:  # noqa: BLE001 (the Rust tokenizer's error: one line)
            raise ValueError(f"{tj}: not a readable tokenizer ({e})") from None
        conf = {}
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tc):
            try:
                with open(tc, encoding="utf-8") as f:
                    conf = json.load(f)
            except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError
                raise ValueError(f"{tc}: cannot read ({e})") from None
            if not isinstance(conf, dict):
                raise ValueError(f"{tc}: expected a JSON object, got {type(conf).__name__}")
        template = conf.get("chat_template")
        if isinstance(template, list):  # [{name, template}]: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            template[0]["template"] if template else None)
        # Recent transformers write the template to its own file, and read that
        # file first when both exist.
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            try:
                with open(jinja, encoding="utf-8") as f:
                    template = f.read()
            except (OSError, ValueError) as e:
                raise ValueError(f"{jinja}: cannot read ({e})") from None

        def name(v):
            return v.get("content") if isinstance(v, dict) else v

        return cls(hf, chat_template=template, bos_token=name(conf.get("bos_token")),
                   eos_token=name(conf.get("eos_token")),
                   add_bos=bool(conf.get("add_bos_token", False)), eos_ids=eos_ids)

    def save_hf(self, path: str, model_max_length: int | None = None):
        """tokenizer.json and tokenizer_config.json (what `from_hf_dir` and
        transformers read)."""
        self.hf.save(os.path.join(path, "tokenizer.json"))
        added = {str(i): {"content": t.content, "special": t.special, "normalized": False,
                          "lstrip": False, "rstrip": False, "single_word": False}
                 for i, t in self.hf.get_added_tokens_decoder().items()}
        conf = {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": self.add_bos,
                "add_eos_token": False, "bos_token": self.bos_token,
                "eos_token": self.eos_token, "clean_up_tokenization_spaces": False,
                "added_tokens_decoder": added}
        if model_max_length:
            conf["model_max_length"] = model_max_length
        if self.chat_template:
            conf["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(conf, f, indent=2, ensure_ascii=False)


class StreamDecoder:
    """Text of a growing id sequence, piece by piece. Bytes that do not yet make a
    whole UTF-8 character (a byte-level token can end mid-character) are held
    until they do; the text decoded so far is never re-emitted (vLLM's scheme:
    decode a short window, emit what it adds)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0    # ids already emitted

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD)."""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]
