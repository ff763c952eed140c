"""The passkey retrieval task (raw completion, no chat template, no BOS): an
intro, filler lines, at a chosen depth the key sentence, more filler, then the
question. A hit is the 5-digit key in the first 8 generated tokens. SmolLM2
answers it with exact attention; a sink-plus-window cache cannot."""

from __future__ import annotations

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
          "Here we go. There and back again.")
QUESTION = "What is the pass key? The pass key is"


def needle(key: int) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def passkey(n_filler: int, depth: float, key: int) -> str:
    """The prompt with `n_filler` filler lines, the needle after int(n_filler * depth)."""
    at = int(n_filler * depth)
    return "\n".join([INTRO] + [FILLER] * at + [needle(key)] + [FILLER] * (n_filler - at)
                     + [QUESTION])


def passkey_hit(key: int, text: str) -> bool:
    """A hit: the key in the generated text (the caller passes the first 8 tokens')."""
    return str(key) in text


def passkey_ids(tok, length: int, depth: float, key: int) -> list[int]:
    """The longest passkey prompt of at most `length` tokens (binary search on the
    number of filler lines)."""
    lo, hi = 1, length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tok.encode(passkey(mid, depth, key))) <= length:
            lo = mid
        else:
            hi = mid - 1
    return tok.encode(passkey(lo, depth, key))
