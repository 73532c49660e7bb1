"""Fashion-MNIST IDX reading, the embedded subset, the search path and worker shards."""

from __future__ import annotations

import gzip
import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from gradsift.core.errors import InvalidOptionError
from gradsift.tools.train import data, datasets, text
from gradsift.tools.train.data import DatasetError, find_dataset_dir, load_split, read_idx, shard_indices
from support import ROOT

needs_real = pytest.mark.skipif(
    not data.has_dataset(data.SYSTEM_DIR),
    reason=f"real Fashion-MNIST absent from {data.SYSTEM_DIR} (apt-get install dataset-fashion-mnist)",
)


def write_idx(path: Path, header: bytes, payload: bytes, compress: bool = False) -> Path:
    raw = header + payload
    path.write_bytes(gzip.compress(raw) if compress else raw)
    return path


def idx_header(ndim: int, dims: tuple[int, ...], dtype_code: int = 0x08) -> bytes:
    return bytes([0, 0, dtype_code, ndim]) + struct.pack(f">{len(dims)}I", *dims)


@needs_real
def test_real_files_have_the_documented_sizes_and_balanced_classes() -> None:
    train = load_split(data.SYSTEM_DIR, "train")
    test = load_split(data.SYSTEM_DIR, "test")
    assert train.images.shape == (60000, 1, 28, 28) and len(test) == 10000
    assert torch.bincount(train.labels).tolist() == [6000] * 10
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    # normalised with the dataset's own mean and std
    assert abs(float(train.images.mean())) < 1e-3 and abs(float(train.images.std()) - 1.0) < 1e-3


def test_embedded_subset_is_class_balanced() -> None:
    train = load_split(data.EMBEDDED_DIR, "train")
    test = load_split(data.EMBEDDED_DIR, "test")
    assert train.images.shape == (3000, 1, 28, 28) and test.images.shape == (1000, 1, 28, 28)
    assert torch.bincount(train.labels, minlength=10).tolist() == [300] * 10
    assert torch.bincount(test.labels, minlength=10).tolist() == [100] * 10
    assert (data.EMBEDDED_DIR / "LICENSE-fashion-mnist.txt").read_text().count("Zalando SE") == 1


@needs_real
@pytest.mark.slow
def test_embedded_subset_is_reproduced_by_the_committed_script(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_embedded_subset.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)  # fmt: skip
    for shipped in sorted(data.EMBEDDED_DIR.glob("*.gz")):
        rebuilt = tmp_path / shipped.name
        assert hashlib.sha256(rebuilt.read_bytes()).digest() == hashlib.sha256(shipped.read_bytes()).digest()


def test_reader_round_trips_plain_and_gzip(tmp_path: Path) -> None:
    payload = bytes(range(24))
    for compress, name in ((False, "a-idx3-ubyte"), (True, "a-idx3-ubyte.gz")):
        array = read_idx(write_idx(tmp_path / name, idx_header(3, (2, 3, 4)), payload, compress), 3)
        assert array.dtype == torch.uint8 and array.shape == (2, 3, 4)
        assert array.flatten().tolist() == list(range(24))


