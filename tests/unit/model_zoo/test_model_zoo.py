"""The model zoo: digits data preparation, the shared MNIST CNN, feed, and the IDX reader."""

from __future__ import annotations

import glob
import gzip
import os
import struct
import sys

import numpy as np
import pytest
import torch

from tests.conftest import MODEL_ZOO

if MODEL_ZOO not in sys.path:  # as the framework's loader does for --model_zoo
    sys.path.insert(0, MODEL_ZOO)

from digits import digits_cnn, prepare_data  # noqa: E402
from mnist import idx, mnist_cnn  # noqa: E402

CONTRACT = ("custom_model", "loss", "optimizer", "feed", "eval_metrics_fn")


def load_npz_dir(path: str) -> dict[str, np.ndarray]:
    files = sorted(glob.glob(os.path.join(path, "*.npz")))
    assert files, f"no npz files in {path}"
    shards = [np.load(f) for f in files]
    return {k: np.concatenate([s[k] for s in shards]) for k in shards[0].files}


def npz_records(arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    n = len(next(iter(arrays.values())))
    return [{k: a[i] for k, a in arrays.items()} for i in range(n)]


def csv_records(path: str) -> list[list[str]]:
    rows = []
    for f in sorted(glob.glob(os.path.join(path, "*.csv"))):
        with open(f) as fh:
            rows += [line.rstrip("\n").split(",") for line in fh]
    return rows


# --------------------------------------------------------------------------------------------
# prepare_data
# --------------------------------------------------------------------------------------------


def test_prepare_data_counts_and_shapes(digits_data):
    train = load_npz_dir(os.path.join(digits_data, "train"))
    val = load_npz_dir(os.path.join(digits_data, "val"))
    assert len(glob.glob(os.path.join(digits_data, "train", "part-*.npz"))) == 2
    assert len(train["label"]) == 1437 and len(val["label"]) == 360
    for split in (train, val):
        assert split["image"].dtype == np.float32 and split["image"].shape[1:] == (28, 28)
        assert split["label"].dtype == np.int64
        assert 0.0 <= split["image"].min() and split["image"].max() <= 1.0
        # centred like MNIST: a 4-pixel empty border around the 20x20 digit
        border = np.ones((28, 28), bool)
        border[4:24, 4:24] = False
        assert not split["image"][:, border].any()
    labels = np.concatenate([train["label"], val["label"]])
    assert sorted(set(labels.tolist())) == list(range(10))
    # stratified: every class holds 17..19 % of the validation set's share
    counts = np.bincount(val["label"], minlength=10)
    assert counts.min() >= 34 and counts.max() <= 38 and counts.sum() == 360
    # all 1,797 digits, with scikit-learn's class counts
    np.testing.assert_array_equal(np.bincount(labels),
                                  [178, 182, 177, 183, 181, 182, 181, 179, 174, 180])

    predict = load_npz_dir(os.path.join(digits_data, "predict"))
    assert set(predict) == {"image"}
    np.testing.assert_array_equal(predict["image"], val["image"])


def test_prepare_data_csv_matches_npz(digits_data):
    rows = csv_records(os.path.join(digits_data, "train_csv"))
    assert len(rows) == 1437 and {len(r) for r in rows} == {785}
    train = load_npz_dir(os.path.join(digits_data, "train"))
    np.testing.assert_array_equal(np.array([int(r[-1]) for r in rows]), train["label"])
    assert len(csv_records(os.path.join(digits_data, "val_csv"))) == 360


def test_prepare_data_is_deterministic(digits_data, tmp_path, capsys):
    out = tmp_path / "again"
    prepare_data.main([f"--output={out}", "--num_files=3"])  # the fixture used 2 files
    printed = capsys.readouterr().out
    assert "wrote 1437 records in 3 file(s)" in printed and "wrote 360 records" in printed
    assert len(list((out / "train").glob("*.npz"))) == 3 and not (out / "train_csv").exists()
    for split in ("train", "val", "predict"):
        again = load_npz_dir(str(out / split))
        first = load_npz_dir(os.path.join(digits_data, split))
        assert again.keys() == first.keys()
        for name in first:
            np.testing.assert_array_equal(again[name], first[name])


def test_stratified_split_partitions_the_indices():
    labels = np.repeat(np.arange(10), [178, 182, 177, 183, 181, 182, 181, 179, 174, 180])
    train, val = prepare_data.stratified_split(labels, 0.2, seed=0)
    assert len(val) == 360 and len(train) == 1437
    np.testing.assert_array_equal(np.sort(np.concatenate([train, val])), np.arange(1797))
    quota = np.bincount(labels) * 360 / 1797  # each class gets its share, rounded up or down
    per_class = np.bincount(labels[val])
    assert np.all((per_class == np.floor(quota)) | (per_class == np.ceil(quota)))
    train2, val2 = prepare_data.stratified_split(labels, 0.2, seed=0)
    assert np.array_equal(train, train2) and np.array_equal(val, val2)
    assert not np.array_equal(val, prepare_data.stratified_split(labels, 0.2, seed=1)[1])


def test_resize_matches_torch_bilinear():
    images = np.random.default_rng(0).uniform(0, 16, size=(4, 8, 8))
    ours = prepare_data.to_mnist_frames(images)[:, 4:24, 4:24]
    ref = torch.nn.functional.interpolate(torch.tensor(images / 16.0)[:, None], size=(20, 20),
                                          mode="bilinear", align_corners=False)[:, 0].numpy()
    np.testing.assert_allclose(ours, ref, atol=5e-5 + 1e-7)


# --------------------------------------------------------------------------------------------
# feed
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [digits_cnn, mnist_cnn])
def test_contract_functions(module):
    for name in CONTRACT:
        assert callable(getattr(module, name)), name
    model = module.custom_model()
    assert isinstance(model, torch.nn.Module)
    assert isinstance(module.optimizer(model.parameters()), torch.optim.Optimizer)
    assert set(module.eval_metrics_fn()) == {"accuracy"}
    assert digits_cnn.CNN is mnist_cnn.CNN  # one shared definition


