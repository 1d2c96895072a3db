"""Fill-in-the-middle: the FIM tokens a GGUF's vocabulary carries, and the layout of an infill
prompt.

The tokens are read as llama.cpp reads them: the `tokenizer.ggml.fim_*_token_id` fields where
the file has them, else the spellings the coder families use (Qwen2.5-Coder's
`<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`, `<|fim_pad|>`, `<|repo_name|>`,
`<|file_sep|>`). The prompt is Qwen2.5-Coder's repository format, prefix first (PSM):

    <|repo_name|>NAME\\n <|file_sep|>PATH\\nTEXT ... <|file_sep|>PATH\\n
    <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>

The other files come first and the text before the cursor next, so that from one keystroke to
the next the prefix cache carries everything up to the cursor: only the suffix and what was
typed are computed again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# role -> (the GGUF field's short name, the spellings tried when the field is absent)
_ROLES = {
    "prefix": ("fim_pre", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>")),
    "suffix": ("fim_suf", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>")),
    "middle": ("fim_mid", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>")),
    "pad": ("fim_pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>")),
    "repo": ("fim_rep", ("<|repo_name|>", "<reponame>")),
    "sep": ("fim_sep", ("<|file_sep|>", "<file_sep>")),
}
REPO_NAME = "repo"  # what the repository header says when the request names none


class NoFIM(ValueError):
    """The model's vocabulary has no fill-in-the-middle tokens."""


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    sep: int | None = None

    @classmethod
    def find(cls, md: Mapping[str, Any], token_ids: Mapping[str, int], vocab_size: int) -> FimTokens | None:
        """The file's FIM tokens, or None where it lacks the three that make a FIM prompt."""
        found = {}
        for role, (field, spellings) in _ROLES.items():
            v = md.get(f"tokenizer.ggml.{field}_token_id")
            if isinstance(v, int) and 0 <= v < vocab_size:
                found[role] = v
            else:
                found[role] = next((token_ids[s] for s in spellings if s in token_ids), None)
        if None in (found["prefix"], found["suffix"], found["middle"]):
            return None
        return cls(**found)

    @property
    def stops(self) -> set[int]:
        """Tokens that end a fill: past them the model writes padding or another file."""
        return {t for t in (self.pad, self.repo, self.sep) if t is not None}


def infill_ids(encode: Callable[[str], list[int]], fim: FimTokens, prefix: str, suffix: str,
               extra: Sequence[Mapping[str, str]] = (), filename: str | None = None,
               repo: str | None = None, budget: int | None = None,
               max_suffix: int | None = None) -> tuple[list[int], bool]:
    """(prompt ids, truncated). `encode` reads text as plain text. The suffix keeps its first
    `max_suffix` tokens: it follows the cursor, so every keystroke computes it again, and its
    head is what the fill must join. Over `budget` tokens the text nearest the cursor is kept:
    the suffix's head up to a quarter, the prefix's tail, then the other files, dropped from the
    first while they do not fit (`truncated`)."""
    pre, suf = encode(prefix), encode(suffix)
    if max_suffix is not None:
        suf = suf[:max_suffix]
    files = []
    if fim.sep is not None and (extra or filename):
        for chunk in extra:
            text = chunk.get("text", "")
            files.append([fim.sep, *encode(f"{chunk.get('filename') or 'file'}\n{text}"
                                           + ("" if not text or text.endswith("\n") else "\n"))])
        files.append([fim.sep, *encode(f"{filename or 'file'}\n")])
    head = [fim.repo, *encode(f"{repo or REPO_NAME}\n")] if files and fim.repo is not None else []
    truncated = False
    if budget is not None:
        room = budget - 3 - len(head) - (len(files[-1]) if files else 0)
        if room < 1:
            raise ValueError(f"the prompt leaves no room for the text around the cursor ({budget} tokens)")
        if len(pre) + len(suf) > room:
            truncated = True
            suf = suf[: max(room // 4, room - len(pre))]
            pre = pre[len(pre) - (room - len(suf)):]
        room -= len(pre) + len(suf)
        kept = files[:-1]
        while kept and sum(map(len, kept)) > room:
            kept.pop(0)
            truncated = True
        files = kept + files[-1:] if files else []
    ids = head + [t for f in files for t in f]
    return ids + [fim.prefix, *pre, fim.suffix, *suf, fim.middle], truncated