@pytest.mark.parametrize(
    ("header", "payload", "message"),
    [
        (b"\x01\x00\x08\x01" + struct.pack(">I", 2), b"\x00\x01", "bad magic number"),
        (idx_header(1, (2,), dtype_code=0x0D), b"\x00" * 8, "data type 0x0d unsupported"),
        (idx_header(2, (2, 2)), b"\x00" * 4, "has 2 dimensions, expected 1"),
        (idx_header(1, (5,)), b"\x00" * 4, "holds 4 bytes, header dims (5,) need 5"),
        (b"\x00\x00\x08\x01\x00", b"", "truncated IDX header"),
        (b"", b"", "bad magic number (empty)"),
    ],
)
def test_malformed_files_raise_clear_errors(
    tmp_path: Path, header: bytes, payload: bytes, message: str
) -> None:
    path = write_idx(tmp_path / "labels-idx1-ubyte", header, payload)
    with pytest.raises(DatasetError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        read_idx(path, 1)
    assert str(path) in str(info.value)


def test_corrupt_gzip_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "x-idx1-ubyte.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(DatasetError, match="cannot read IDX file"):
        read_idx(path, 1)


def _fake_dataset(directory: Path, n_train: int = 4, n_labels: int = 4, label: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", 2)):
        write_idx(directory / f"{split}-images-idx3-ubyte", idx_header(3, (n, 28, 28)), b"\x80" * (n * 784))
        labels = n_labels if split == "train" else 2
        write_idx(directory / f"{split}-labels-idx1-ubyte", idx_header(1, (labels,)), bytes([label]) * labels)
    return directory


def test_explicit_data_dir_wins_and_must_hold_the_files(tmp_path: Path) -> None:
    good = _fake_dataset(tmp_path / "good")
    assert find_dataset_dir(good) == good
    assert data.load_dataset(good)[2] == str(good)
    with pytest.raises(DatasetError, match="does not hold the Fashion-MNIST files"):
        find_dataset_dir(tmp_path)
    assert data.search_path(good)[0] == good
    assert data.search_path(None)[-2:] == [data.CACHE_DIR, data.EMBEDDED_DIR]


def test_image_label_count_mismatch_and_label_range(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="holds 4 images but .* 3 labels"):
        load_split(_fake_dataset(tmp_path / "a", n_labels=3), "train")
    with pytest.raises(DatasetError, match=r"label 12 outside \[0, 9\]"):
        load_split(_fake_dataset(tmp_path / "b", label=12), "train")
    with pytest.raises(InvalidOptionError, match="split must be one of train, test"):
        load_split(tmp_path / "a", "validation")


@pytest.mark.parametrize(("length", "world"), [(10, 3), (12, 4), (7, 2), (5, 8)])
def test_shards_match_distributed_sampler(length: int, world: int) -> None:
    dataset = list(range(length))
    shards = []
    for rank in range(world):
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=5)
        sampler.set_epoch(3)
        mine = shard_indices(length, rank, world, epoch=3, seed=5)
        assert mine.tolist() == list(sampler)
        shards.append(mine)
    assert len({len(s) for s in shards}) == 1
    assert set(torch.cat(shards).tolist()) == set(range(length))


def test_shard_rank_out_of_range() -> None:
    with pytest.raises(InvalidOptionError, match=r"rank must lie in \[0, 1\], got 2"):
        shard_indices(10, 2, 2, epoch=0, seed=0)


def test_synthetic_data_is_seeded_and_learnable_by_row_bands() -> None:
    a, b = data.synthetic_split(64, seed=3), data.synthetic_split(64, seed=3)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    band_means = a.images[:, 0].mean(dim=2).reshape(64, 28)[:, :30:3]  # first row of every band
    assert torch.equal(band_means.argmax(dim=1), a.labels)


# -- the language model's text -------------------------------------------------------------


def write_py_files(directory: Path, count: int, size: int = 300) -> list[bytes]:
    contents = []
    for i in range(count):
        content = f"# file {i}\n".encode() + bytes([65 + (i + j) % 26 for j in range(size)])
        (directory / f"mod{i:02d}.py").write_bytes(content)
        contents.append(content)
    (directory / "notes.txt").write_bytes(b"not python")  # ignored: not *.py
    (directory / "pkg").mkdir()
    (directory / "pkg" / "inner.py").write_bytes(b"ignored: not top level")
    return contents


def test_text_corpus_split_by_file_windows_and_digest(tmp_path: Path) -> None:
    contents = write_py_files(tmp_path, 12)
    train, evaluation, corpus = text.load_text(tmp_path)
    # sorted names mod00..mod11: index 9 validates (i % 10 == 9), the other 11 train
    assert (corpus.train_files, corpus.validation_files) == (11, 1)
    train_bytes = b"".join(c for i, c in enumerate(contents) if i != 9)
    assert (corpus.train_bytes, corpus.validation_bytes) == (len(train_bytes), len(contents[9]))
    digest = hashlib.sha256()
    for i in [*(i for i in range(12) if i != 9), 9]:
        digest.update(f"mod{i:02d}.py".encode() + b"\0" + contents[i])
    assert corpus.sha256 == digest.hexdigest()
    assert corpus.sha256 in corpus.describe()
    # windows of CONTEXT + 1 bytes every CONTEXT bytes: input/target shifted by one byte
    context = text.CONTEXT
    assert len(train) == (len(train_bytes) - 1) // context
    inputs, targets = train[torch.tensor([0, 2])]
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (2, context)
    assert bytes(inputs[1].tolist()) == train_bytes[2 * context : 3 * context]
    assert bytes(targets[1].tolist()) == train_bytes[2 * context + 1 : 3 * context + 1]
    assert len(evaluation) == (len(contents[9]) - 1) // context


def test_eval_subset_is_evenly_spaced_and_capped() -> None:
    windows = torch.arange(1000).unsqueeze(1)
    assert text.eval_subset(windows, 5).view(-1).tolist() == [0, 250, 500, 749, 999]
    assert torch.equal(text.eval_subset(windows[:3], 5), windows[:3])


def test_text_corpus_errors_name_the_problem(tmp_path: Path) -> None:
    write_py_files(tmp_path, 9)
    with pytest.raises(DatasetError, match="holds 9 \\*.py files; the text corpus needs at least 10"):
        text.load_text(tmp_path)
    with pytest.raises(DatasetError, match="shorter than one window"):
        text.windows_of(b"x" * text.CONTEXT)


def test_stdlib_corpus_is_this_pythons_top_level_modules() -> None:
    files = text.corpus_files(text.stdlib_dir())
    assert len(files) >= 10 and files == sorted(files)
    assert all(f.parent == text.stdlib_dir() and f.suffix == ".py" for f in files)


def test_synthetic_text_is_seeded_and_predictable() -> None:
    a, b, c = text.synthetic_text(4096, 0), text.synthetic_text(4096, 0), text.synthetic_text(4096, 1)
    assert a == b != c and len(a) == 4096
    # a first-order word chain over 16 words: after "w0a " comes one of two words
    successors = {a[i + 4 : i + 6] for i in range(len(a) - 6) if a[i : i + 4] == b"w0a "}
    assert len(successors) == 2


def test_each_model_gets_its_data(tmp_path: Path) -> None:
    images, _, source = datasets.load_for_model("vgg", None, synthetic=True, seed=0)
    assert source == "synthetic" and len(images) == datasets.examples_for_model("vgg", synthetic=True) == 1024
    windows, evaluation, source = datasets.load_for_model("gpt", None, synthetic=True, seed=0)
    assert source == "synthetic-text" and len(evaluation) <= text.EVAL_WINDOWS
    assert (
        len(windows) == datasets.examples_for_model("gpt", synthetic=True) == (64 * 1024 - 1) // text.CONTEXT
    )
    write_py_files(tmp_path, 10)
    assert datasets.examples_for_model("gpt", tmp_path) == len(text.load_text(tmp_path)[0])
