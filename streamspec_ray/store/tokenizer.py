"""A store's tokenizer folder as transformers' tokenizer, loaded lean.

`TokenizersBackend.from_pretrained` rather than AutoTokenizer: the model's own class (Qwen2Tokenizer, ...) keeps
the parsed vocabulary and merges as Python objects beside the Rust tokenizer built from them, 94 MB for Qwen2.5's
151k tokens where the backend alone takes 49 MB. Under a memory limit those 45 MB come out of what streams. The
folder's tokenizer.json is what that class saved (store/convert.py), so the backend gives the same ids, text and
chat template: tests/test_tokenizer.py holds them equal for every tokenizer the project ships.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import TokenizerMismatch

if TYPE_CHECKING:
    from .store import LayerStore


def load(folder: str):
    """The tokenizer saved in `folder` (tokenizer.json and tokenizer_config.json)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(folder)


def check_vocab(target: LayerStore, draft: LayerStore) -> None:
    """Draft and target must give every token the same id, or verification compares different tokens. Their heads
    may differ in size (padding rows past the tokenizer's last token: pad_vocab handles it), but every token of
    either tokenizer, ordinary or special, must have the same id in the other, or the draft is refused."""
    a, b = target.args.vocab_size, draft.args.vocab_size
    if not (target.tokenizer_path and draft.tokenizer_path):
        if a != b:
            raise TokenizerMismatch(f"draft vocabulary ({b} tokens, {draft.root}) differs from the target's ({a} tokens)")
        return
    va = load(target.tokenizer_path).get_vocab()
    vb = load(draft.tokenizer_path).get_vocab()
    moved = sorted(t for t in va.keys() & vb.keys() if va[t] != vb[t])
    only = sorted(set(va) ^ set(vb))
    if moved or only:
        eg = (f"{moved[0]!r} is {va[moved[0]]} in the target, {vb[moved[0]]} in the draft" if moved
              else f"{only[0]!r} is in only one of them")
        raise TokenizerMismatch(f"draft tokenizer ({draft.root}) does not match the target's: {len(moved)} tokens "
                                f"with other ids, {len(only)} in only one of them (e.g. {eg})")
    if max(va.values()) >= min(a, b):
        raise TokenizerMismatch(f"token id {max(va.values())} has no row in the "
                                f"{'target' if a <= b else 'draft'}'s head ({min(a, b)} rows)")
