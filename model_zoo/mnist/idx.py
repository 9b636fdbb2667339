"""Read MNIST IDX files (pure numpy) and convert them to the ``.npz`` shards ElasticDL reads.

IDX format: two zero bytes, a type byte (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
0x0D float32, 0x0E float64), a byte with the number of dimensions, one big-endian uint32 per
dimension, then the data in big-endian row-major order.  Files may be gzip-compressed.

Usage (with MNIST downloaded to ``~/mnist``)::

    python model_zoo/mnist/idx.py --mnist_dir=~/mnist --output=data/mnist --num_files=4
    # -> data/mnist/train/part-0000.npz ... (60,000) and data/mnist/val/... (10,000)

    python model_zoo/mnist/idx.py --images=train-images-idx3-ubyte.gz \\
        --labels=train-labels-idx1-ubyte.gz --output=data/mnist/train --num_files=4

Each shard holds ``image`` (N, 28, 28) uint8 and ``label`` (N,) int64;
``mnist.mnist_cnn.feed`` scales the uint8 pixels to [0, 1].
"""

from __future__ import annotations

import argparse
import gzip
import os
import struct

import numpy as np

_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == _GZIP_MAGIC:
        data = gzip.decompress(data)
    return data


def parse_idx(data: bytes) -> np.ndarray:
    """Parse the bytes of one IDX file into a numpy array (native byte order)."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError("not an IDX file: it must start with two zero bytes")
    type_code, ndim = data[2], data[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"unknown IDX data type 0x{type_code:02x}")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise ValueError("IDX file is truncated in its header")
    shape = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = _IDX_DTYPES[type_code]
    count = int(np.prod(shape, dtype=np.int64))
    expected = header_len + count * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"IDX file has {len(data)} bytes, its header {shape} implies {expected}")
    array = np.frombuffer(data, dtype=dtype, count=count, offset=header_len).reshape(shape)
    return array.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (``.gz`` or plain) into a numpy array."""
    return parse_idx(_read_bytes(path))


def write_idx(path: str, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (gzip-compressed when ``path`` ends in ``.gz``)."""
    array = np.asarray(array)
    native = array.dtype.newbyteorder("=")
    codes = [c for c, dt in _IDX_DTYPES.items() if dt.newbyteorder("=") == native]
    if not codes:
        raise ValueError(f"IDX cannot hold dtype {array.dtype}")
    code, dtype = codes[0], _IDX_DTYPES[codes[0]]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + np.ascontiguousarray(array, dtype=dtype).tobytes()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)


def idx_to_npz(
    images_path: str, labels_path: str | None, out_dir: str, num_files: int = 1
) -> list[str]:
    """Convert an IDX image file (and its label file) to ``num_files`` npz shards.

    Writes ``out_dir/part-0000.npz`` ... with ``image`` (N, rows, cols) uint8 and, when
    ``labels_path`` is given, ``label`` (N,) int64.  Returns the written paths.
    """
    if num_files < 1:
        raise ValueError("num_files must be at least 1")
    images = read_idx(images_path)
    if images.ndim != 3:
        raise ValueError(f"{images_path}: expected a 3-d image array, got shape {images.shape}")
    labels = None
    if labels_path is not None:
        labels = read_idx(labels_path).astype(np.int64).reshape(-1)
        if len(labels) != len(images):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i, index in enumerate(np.array_split(np.arange(len(images)), num_files)):
        path = os.path.join(out_dir, f"part-{i:04d}.npz")
        arrays = {"image": images[index]}
        if labels is not None:
            arrays["label"] = labels[index]
        np.savez(path, **arrays)
        paths.append(path)
    return paths


def _find(directory: str, stem: str) -> str:
    for name in (stem, stem + ".gz"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"neither {stem} nor {stem}.gz in {directory}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mnist_dir", help="folder with the four MNIST IDX files")
    parser.add_argument("--images", help="one IDX image file")
    parser.add_argument("--labels", help="its IDX label file (optional)")
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--num_files", type=int, default=1, help="shards per split")
    args = parser.parse_args(argv)
    if (args.mnist_dir is None) == (args.images is None):
        parser.error("give exactly one of --mnist_dir or --images")
    if args.mnist_dir is not None:
        d = os.path.expanduser(args.mnist_dir)
        jobs = [
            ("train", _find(d, "train-images-idx3-ubyte"), _find(d, "train-labels-idx1-ubyte")),
            ("val", _find(d, "t10k-images-idx3-ubyte"), _find(d, "t10k-labels-idx1-ubyte")),
        ]
        jobs = [(os.path.join(args.output, split), im, lb) for split, im, lb in jobs]
    else:
        jobs = [(args.output, args.images, args.labels)]
    for out_dir, images_path, labels_path in jobs:
        paths = idx_to_npz(images_path, labels_path, out_dir, args.num_files)
        count = sum(len(np.load(p)["image"]) for p in paths)
        print(f"wrote {count} records in {len(paths)} file(s) to {out_dir}")


if __name__ == "__main__":
    main()
