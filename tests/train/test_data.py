"""PTB data: location precedence, md5-verified download into the cache, tokenizing, batching."""

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import requests

from jremat.train import data

SPLIT_FILES = ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt")


def _md5(path):
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def local_md5(monkeypatch, ptb_offline_dir):
    """Pretend the offline files are the canonical ones: their md5 sums become the expected ones."""
    for split in data.SPLITS:
        monkeypatch.setitem(data.MD5, split, _md5(os.path.join(ptb_offline_dir, data.FILENAMES[split])))


def copying_downloader(source_dir, calls):
    """A pooch downloader that copies from a local folder (stands in for the HTTP download)."""

    def download(url, output_file, pooch_obj):
        calls.append(url)
        shutil.copyfile(os.path.join(source_dir, url.rsplit("/", 1)[-1]), output_file)

    return download


def cache_listing(cache):
    return sorted(p.name for p in Path(cache).iterdir()) if Path(cache).exists() else []


def test_read_words_appends_eos_to_every_line(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(" a b \n\nc\n")
    assert data.read_words(path) == ["a", "b", "<eos>", "<eos>", "c", "<eos>"]


def test_corpus_counts_match_the_data_readme(ptb_offline_dir):
    corpus = data.load_corpus(ptb_offline_dir)
    # ptb-offline/ptb.train.txt is PTB's valid split: 70,390 words + one <eos> per each of 3,370 lines.
    assert len(corpus.train) == 70390 + 3370
    assert corpus.vocab[corpus.train[0]] == data.read_words(Path(ptb_offline_dir) / "ptb.train.txt")[0]
    assert "<eos>" in corpus.vocab and "<unk>" in corpus.vocab
    assert corpus.vocab_size == len(set(data.read_words(Path(ptb_offline_dir) / "ptb.train.txt")))
    assert corpus.valid.dtype == np.int32 and corpus.valid.max() < corpus.vocab_size


def test_unknown_words_map_to_unk_or_fail_clearly(tmp_path):
    (tmp_path / "ptb.train.txt").write_text("a b <unk>\n")
    (tmp_path / "ptb.valid.txt").write_text("a zzz\n")
    (tmp_path / "ptb.test.txt").write_text("b\n")
    corpus = data.load_corpus(tmp_path)
    assert [corpus.vocab[i] for i in corpus.valid] == ["a", "<unk>", "<eos>"]
    (tmp_path / "ptb.train.txt").write_text("a b\n")
    with pytest.raises(data.DataError, match="'zzz'.*no <unk>"):
        data.load_corpus(tmp_path)


def test_batches_are_contiguous_rows_with_shifted_targets():
    stream = np.arange(103, dtype=np.int32)
    batches = data.Batches(stream, batch_size=4, seq_len=5, split="train")
    assert batches.rows.shape == (4, 25)  # 3 trailing tokens dropped
    assert len(batches) == 4  # (25 - 1) // 5
    x, y = batches[1]
    np.testing.assert_array_equal(x[2], np.arange(55, 60))
    np.testing.assert_array_equal(y, x + 1)
    with pytest.raises(IndexError):
        batches[4]


def test_too_short_split_is_a_clear_error():
    with pytest.raises(data.DataError, match="too few for one batch of 4 x 5"):
        data.Batches(np.arange(20, dtype=np.int32), batch_size=4, seq_len=5, split="valid")


def test_data_dir_wins_over_env_and_env_over_cache(monkeypatch, tmp_path, ptb_offline_dir):
    other = tmp_path / "other"
    shutil.copytree(ptb_offline_dir, other)
    monkeypatch.setenv(data.ENV_VAR, ptb_offline_dir)
    assert data.locate(str(other)) == (other, "--data-dir")
    assert data.locate(None) == (Path(ptb_offline_dir), f"${data.ENV_VAR}")
    monkeypatch.delenv(data.ENV_VAR)
    calls = []
    cache = tmp_path / "cache"
    with pytest.raises(data.DataError):  # the cache path is taken: nothing there, fake download fails
        data.locate(None, cache_dir=cache, downloader=lambda url, out, p: calls.append(url) or 1 / 0)
    assert calls == [data.BASE_URL + "ptb.train.txt"]


@pytest.mark.parametrize("problem", ["missing", "empty", "not_a_dir"])
def test_user_dir_problems_are_named(tmp_path, ptb_offline_dir, problem):
    folder = tmp_path / "corpus"
    shutil.copytree(ptb_offline_dir, folder)
    os.chmod(folder, 0o755)
    for name in SPLIT_FILES:
        os.chmod(folder / name, 0o644)
    if problem == "missing":
        (folder / "ptb.valid.txt").unlink()
        expected = "ptb.valid.txt is missing"
    elif problem == "empty":
        (folder / "ptb.test.txt").write_text("\n \n")
        expected = "ptb.test.txt is empty"
    else:
        folder = folder / "ptb.train.txt"
        expected = "is not a directory"
    with pytest.raises(data.DataError, match=expected) as err:
        data.check_user_dir(folder, origin="--data-dir")
    message = str(err.value)
    assert "--data-dir DIR" in message and data.ENV_VAR in message and "download" in message


def test_download_verifies_md5_and_is_not_repeated(tmp_path, ptb_offline_dir, local_md5):
    calls = []
    cache = tmp_path / "cache"
    assert data.fetch_into_cache(cache, downloader=copying_downloader(ptb_offline_dir, calls)) == cache
    assert cache_listing(cache) == sorted(SPLIT_FILES)
    assert calls == [data.BASE_URL + name for name in SPLIT_FILES]
    data.fetch_into_cache(cache, downloader=copying_downloader(ptb_offline_dir, calls))
    assert len(calls) == 3  # verified files in the cache are not fetched again


def test_md5_mismatch_leaves_nothing_in_the_cache(tmp_path, ptb_offline_dir, local_md5):
    cache = tmp_path / "cache"

    def corrupt(url, output_file, pooch_obj):
        copying_downloader(ptb_offline_dir, [])(url, output_file, pooch_obj)
        with open(output_file, "ab") as handle:
            handle.write(b"tampered\n")

    with pytest.raises(data.DataError, match="ptb.train.txt.*could not be fetched.*--data-dir DIR") as err:
        data.fetch_into_cache(cache, downloader=corrupt)
    assert "hash" in str(err.value).lower()
    assert cache_listing(cache) == []


def test_partial_download_never_remains(tmp_path, ptb_offline_dir, local_md5):
    cache = tmp_path / "cache"

    def broken(url, output_file, pooch_obj):
        content = Path(ptb_offline_dir, url.rsplit("/", 1)[-1]).read_bytes()
        Path(output_file).write_bytes(content[: len(content) // 2])
        raise requests.exceptions.ConnectionError("connection reset by peer")

    with pytest.raises(data.DataError, match="no network: the server could not be reached"):
        data.fetch_into_cache(cache, downloader=broken)
    assert cache_listing(cache) == []


def test_offline_with_the_real_http_downloader(tmp_path, local_md5):
    cache = tmp_path / "cache"
    # Port 9 on localhost refuses connections at once: the same failure as having no internet.
    with pytest.raises(data.DataError) as err:
        data.fetch_into_cache(cache, base_url="http://127.0.0.1:9/")
    message = str(err.value)
    assert "ptb.train.txt is not in the cache" in message and "(no network: the server could not be reached)" in message
    assert "HTTPConnectionPool" not in message and "ConnectionError" not in message  # said plainly, no repr
    assert "--data-dir DIR" in message and data.ENV_VAR in message
    assert cache_listing(cache) == []


def test_corrupt_file_in_cache_is_removed_when_it_cannot_be_replaced(tmp_path, ptb_offline_dir, local_md5):
    cache = tmp_path / "cache"
    data.fetch_into_cache(cache, downloader=copying_downloader(ptb_offline_dir, []))
    (cache / "ptb.valid.txt").write_text("truncated")
    with pytest.raises(data.DataError, match="ptb.valid.txt"):
        data.fetch_into_cache(cache, base_url="http://127.0.0.1:9/")
    assert cache_listing(cache) == ["ptb.test.txt", "ptb.train.txt"]


def _refused(url, output_file, pooch_obj):
    raise requests.exceptions.ConnectionError("name resolution failed")


def test_a_failed_download_creates_no_folder_and_prints_nothing(tmp_path, capfd):
    cache = tmp_path / "user-cache" / "jremat" / "ptb"  # none of the three folders exists
    with pytest.raises(data.DataError) as err:
        data.fetch_into_cache(cache, downloader=_refused)
    assert not (tmp_path / "user-cache").exists()
    assert capfd.readouterr() == ("", "")  # no "Downloading ..." before a download could happen
    message = str(err.value)
    assert "(no network: the server could not be reached)" in message
    assert "--data-dir DIR" in message and f"{data.ENV_VAR}=DIR" in message


def test_a_failed_download_keeps_a_folder_that_existed_or_holds_files(tmp_path, ptb_offline_dir, local_md5):
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(data.DataError):
        data.fetch_into_cache(existing, downloader=_refused)
    assert existing.is_dir() and cache_listing(existing) == []

    cache = tmp_path / "new"
    only_train = copying_downloader(ptb_offline_dir, [])

    def train_then_offline(url, output_file, pooch_obj):
        if not url.endswith("ptb.train.txt"):
            _refused(url, output_file, pooch_obj)
        only_train(url, output_file, pooch_obj)

    with pytest.raises(data.DataError, match="ptb.valid.txt is not in the cache"):
        data.fetch_into_cache(cache, downloader=train_then_offline)
    assert cache_listing(cache) == ["ptb.train.txt"]  # the verified file stays; no partial file beside it