def test_feed_npz_and_csv_are_identical(digits_data):
    npz = npz_records(load_npz_dir(os.path.join(digits_data, "train")))[:64]
    rows = csv_records(os.path.join(digits_data, "train_csv"))[:64]
    x1, y1 = digits_cnn.feed(npz, "training")
    x2, y2 = digits_cnn.feed(rows, "training")
    assert x1.dtype == torch.float32 and x1.shape == (64, 1, 28, 28)
    assert y1.dtype == torch.int64 and y1.shape == (64,)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # a whole CSV line (text reader) and .npy rows (pixels then label) give the same
    x3, y3 = digits_cnn.feed([",".join(r) for r in rows], "evaluation")
    x4, y4 = digits_cnn.feed([np.array(r, dtype=np.float32) for r in rows], "evaluation")
    assert torch.equal(x1, x3) and torch.equal(y1, y3)
    assert torch.equal(x1, x4) and torch.equal(y1, y4)
    # standardised as MNIST: the empty border maps to -mean/std
    assert torch.allclose(x1[:, :, 0, 0], torch.tensor(-0.1307 / 0.3081))


def test_feed_prediction_without_labels(digits_data):
    predict = npz_records(load_npz_dir(os.path.join(digits_data, "predict")))[:10]
    x, y = digits_cnn.feed(predict, "prediction")
    assert x.shape == (10, 1, 28, 28) and y is None
    rows = csv_records(os.path.join(digits_data, "val_csv"))[:10]
    xc, yc = digits_cnn.feed([r[:-1] for r in rows], "prediction")
    assert yc is None and torch.equal(x, xc)
    with pytest.raises(ValueError, match="'label'"):
        digits_cnn.feed(predict, "training")
    x0, y0 = digits_cnn.feed([], "training")
    assert x0.shape == (0, 1, 28, 28) and y0.shape == (0,)


def test_feed_rejects_bad_csv_rows():
    good = ["0"] * 784 + ["3"]
    with pytest.raises(ValueError, match="record 1 of the batch has 784 fields, expected 785"):
        digits_cnn.feed([good, good[:-1]], "training")
    with pytest.raises(ValueError, match="has 786 fields"):
        digits_cnn.feed([good + ["1"]], "prediction")
    with pytest.raises(ValueError, match="not a number"):
        digits_cnn.feed([["x"] * 785], "training")
    with pytest.raises(ValueError, match="integer"):
        digits_cnn.feed([["0"] * 784 + ["2.5"]], "training")
    with pytest.raises(ValueError, match="unknown mode"):
        digits_cnn.feed([good], "train")


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_model_shape_and_torchscript():
    torch.manual_seed(0)
    model = digits_cnn.custom_model().eval()
    assert [type(m).__name__ for m in model.children()] == ["Conv2d", "Conv2d", "Linear"]
    assert model.fc.in_features == 32 * 7 * 7
    x = torch.randn(5, 1, 28, 28)
    out = model(x)
    assert out.shape == (5, 10)
    scripted = torch.jit.script(model)
    torch.testing.assert_close(scripted(x), out)
    labels = out.argmax(1)
    assert float(digits_cnn.eval_metrics_fn()["accuracy"](labels, out)) == 1.0
    loss = digits_cnn.loss(labels, out)
    assert loss.dim() == 0 and loss.item() > 0


