"""Input files as byte streams: opened, decompressed by suffix (.gz, .zst) and read line by line,
with errors that name the file and where in it the read failed.

Public API:
    compression_of(uri) -> "gzip" | "zstd" | None        by suffix: .gz, .zst, .zstd
    open_input(uri) -> binary file                        the raw bytes (local or gs://)
    open_decompressed(uri) -> context manager of a binary stream, decompressed as the suffix says
    input_lines(uri) -> Iterator[(line number, raw line)] streamed through the decompressor
    raise_read_error(uri, e, where)                       a failed read as a DataError
    short_reason(e) -> str                                a library error as one short clause

A user's mistake (a missing file, corrupt or truncated compression) is a DataError; a storage
fault (a full disk, a failing bucket; see runfolder.storage.storage_fault) propagates as it is.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, Literal, NoReturn

import zstandard

from jobspec.errors import DataError
from runfolder.storage import storage_fault, url_to_fs

Compression = Literal["gzip", "zstd"]

_SUFFIXES: dict[str, Compression] = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
COMPRESSION_SUFFIXES = tuple(_SUFFIXES)
_READ_CHUNK = 1 << 20  # bytes per read of a (compressed) file
_ZSTD_FEED = 1 << 16  # compressed bytes per decompress call: bounds the output held at once


def compression_of(uri: str) -> Compression | None:
    """The compression a file's name says it has: .gz is gzip, .zst/.zstd is zstd."""
    name = uri.lower()
    for suffix, compression in _SUFFIXES.items():
        if name.endswith(suffix):
            return compression
    return None


def open_input(uri: str) -> IO[bytes]:
    """The file's raw bytes, open for reading; a missing or unreadable file is a DataError."""
    fs, path = url_to_fs(uri)
    try:
        return fs.open(path, "rb")
    except OSError as e:
        if storage_fault(e) is not None:
            raise
        if isinstance(e, FileNotFoundError):
            raise DataError(f"input {uri} does not exist; fix the input path or glob") from e
        raise DataError(
            f"cannot open input {uri} ({e.strerror or short_reason(e)}); check that it is a "
            "readable file"
        ) from e


@contextmanager
def open_decompressed(uri: str) -> Iterator[IO[bytes]]:
    """The file's bytes, decompressed as its suffix says, as a buffered binary stream. Its read
    errors are the libraries' own: pass them to raise_read_error."""
    with open_input(uri) as raw:
        compression = compression_of(uri)
        if compression == "gzip":
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                yield f
        elif compression == "zstd":
            with io.BufferedReader(_ZstdReader(raw), _READ_CHUNK) as f:
                yield f
        else:
            yield raw


def input_lines(uri: str) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, raw line with its newline) of the decompressed file, streamed."""
    lineno = 0
    with open_decompressed(uri) as f:
        lines = iter(f)
        while True:
            # Only the read is guarded: errors in the consumer's code pass through unchanged.
            try:
                raw = next(lines)
            except StopIteration:
                return
            except Exception as e:
                raise_read_error(uri, e, f"reading line {lineno + 1}")
            lineno += 1
            yield lineno, raw


def raise_read_error(uri: str, e: Exception, where: str) -> NoReturn:
    """Re-raises a failed read of `uri` as a DataError that says `where` it failed; a storage
    fault or a bug propagates as it is."""
    if isinstance(e, zstandard.ZstdError):
        raise DataError(
            f"{uri} is not a valid zstd stream ({short_reason(e)}, {where}); compress it again "
            "with zstd, or drop the .zst suffix if it is not compressed"
        ) from e
    if isinstance(e, _ZstdTruncated):
        raise DataError(
            f"{uri} is truncated: it ends inside a zstd frame ({where}); copy or compress it again"
        ) from e
    if isinstance(e, EOFError):  # gzip's end of input before its end-of-stream marker
        raise DataError(
            f"{uri} is truncated: its gzip stream ends early ({where}); copy or compress it again"
        ) from e
    if isinstance(e, gzip.BadGzipFile | zlib.error):
        raise DataError(
            f"{uri} is not a valid gzip file ({short_reason(e)}, {where}); compress it again "
            "with gzip, or drop the .gz suffix if it is not compressed"
        ) from e
    if isinstance(e, OSError) and storage_fault(e) is None:
        raise DataError(
            f"cannot read input {uri} ({e.strerror or short_reason(e)}, {where}); check that it "
            "is a readable file"
        ) from e
    raise e


def short_reason(e: BaseException) -> str:
    """A library's error text as a short clause: one line, its first sentence, no full stop."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) <= 200 else text[:199] + "…"


class _ZstdTruncated(EOFError):
    """The compressed input ended inside a zstd frame."""


class _ZstdReader(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame.

    zstandard's own stream_reader ends quietly when the input stops inside a frame, so a
    truncated file would lose its tail unnoticed; this one raises _ZstdTruncated there.
    """

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._frame: Any = None  # the decompressor of the frame being read; None between frames
        self._compressed = memoryview(b"")  # read from the file, not yet decompressed
        self._out = memoryview(b"")  # decompressed, not yet returned

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            if not self._decompress_more():
                return 0
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress_more(self) -> bool:
        """Decompresses the next piece of input; False at a clean end of the file."""
        if not self._compressed:
            self._compressed = memoryview(self._raw.read(_READ_CHUNK))
            if not self._compressed:
                if self._frame is not None:
                    raise _ZstdTruncated("the file ends inside a zstd frame")
                return False
        piece, self._compressed = self._compressed[:_ZSTD_FEED], self._compressed[_ZSTD_FEED:]
        out: list[bytes] = []
        while piece:  # a piece may end one frame and start the next
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            out.append(self._frame.decompress(piece))
            piece = memoryview(b"")
            if self._frame.eof:
                piece = memoryview(self._frame.unused_data)
                self._frame = None
        self._out = memoryview(b"".join(out))
        return True
