"""The lean tokenizer (store/tokenizer.py: transformers' TokenizersBackend over the store's tokenizer.json) gives
what the model's own tokenizer class (AutoTokenizer) gives on the same folder: ids of raw text, decoded text with
and without special tokens, and chat templates rendered and tokenized, for every tokenizer the project ships
(the embedded SmolLM2; Qwen2.5-Coder and Gemma 3 where their part packages are installed)."""
from __future__ import annotations

import pytest

from streamspec_ray.store import sources, tokenizer

TEXTS = ["def f(x):\n    return x  ' s n't  <|endoftext|> ünï", "Hello world. How are you ?",
         "  leading spaces\n\n\ttab", "<bos>The <|im_start|>x", "数学 🙂 emoji"]
CHATS = [[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi <|im_start|> there"},
          {"role": "assistant", "content": "Yo."}, {"role": "user", "content": "Explain mutexes."}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]


def _folder(name: str, smol_store, tmp_path_factory) -> str:
    if name == "smollm2":
        from streamspec_ray.store.store import LayerStore
        return LayerStore(smol_store).tokenizer_path
    try:
        sources.part_files(name)
    except Exception:
        pytest.skip(f"{name}'s part packages are not installed")
    from streamspec_ray.store.gguf import GGUFSource
    root = tmp_path_factory.mktemp(name)
    gguf = sources.assemble(name, str(root / "m.gguf"))
    assert GGUFSource(gguf).save_tokenizer(str(root / "tokenizer"))
    (root / "m.gguf").unlink()
    return str(root / "tokenizer")


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_the_lean_tokenizer_gives_what_the_models_own_class_gives(name, smol_store, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = _folder(name, smol_store, tmp_path_factory)
    lean, own = tokenizer.load(folder), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = own(text)["input_ids"]
        assert lean(text)["input_ids"] == ids, text
        for skip in (True, False):
            assert lean.decode(ids, skip_special_tokens=skip) == own.decode(ids, skip_special_tokens=skip), text
    assert bool(lean.chat_template) == bool(own.chat_template)
    if own.chat_template:
        for chat in CHATS:
            kw = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
            assert lean.apply_chat_template(chat, **kw) == own.apply_chat_template(chat, **kw)
    assert lean.get_vocab() == own.get_vocab()
