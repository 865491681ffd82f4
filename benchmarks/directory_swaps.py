"""What a reader inside a directory checkpoint sees while it is replaced, save after save: the replaced directory
removed right after the swap (the previous code) against kept until the name is written again (current).

A DeepSpeed-shaped directory (``latest``, ``zero_to_fp32.py``, a tag directory with the model states and two
optimizer partitions) is published as ``last.ckpt`` by :func:`lightning_ckguard.publish.staging.move_into_place`, with
``--gap-ms`` of "training" between two saves. A separate reader process looks at it in a tight loop: it enters the
directory (opens it), is held there for a random time up to ``--stall-ms``, then reads ``latest``, the tag directory's
listing and each file with ``torch.load``, all relative to the directory it entered. The hold stands for a path lookup
preempted inside the directory (the lookup ``last.ckpt/checkpoint/...`` resolves one component at a time), or a loader
that reads relative to the directory it opened. A look that fails (an empty or short listing, a file gone) is
counted. Rounds alternate between the two variants, for each hold.

    python benchmarks/directory_swaps.py        # --saves 400 --gap-ms 20 --stall-ms 5 40 --rounds 2 --kib 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from lightning_ckguard.publish.staging import move_into_place, release_retired, staging_path, supports_exchange

FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "zero_pp_rank_1_mp_rank_00_optim_states.pt")
TAG = "checkpoint"


def write_checkpoint(path: str, step: int, kib: int) -> None:
    os.makedirs(os.path.join(path, TAG))
    for name in FILES:
        torch.save({"step": step, "weights": torch.zeros(kib * 256)}, os.path.join(path, TAG, name))
    with open(os.path.join(path, "zero_to_fp32.py"), "w") as f:
        f.write("# written by DeepSpeed\n")
    with open(os.path.join(path, "latest"), "w") as f:
        f.write(TAG)


def read(last: str, stall_s: float) -> str | None:
    """One look, as a loader reads: None when the whole checkpoint was there, else what went wrong."""
    try:
        entered = os.open(last, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        return f"{type(error).__name__} on entering"
    try:
        time.sleep(random.uniform(0.0, stall_s))
        with open(os.open("latest", os.O_RDONLY, dir_fd=entered)) as f:
            tag = f.read().strip()
        tag_dir = os.open(tag, os.O_RDONLY | os.O_DIRECTORY, dir_fd=entered)
        try:
            names = os.listdir(tag_dir)
            if sorted(names) != sorted(FILES):
                return f"listing of {len(names)} file(s)"
            for name in names:
                with open(os.open(name, os.O_RDONLY, dir_fd=tag_dir), "rb") as f:
                    torch.load(f, weights_only=True)
        finally:
            os.close(tag_dir)
    except Exception as error:
        return type(error).__name__
    finally:
        os.close(entered)
    return None


def reader(last: str, stop: str, stall_ms: str) -> None:
    torch.set_num_threads(1)
    looks, failures = 0, {}
    open(stop + ".ready", "w").close()
    while not os.path.exists(stop):
        looks += 1
        failure = read(last, float(stall_ms) / 1000)
        if failure is not None:
            failures[failure] = failures.get(failure, 0) + 1
    print(json.dumps({"looks": looks, "failures": failures}))


def run(variant: str, saves: int, gap_ms: float, stall_ms: float, kib: int) -> dict:
    root = tempfile.mkdtemp(prefix="ckguard-swaps-")
    try:
        last, stop = os.path.join(root, "last.ckpt"), os.path.join(root, "stop")
        write_checkpoint(last, 0, kib)
        poller = subprocess.Popen([sys.executable, __file__, "--reader", last, stop, str(stall_ms)],
                                  stdout=subprocess.PIPE, text=True)
        while not os.path.exists(stop + ".ready"):
            time.sleep(0.01)
        start = time.perf_counter()
        for step in range(1, saves + 1):
            time.sleep(gap_ms / 1000)  # the training steps between two saves
            if variant == "kept":
                release_retired(last)  # as the callback does, before the name is written again
            write_checkpoint(staging_path(last), step, kib)
            move_into_place(staging_path(last), last)
            if variant == "removed":
                release_retired(last)  # the previous code: the old directory removed right after the swap
        seconds = time.perf_counter() - start
        open(stop, "w").close()
        counts = json.loads(poller.communicate(timeout=60)[0])
        return {"saves": saves, "seconds": seconds, **counts}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=400, help="publications per round")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="time between two saves (the training), ms")
    parser.add_argument("--stall-ms", type=float, nargs="+", default=[5.0, 40.0],
                        help="longest hold of the reader inside the directory, ms (one table row pair each)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per variant and hold, alternating")
    parser.add_argument("--kib", type=int, default=64, help="size of each of the three files, KiB")
    parser.add_argument("--reader", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reader:
        reader(*args.reader)
        return
    probe = tempfile.mkdtemp()
    exchange = supports_exchange(probe)
    shutil.rmtree(probe)
    print(f"# {args.rounds} rounds x {args.saves} saves per row, {args.gap_ms:g} ms between saves, files of "
          f"{args.kib} KiB, {'renameat2 exchange' if exchange else 'two renames (no exchange here)'} on "
          f"{tempfile.gettempdir()}\n")
    order = ["removed", "kept"]
    totals: dict[tuple[str, float], dict] = {}
    for stall_ms in args.stall_ms:
        for round_number in range(args.rounds):
            for variant in order if round_number % 2 == 0 else order[::-1]:
                result = run(variant, args.saves, args.gap_ms, stall_ms, args.kib)
                total = totals.setdefault((variant, stall_ms), {"saves": 0, "looks": 0, "failures": {}})
                total["saves"] += result["saves"]
                total["looks"] += result["looks"]
                for kind, count in result["failures"].items():
                    total["failures"][kind] = total["failures"].get(kind, 0) + count
                print(f"hold <= {stall_ms:g} ms, round {round_number + 1}, {variant}: {result}", flush=True)
    print("\n| old directory | reader held inside up to | saves | reader's looks | failed looks | share | kinds |")
    print("|---|---|---|---|---|---|---|")
    labels = {"removed": "removed right after the swap (previous code)", "kept": "kept until the next write (current)"}
    for stall_ms in args.stall_ms:
        for variant in order:
            total = totals[(variant, stall_ms)]
            failed = sum(total["failures"].values())
            kinds = ", ".join(f"{kind}: {count}" for kind, count in sorted(total["failures"].items())) or "-"
            print(f"| {labels[variant]} | {stall_ms:g} ms | {total['saves']} | {total['looks']} | {failed} | "
                  f"{failed / max(total['looks'], 1):.3f} | {kinds} |")


if __name__ == "__main__":
    main()