def test_one_epoch_of_digits_reaches_85_percent(digits_data):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    train = npz_records(load_npz_dir(os.path.join(digits_data, "train")))
    val = npz_records(load_npz_dir(os.path.join(digits_data, "val")))
    model = digits_cnn.custom_model()
    opt = digits_cnn.optimizer(model.parameters())
    model.train()
    order = rng.permutation(len(train))
    for start in range(0, len(train), 64):
        x, y = digits_cnn.feed([train[i] for i in order[start : start + 64]], "training")
        opt.zero_grad()
        digits_cnn.loss(y, model(x)).backward()
        opt.step()
    model.eval()
    accuracy = digits_cnn.eval_metrics_fn()["accuracy"]
    correct = 0.0
    with torch.no_grad():
        for start in range(0, len(val), 64):  # weighted by batch size, as the framework does
            x, y = digits_cnn.feed(val[start : start + 64], "evaluation")
            correct += float(accuracy(y, model(x))) * len(y)
    print(f"digits val accuracy after 1 epoch: {correct / len(val):.4f}")
    assert correct / len(val) > 0.85


# --------------------------------------------------------------------------------------------
# IDX
# --------------------------------------------------------------------------------------------


def write_idx_by_hand(path, array: np.ndarray, type_code: int, compress: bool) -> None:
    header = bytes([0, 0, type_code, array.ndim]) + b"".join(
        struct.pack(">I", d) for d in array.shape
    )
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(payload)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_round_trip(tmp_path, compress):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7, dtype=np.uint8)
    suffix = ".gz" if compress else ""
    images_path = str(tmp_path / f"train-images-idx3-ubyte{suffix}")
    labels_path = str(tmp_path / f"train-labels-idx1-ubyte{suffix}")
    write_idx_by_hand(images_path, images, 0x08, compress)
    write_idx_by_hand(labels_path, labels, 0x08, compress)

    np.testing.assert_array_equal(idx.read_idx(images_path), images)
    np.testing.assert_array_equal(idx.read_idx(labels_path), labels)

    paths = idx.idx_to_npz(images_path, labels_path, str(tmp_path / "out"), num_files=3)
    assert [os.path.basename(p) for p in paths] == [f"part-000{i}.npz" for i in range(3)]
    arrays = load_npz_dir(str(tmp_path / "out"))
    assert arrays["image"].dtype == np.uint8 and arrays["label"].dtype == np.int64
    np.testing.assert_array_equal(arrays["image"], images)
    np.testing.assert_array_equal(arrays["label"], labels)

    x, y = mnist_cnn.feed(npz_records(arrays), "training")
    expected = (images.astype(np.float32) / 255.0 - 0.1307) / 0.3081
    torch.testing.assert_close(x, torch.from_numpy(expected)[:, None])
    assert torch.equal(y, torch.from_numpy(labels.astype(np.int64)))
    assert mnist_cnn.custom_model()(x).shape == (7, 10)


def test_idx_other_dtypes_and_errors(tmp_path):
    values = np.arange(24, dtype=np.int32).reshape(2, 3, 4) - 5
    write_idx_by_hand(tmp_path / "i32", values, 0x0C, compress=False)
    np.testing.assert_array_equal(idx.read_idx(str(tmp_path / "i32")), values)
    floats = np.linspace(0, 1, 6, dtype=np.float32)
    idx.write_idx(str(tmp_path / "f.gz"), floats)
    np.testing.assert_array_equal(idx.read_idx(str(tmp_path / "f.gz")), floats)
    with pytest.raises(ValueError, match="two zero bytes"):
        idx.parse_idx(b"\x01\x00\x08\x01\x00\x00\x00\x00")
    with pytest.raises(ValueError, match="implies"):
        idx.parse_idx(bytes([0, 0, 8, 1]) + struct.pack(">I", 5) + b"\x00\x00")
    with pytest.raises(ValueError, match="unknown IDX data type"):
        idx.parse_idx(bytes([0, 0, 0x42, 1]) + struct.pack(">I", 0))


def test_idx_cli_converts_an_mnist_dir(tmp_path, capsys):
    rng = np.random.default_rng(1)
    for prefix, n in (("train", 5), ("t10k", 3)):
        write_idx_by_hand(tmp_path / f"{prefix}-images-idx3-ubyte.gz",
                          rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), 0x08, True)
        write_idx_by_hand(tmp_path / f"{prefix}-labels-idx1-ubyte.gz",
                          rng.integers(0, 10, n, dtype=np.uint8), 0x08, True)
    out = tmp_path / "mnist"
    idx.main([f"--mnist_dir={tmp_path}", f"--output={out}", "--num_files=2"])
    assert "wrote 5 records in 2 file(s)" in capsys.readouterr().out
    assert len(load_npz_dir(str(out / "train"))["label"]) == 5
    assert len(load_npz_dir(str(out / "val"))["label"]) == 3
