"""What durable publication costs: boundary time with and without flushing, against ``ModelCheckpoint``.

Each row is one ``Trainer.fit`` (single process, CPU) of the MLP of ``async_saves.py``; every ``--every`` steps a
boundary saves one checkpoint and evicts the previous one. Rows: ``FiniteGradCheckpoint`` (``durable=True``, the
default: the data flushed before the rename, the directory after it), ``FiniteGradCheckpoint(durable=False)`` and
``ModelCheckpoint`` (which flushes nothing), each synchronous and with ``AsyncCheckpointIO``, for a small and a
~200 MB checkpoint. The rows alternate run by run; the tables give medians with ratios to ``ModelCheckpoint`` of the
same mode, and the step right after a boundary (where a background write and its flush still run).

    python benchmarks/durable_saves.py              # ~4 min on 2 cores
    python benchmarks/durable_saves.py --repeats 5

What a flush costs depends on the storage far more than on this code: on a page cache backed by a fast local disk a
flush of 200 MB is the time to write it out; on network storage it is a round trip; on tmpfs it is nothing. Say which
filesystem the checkpoint directory is on when you quote a number (``--root``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, ms, table  # noqa: E402
from async_saves import timed_fit  # noqa: E402

from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402

ROWS = {
    "FiniteGradCheckpoint (durable)": dict(durable=True),
    "FiniteGradCheckpoint(durable=False)": dict(durable=False),
    "ModelCheckpoint": None,
}
SIZES = {"small": 256, "~200 MB": 2048}  # MLP width: 4 layers, weights and Adam state


def filesystem(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
        return out.splitlines()[1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def flush_alone(root: Path, megabytes: float, repeats: int = 3) -> tuple[float, float]:
    """What the storage under ``root`` takes to flush a freshly written file of ``megabytes``, and its directory:
    the medians of ``repeats`` tries (seconds), the floor of what durability adds to a synchronous boundary."""
    data = os.urandom(1 << 20) * max(1, round(megabytes))
    files, directories = [], []
    for attempt in range(repeats):
        path = root / f"flush-{attempt}.bin"
        path.write_bytes(data)
        started = time.perf_counter()
        descriptor = os.open(path, os.O_RDONLY)
        os.fsync(descriptor)
        os.close(descriptor)
        files.append(time.perf_counter() - started)
        started = time.perf_counter()
        descriptor = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(descriptor)
        os.close(descriptor)
        directories.append(time.perf_counter() - started)
        path.unlink()
    return median(files), median(directories)


def measure(args: argparse.Namespace, root: Path, asynchronous: bool) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {row: {} for row in ROWS}
    names = list(ROWS)
    for repeat in range(args.repeats):
        for row in names if repeat % 2 == 0 else reversed(names):
            options = ROWS[row]

            def make(dirpath: Path, options: dict | None = options) -> ModelCheckpoint:
                if options is None:
                    return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=args.every, save_top_k=1)
                return FiniteGradCheckpoint(dirpath=dirpath, every_n_train_steps=args.every, save_top_k=1, **options)

            for key, values in timed_fit(make, asynchronous, args, root).items():
                results[row].setdefault(key, []).extend(values)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=None, help="where the checkpoint directories go (default $TMPDIR)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    root = Path(tempfile.mkdtemp(prefix="ckguard-durable-bench-", dir=args.root))
    print(f"# {machine()}")
    print(f"# checkpoints in {root} ({filesystem(root)}), a save every {args.every} of {args.steps} steps, "
          f"{args.repeats} rounds")
    try:
        for size, width in SIZES.items():
            args.width = width
            megabytes = args.depth * (width * width + width) * 12 / 1e6
            file_flush, directory_flush = flush_alone(root, megabytes)
            print(f"\n{size} checkpoint: fsync of a fresh {megabytes:.0f} MB file {ms(file_flush)} ms, of its "
                  f"directory {ms(directory_flush)} ms (the storage alone)")
            for asynchronous in (False, True):
                results = measure(args, root, asynchronous)
                mode = "AsyncCheckpointIO" if asynchronous else "synchronous"
                baseline = median(results["ModelCheckpoint"]["boundary step"])
                rows = [[row, ms(median(r["boundary step"])), f"{median(r['boundary step']) / baseline:.2f}x",
                         ms(median(r["next step"])), ms(median(r["other steps"])), f"{median(r['fit']):.2f} s"]
                        for row, r in results.items()]
                print(f"\n{size} checkpoint (~{megabytes:.1f} MB), {mode}:")
                print(table(["row", "boundary step (ms)", "vs ModelCheckpoint", "next step (ms)", "other steps (ms)",
                             "fit"], rows))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
