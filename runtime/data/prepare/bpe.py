"""A byte-level BPE tokenizer trained on local (or gs://) text, with no download.

Public API:
    EOS = "<|endoftext|>"
    train_bpe(documents: Iterable[str | bytes], vocab_size: int, path: str) -> str
        train, save tokenizer.json at `path` (local or gs://), return the path
    train_bpe_on(inputs: list[str], vocab_size, path, text_field="text", max_bytes=None) -> str
        the same from the files the globs select (any input `data prepare` reads)

Byte-level (GPT-2 style): every UTF-8 byte is in the alphabet, so any text encodes with no
unknown token, and the saved file is what `data prepare --tokenizer` loads (its eos is EOS).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from jobspec.errors import DataError
from runfolder.storage import url_to_fs

EOS = "<|endoftext|>"
MIN_VOCAB = 256 + 1  # the byte alphabet and eos


def train_bpe(documents: Iterable[str | bytes], vocab_size: int, path: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"vocab size {vocab_size} cannot hold the 256 byte tokens and eos; use at least "
            f"{MIN_VOCAB}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in documents)
    tok.train_from_iterator(texts, trainer=trainer)
    fs, p = url_to_fs(path)
    with fs.open(p, "w") as f:
        f.write(tok.to_str())
    return path


def train_bpe_on(
    inputs: list[str],
    vocab_size: int,
    path: str,
    text_field: str = "text",
    max_bytes: int | None = None,
) -> str:
    from runtime.data.prepare.parts import list_inputs
    from runtime.data.prepare.readers import read_documents

    def documents() -> Iterator[bytes]:
        left = max_bytes
        for f in list_inputs(inputs):
            for doc in read_documents(f.uri, text_field):
                if left is not None:
                    doc = doc[:left]
                    left -= len(doc)
                yield doc
                if left is not None and left <= 0:
                    return

    return train_bpe(documents(), vocab_size, path)
