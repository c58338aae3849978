"""Tokenizers that `runtime data prepare` turns text into token ids with.

Public API:
    load_tokenizer(spec: str) -> Tokenizer         spec is "byte" or a path/URI of a tokenizer.json
    tokenizer_id_for(spec: str) -> str             the id a manifest records for that spec
    ByteTokenizer, HFTokenizer                      the two implementations of `Tokenizer`

Built-in byte tokenizer ("byte"): ids 0..255 are the UTF-8 bytes of the text, id 256 is
end-of-document (eos); vocab_size is 257. There is no pad or bos token: rows are packed and
masked with loss_mask/segment_ids, so neither is needed, and eos doubles as the separator.

A tokenizer.json goes through the `tokenizers` library. Its id is "hf:" + the first 16 hex
digits of the sha256 of the file's bytes, so a manifest names the exact file that made it.
Its eos is the file's special token named like an end-of-text token (see EOS_NAMES), or its
only special token; a file with neither is rejected.
"""

from __future__ import annotations

import hashlib
from typing import Literal, Protocol

import numpy as np

from jobspec.errors import DataError
from runfolder.storage import url_to_fs

BYTE_ID = "byte"
BYTE_EOS = 256
BYTE_VOCAB = 257

# Common names of the end-of-document token, most specific first.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")


class Tokenizer(Protocol):
    id: str
    kind: Literal["byte", "hf"]
    vocab_size: int
    eos_id: int

    def encode(self, text: str | bytes) -> np.ndarray: ...

    def encode_many(self, texts: list[str | bytes]) -> list[np.ndarray]: ...

    def decode(self, ids: list[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, eos = 256."""

    id = BYTE_ID
    kind: Literal["byte", "hf"] = "byte"
    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)

    def encode_many(self, texts: list[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        # Special ids are not bytes; drop them rather than fail mid-sample.
        data = bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json loaded through the `tokenizers` library."""

    kind: Literal["byte", "hf"] = "hf"

    def __init__(self, source: str, content: bytes):
        import tokenizers

        try:
            self._tok = tokenizers.Tokenizer.from_str(content.decode("utf-8"))
        except Exception as e:  # the library raises plain Exception subclasses
            raise DataError(
                f"tokenizer file {source} is not a valid tokenizer.json ({e}); "
                "point data.tokenizer at a file saved by the `tokenizers` library"
            ) from e
        self.source = source
        self.id = _hf_id(content)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find_eos()

    def _find_eos(self) -> int:
        specials = {
            tok.content: int(i)
            for i, tok in self._tok.get_added_tokens_decoder().items()
            if tok.special
        }
        for name in EOS_NAMES:
            if name in specials:
                return specials[name]
        if len(specials) == 1:
            return next(iter(specials.values()))
        found = ", ".join(sorted(specials)) or "none"
        raise DataError(
            f"tokenizer file {self.source} has no end-of-document special token (special tokens: "
            f"{found}); add one named {EOS_NAMES[0]!r} as a special token"
        )

    def encode(self, text: str | bytes) -> np.ndarray:
        return self.encode_many([text])[0]

    def encode_many(self, texts: list[str | bytes]) -> list[np.ndarray]:
        strs = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        # add_special_tokens=False: prepare appends eos itself, nothing else is wanted.
        encs = self._tok.encode_batch(strs, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=True)


def _read_spec_file(spec: str) -> bytes:
    fs, path = url_to_fs(spec)
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError as e:
        raise DataError(
            f"tokenizer file {spec} does not exist; set the tokenizer to 'byte' or to the path of a "
            "tokenizer.json"
        ) from e
    except IsADirectoryError as e:
        raise DataError(
            f"tokenizer {spec} is a directory; point it at the tokenizer.json inside"
        ) from e


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte' → the built-in byte tokenizer; anything else is a path or URI of a tokenizer.json."""
    if spec == BYTE_ID:
        return ByteTokenizer()
    if spec.startswith("hf:"):
        raise DataError(
            f"tokenizer {spec!r} is a tokenizer id, not a file; give the path of the tokenizer.json"
        )
    return HFTokenizer(spec, _read_spec_file(spec))


def tokenizer_id_for(spec: str) -> str:
    """The id a manifest records for `spec`; an id ("byte", "hf:…") is returned as it is."""
    if spec == BYTE_ID or spec.startswith("hf:"):
        return spec
    return _hf_id(_read_spec_file(spec))


def _hf_id(content: bytes) -> str:
    """A tokenizer.json's id: its content hash, so a copy elsewhere is the same tokenizer."""
    return "hf:" + hashlib.sha256(content).hexdigest()[:16]
