"""A character tokenizer for the toy tasks, savable as a Hugging Face tokenizer.

Ids: the special tokens first (pad, bos, eos), then one id per character of the alphabet.
`save` writes it with `tokenizers` (a WordLevel vocabulary over single characters), so vLLM
and transformers load the same ids from the model directory.
"""

from __future__ import annotations

import os
from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    def __init__(self, alphabet: str) -> None:
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(f"alphabet {alphabet!r} must be non-empty, without repeats")
        self.alphabet = alphabet
        self.vocab = {tok: i for i, tok in enumerate([*SPECIALS, *alphabet])}
        self.pad_id, self.bos_id, self.eos_id = range(len(SPECIALS))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        unknown = sorted(set(text) - set(self.alphabet))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the alphabet {self.alphabet!r}")
        return [self.bos_id] * bos + [self.vocab[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        """The characters up to the first eos; other special tokens are dropped."""
        chars = []
        for i in ids:
            if i == self.eos_id:
                break
            if i >= len(SPECIALS):
                chars.append(self.alphabet[i - len(SPECIALS)])
        return "".join(chars)

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json and its config into `path` (Hugging Face format)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        inner = Tokenizer(models.WordLevel(self.vocab, unk_token=SPECIALS[0]))
        inner.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        inner.decoder = decoders.Fuse()
        fast = PreTrainedTokenizerFast(tokenizer_object=inner, pad_token=SPECIALS[0],
                                       bos_token=SPECIALS[1], eos_token=SPECIALS[2])
        fast.save_pretrained(str(Path(path)))
