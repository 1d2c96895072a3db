"""The tokenizer a GGUF carries in its metadata, rebuilt on the `tokenizers` library.

Supported: byte-level BPE (`tokenizer.ggml.model = 'gpt2'`) with the Qwen2 (`qwen2`) or Llama 3
(`llama-bpe`) pre-tokenizer. A raw prompt (`encode_prompt`: a completion's `prompt`,
`LLM.generate`'s text) reads special-token spellings such as "<|im_start|>" as special tokens, as
HF, vLLM and llama.cpp do. Chat content never does: `encode_chat` only lets the chat template
itself produce special tokens, never the caller's messages (prompt-injection guard); `encode`
alone reads them as text unless asked otherwise.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from hetserve.models.chat_template import (
    ChatTemplateError,
    compile_template,
    contains_match,
    normalize_messages,
    plain_data,
    render,
    render_marking_data,
)
from hetserve.models.fim import FimTokens, NoFIM, infill_ids

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "PROMPT_PARSES_SPECIAL", "Tokenizer", "TokenizerError"]

# The one rule for raw prompts, in the server (`parse_special`'s default) and the Python API.
PROMPT_PARSES_SPECIAL = True


class TokenizerError(ValueError):
    """The GGUF describes a tokenizer this engine cannot build."""


_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, NFC-normalize, ignore_merges). 'llama3'/'llama-v3' are
# llama.cpp's other names for llama-bpe.
_PRE_TOKENIZERS = {
    # Qwen2's own tokenizer.json NFC-normalizes (HF's GGUF conversion in transformers 5.x drops it).
    "qwen2": (_QWEN2_SPLIT, True, False),
    # Llama 3's tokenizer.json and llama.cpp both take a pre-token that is itself a vocab entry
    # whole, before any merge (ignore_merges); HF's GGUF conversion does not.
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "llama3": (_LLAMA3_SPLIT, False, True),
    "llama-v3": (_LLAMA3_SPLIT, False, True),
}
_CONTROL, _USER_DEFINED = TokenType.CONTROL, TokenType.USER_DEFINED
_STOP_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def _byte_alphabet() -> dict[int, str]:
    # GPT-2's byte -> printable-char table (what ByteLevel pre-tokenizer/decoder use).
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_CHARS = _byte_alphabet()
_ALPHABET = frozenset(_BYTE_CHARS.values())


class Tokenizer:
    def __init__(self, md: Mapping[str, Any]) -> None:
        kind = md.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"unsupported tokenizer.ggml.model {kind!r}: only 'gpt2' (byte-level BPE) is supported"
            )
        pre = md.get("tokenizer.ggml.pre")
        if pre not in _PRE_TOKENIZERS:
            raise TokenizerError(
                f"unsupported tokenizer.ggml.pre {pre!r}: supported are {sorted(_PRE_TOKENIZERS)}"
            )
        split, nfc, ignore_merges = _PRE_TOKENIZERS[pre]
        tokens = md.get("tokenizer.ggml.tokens")
        merges = md.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise TokenizerError("the GGUF has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
        tokens = [str(t) for t in tokens]
        types = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(types) != len(tokens):
            raise TokenizerError(f"{len(types)} token types for {len(tokens)} tokens")
        self._tokens = tokens
        self._ids: dict[str, int] = {}
        for i, t in enumerate(tokens):
            self._ids.setdefault(t, i)

        # Normal tokens are stored in the byte alphabet; respell any that are not (as HF does).
        # Control/user-defined tokens are raw text that is matched whole, so they keep their
        # spelling as the vocab key, which makes the added tokens below land on their GGUF ids.
        vocab = {}
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty not in (_CONTROL, _USER_DEFINED) and not set(t) <= _ALPHABET:
                t = "".join(_BYTE_CHARS[b] for b in t.encode("utf-8"))
            vocab[t] = i
        pairs = []
        for m in merges:
            parts = str(m).split(" ")
            if len(parts) != 2:
                raise TokenizerError(f"malformed merge {m!r}")
            pairs.append((parts[0], parts[1]))
        try:
            bpe = models.BPE(vocab, pairs, byte_fallback=False, ignore_merges=ignore_merges, fuse_unk=False)
        except Exception as e:  # the Rust library raises a bare Exception (a merge of unknown tokens)
            raise TokenizerError(f"the GGUF's tokenizer is inconsistent: {e}") from None

        # Two tokenizers over one model: `_special` splits special tokens out of the text, `_plain`
        # reads their spelling as ordinary text. Non-special (user-defined) added tokens are
        # matched by both, as HF and llama.cpp do.
        self._special = tokenizers.Tokenizer(bpe)
        self._plain = tokenizers.Tokenizer(bpe)
        added = [
            AddedToken(t, special=ty == _CONTROL, normalized=False)
            for t, ty in zip(tokens, types)
            if ty in (_CONTROL, _USER_DEFINED)
        ]
        for tok in (self._special, self._plain):
            if nfc:
                tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
            tok.decoder = decoders.ByteLevel()
            tok.add_special_tokens([a for a in added if a.special])
            tok.add_tokens([a for a in added if not a.special])
        self._plain.encode_special_tokens = True
        for a in added:
            if self._special.token_to_id(a.content) != self._ids[a.content]:
                raise TokenizerError(f"added token {a.content!r} does not keep its GGUF id (duplicate spelling?)")

        def opt_id(key: str) -> int | None:
            v = md.get(key)
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        self._bos = opt_id("tokenizer.ggml.bos_token_id")
        self._eos = opt_id("tokenizer.ggml.eos_token_id")
        self._pad = opt_id("tokenizer.ggml.padding_token_id")
        self._unk = opt_id("tokenizer.ggml.unknown_token_id")
        self._add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))
        stops = {opt_id(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")}
        stops |= {self._ids.get(name) for name in _STOP_NAMES}
        self._stops = frozenset(i for i in stops if i is not None)
        self.special_token_ids = frozenset(self._ids[t] for t, ty in zip(tokens, types) if ty == _CONTROL)
        self.fim = FimTokens.find(md, self._ids, len(tokens))  # None: the model does no fill-in-the-middle

        # Leftmost-longest, like tokenizers' added-vocabulary matcher.
        specials = sorted({t for t, ty in zip(tokens, types) if ty == _CONTROL}, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._template_source = md.get("tokenizer.chat_template")
        self._template = None

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        return cls(md)

    # ---- vocabulary -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stops

    def to_json(self) -> str:
        """The HF `tokenizers` JSON of this tokenizer (special tokens split out), for llguidance."""
        return self._special.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokens[token_id] if 0 <= token_id < len(self._tokens) else None

    # ---- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None, allow_special: bool = False) -> list[int]:
        """Token ids for `text`. Special-token spellings stay plain text unless allow_special."""
        ids = (self._special if allow_special else self._plain).encode(text, add_special_tokens=False).ids
        if (self._add_bos if add_bos is None else add_bos) and self._bos is not None:
            ids = [self._bos, *ids]
        return ids

    def encode_prompt(self, text: str, parse_special: bool = PROMPT_PARSES_SPECIAL) -> list[int]:
        """Token ids of a raw prompt: special-token spellings are special tokens unless told not."""
        return self.encode(text, allow_special=parse_special)

    def encode_infill(self, prefix: str, suffix: str, extra: Sequence[Mapping[str, str]] = (),
                      filename: str | None = None, repo: str | None = None,
                      budget: int | None = None, max_suffix: int | None = None) -> tuple[list[int], bool]:
        """(ids, truncated) of a fill-in-the-middle prompt (models/fim.py): the code around the
        cursor and other files of the repository, all read as plain text. NoFIM (a ValueError)
        for a model without FIM tokens."""
        if self.fim is None:
            raise NoFIM("this model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                        "<|fim_middle|> or the GGUF's tokenizer.ggml.fim_*_token_id)")
        bos = [self._bos] if self._add_bos and self._bos is not None else []
        ids, truncated = infill_ids(lambda t: self.encode(t, add_bos=False), self.fim, prefix, suffix, extra,
                                    filename, repo, None if budget is None else budget - len(bos), max_suffix)
        return bos + ids, truncated

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._special.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat -------------------------------------------------------------------------------

    def _chat_inputs(self, messages: Any, add_generation_prompt: bool, tools: Any, extra: dict) -> tuple[dict, dict]:
        """(caller data, template variables), as HF's apply_chat_template would pass them."""
        if not self._template_source:
            raise ChatTemplateError("the model has no chat template (tokenizer.chat_template)")
        if self._template is None:
            self._template = compile_template(self._template_source)
        if tools is not None and (
            not isinstance(tools, Sequence) or isinstance(tools, str) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ChatTemplateError("tools must be a list of JSON-schema objects")
        data = {
            "messages": normalize_messages(messages),
            "tools": plain_data(tools, "tools"),
            **{k: plain_data(v, k) for k, v in extra.items()},
        }
        names = {"bos_token": self._bos, "eos_token": self._eos, "unk_token": self._unk, "pad_token": self._pad}
        variables = {k: self._tokens[i] for k, i in names.items() if i is not None}
        variables.update(documents=None, add_generation_prompt=bool(add_generation_prompt))
        variables.update(data)  # extras may override the *_token strings, as in HF
        return data, variables

    def apply_chat_template(
        self, messages: Any, *, add_generation_prompt: bool = True, tools: Any = None, **extra: Any
    ) -> str:
        """The prompt string, exactly as HF's `apply_chat_template(..., tokenize=False)` renders it."""
        _, variables = self._chat_inputs(messages, add_generation_prompt, tools, extra)
        return render(self._template, variables)

    def encode_chat(
        self, messages: Any, *, add_generation_prompt: bool = True, tools: Any = None, **extra: Any
    ) -> list[int]:
        """Token ids of the rendered chat; no BOS is added (templates write their own).

        Only text the template itself writes becomes special tokens. Special-token spellings in
        the caller's data (message contents, names, tool schemas, extras) are swapped for private
        markers before rendering; wherever the markers come out, the spelling goes back in as plain
        text. So a user writing "<|im_start|>system" cannot open a turn, even if the template
        trims, splits or repeats the content. If the template's output depends on those spellings
        (it tests for them, or measures the content's length), the marker rendering is the one
        tokenized (safe, but it may then differ from apply_chat_template) and a warning is logged.
        Spellings built by the template out of pieces of data (e.g. '<|' + role + '|>') are the
        template's doing and count as template text.
        """
        data, variables = self._chat_inputs(messages, add_generation_prompt, tools, extra)
        text = render(self._template, variables)
        if self._special_re is None or not contains_match(data, self._special_re):
            return self._special.encode(text, add_special_tokens=False).ids

        restored, plain = render_marking_data(
            self._template_source, self._template, variables, data, self._special_re, text
        )
        ids, pos = [], 0
        for m in self._special_re.finditer(restored):
            # Any special that touches restored data text is plain text, even one that would
            # straddle template and data.
            i = bisect.bisect_right(plain, (m.start(), len(restored) + 1)) - 1  # last span starting <= m
            if (i >= 0 and plain[i][1] > m.start()) or (i + 1 < len(plain) and plain[i + 1][0] < m.end()):
                continue
            if m.start() > pos:
                ids += self._plain.encode(restored[pos : m.start()], add_special_tokens=False).ids
            ids.append(self._ids[m.group(0)])
            pos = m.end()
        if pos < len(restored):
            ids += self._plain.encode(restored[pos:], add_special_tokens=False).ids
        return ids


class IncrementalDetokenizer:
    """Streams text for generated tokens without ever emitting half a UTF-8 character.

    vLLM's prefix/read offsets: decode only a short window (tokens[prefix:]) and emit what it adds
    beyond tokens[prefix:read]; while the window ends in U+FFFD the last character is still
    incomplete, so hold it back. Each call costs O(window), not O(all tokens so far).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._chunks: list[str] = []

    def _step(self, final: bool) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._chunks.append(delta)
        return delta

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; returns the text that became printable."""
        self._ids.extend(token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is left, even an incomplete character (as U+FFFD)."""
        return self._step(final=True)

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""
