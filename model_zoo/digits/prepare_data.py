"""Prepare scikit-learn's digits (1,797 real 8x8 scans) as MNIST-like 28x28 shards.

Each 8x8 image (values 0..16) is scaled to [0, 1], bilinearly resized to 20x20 and padded by 4
pixels on each side, so the digit sits centred in a 28x28 frame as in MNIST.  Pixel values are
rounded to 4 decimal places, so the CSV form (written with '%.4g') reads back exactly.

    python model_zoo/digits/prepare_data.py --output=data/digits [--format=npz|csv|both]
        [--val_fraction=0.2] [--seed=0] [--num_files=2]

writes (stratified split, deterministic given --seed)::

    OUTPUT/train/part-0000.npz ...     image (N, 28, 28) float32, label (N,) int64
    OUTPUT/val/part-0000.npz ...
    OUTPUT/predict/part-0000.npz ...   the validation images, ``image`` only (no labels)
    OUTPUT/train_csv/part-0000.csv ... (csv/both) 784 pixel values then the label, no header
    OUTPUT/val_csv/part-0000.csv ...
"""

from __future__ import annotations

import argparse
import os

import numpy as np

IMAGE_SIZE = 28
DIGIT_SIZE = 20  # as in MNIST: the digit fits a 20x20 box centred in the 28x28 frame
PIXEL_DECIMALS = 4


def _bilinear_matrix(in_size: int, out_size: int) -> np.ndarray:
    """(out, in) weights of 1-d bilinear resizing, as torch's interpolate(align_corners=False)."""
    scale = in_size / out_size
    src = np.maximum((np.arange(out_size) + 0.5) * scale - 0.5, 0.0)
    lo = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    hi = np.minimum(lo + 1, in_size - 1)
    frac = src - lo
    weights = np.zeros((out_size, in_size))
    np.add.at(weights, (np.arange(out_size), lo), 1.0 - frac)
    np.add.at(weights, (np.arange(out_size), hi), frac)
    return weights


def to_mnist_frames(images: np.ndarray, max_value: float = 16.0) -> np.ndarray:
    """(N, h, w) images in [0, max_value] -> (N, 28, 28) float32 in [0, 1], digit centred."""
    images = np.asarray(images, dtype=np.float64) / max_value
    rows = _bilinear_matrix(images.shape[1], DIGIT_SIZE)
    cols = _bilinear_matrix(images.shape[2], DIGIT_SIZE)
    resized = np.einsum("ri,nij,cj->nrc", rows, images, cols)
    pad = (IMAGE_SIZE - DIGIT_SIZE) // 2
    frames = np.zeros((len(images), IMAGE_SIZE, IMAGE_SIZE))
    frames[:, pad : pad + DIGIT_SIZE, pad : pad + DIGIT_SIZE] = resized
    return np.round(np.clip(frames, 0.0, 1.0), PIXEL_DECIMALS).astype(np.float32)


def stratified_split(
    labels: np.ndarray, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split; the validation set has ceil(N * val_fraction) records."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError("val_fraction must be in [0, 1)")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    n_val = int(np.ceil(len(labels) * val_fraction))
    # Largest-remainder allocation of n_val over the classes, proportional to class size.
    quota = counts * n_val / len(labels)
    per_class = np.floor(quota).astype(np.int64)
    for k in np.argsort(-(quota - per_class), kind="stable")[: n_val - per_class.sum()]:
        per_class[k] += 1
    train, val = [], []
    for cls, n in zip(classes, per_class):
        members = rng.permutation(np.flatnonzero(labels == cls))
        val.append(members[:n])
        train.append(members[n:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(val))


def load_digits_frames() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return to_mnist_frames(digits.images), digits.target.astype(np.int64)


def _write_npz(out_dir: str, arrays: dict[str, np.ndarray], num_files: int) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    n = len(next(iter(arrays.values())))
    paths = []
    for i, index in enumerate(np.array_split(np.arange(n), num_files)):
        path = os.path.join(out_dir, f"part-{i:04d}.npz")
        np.savez(path, **{name: a[index] for name, a in arrays.items()})
        paths.append(path)
    return paths


def _format_value(v: float) -> str:
    return f"{v:.4g}"


def _write_csv(out_dir: str, images: np.ndarray, labels: np.ndarray, num_files: int) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    flat = images.reshape(len(images), -1)
    # Format each distinct pixel value once (most are 0): much faster than np.savetxt.
    values, inverse = np.unique(flat, return_inverse=True)
    strings = np.array([_format_value(v) for v in values], dtype=object)[inverse.reshape(-1)]
    strings = strings.reshape(flat.shape)
    paths = []
    for i, index in enumerate(np.array_split(np.arange(len(images)), num_files)):
        path = os.path.join(out_dir, f"part-{i:04d}.csv")
        with open(path, "w") as f:
            f.writelines(",".join(strings[j]) + f",{labels[j]}\n" for j in index)
        paths.append(path)
    return paths


def prepare(
    output: str,
    fmt: str = "npz",
    val_fraction: float = 0.2,
    seed: int = 0,
    num_files: int = 2,
    verbose: bool = True,
) -> dict[str, list[str]]:
    """Write the digits shards under ``output``; returns {folder name: written paths}."""
    if fmt not in ("npz", "csv", "both"):
        raise ValueError("format must be npz, csv or both")
    if num_files < 1:
        raise ValueError("num_files must be at least 1")
    images, labels = load_digits_frames()
    train_idx, val_idx = stratified_split(labels, val_fraction, seed)
    splits = {"train": train_idx, "val": val_idx}
    written: dict[str, list[str]] = {}
    for name, index in splits.items():
        if fmt in ("npz", "both"):
            written[name] = _write_npz(
                os.path.join(output, name),
                {"image": images[index], "label": labels[index]},
                num_files,
            )
        if fmt in ("csv", "both"):
            written[f"{name}_csv"] = _write_csv(
                os.path.join(output, f"{name}_csv"), images[index], labels[index], num_files
            )
    if fmt in ("npz", "both"):
        written["predict"] = _write_npz(
            os.path.join(output, "predict"), {"image": images[val_idx]}, num_files
        )
    if verbose:
        sizes = {"train": len(train_idx), "val": len(val_idx), "predict": len(val_idx)}
        for name, paths in written.items():
            n = sizes[name.replace("_csv", "")]
            print(f"wrote {n} records in {len(paths)} file(s) to {os.path.join(output, name)}")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="output folder, e.g. data/digits")
    parser.add_argument("--format", default="npz", choices=["npz", "csv", "both"])
    parser.add_argument("--val_fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_files", type=int, default=2, help="files per split")
    args = parser.parse_args(argv)
    prepare(args.output, args.format, args.val_fraction, args.seed, args.num_files)


if __name__ == "__main__":
    main()
