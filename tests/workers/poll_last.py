"""A reader that polls a checkpoint directory while training saves into it, run by
``tests/workers/publication_readers_worker.py``:

    python poll_last.py DIRPATH STRATEGY STOP_FILE OUT_JSON

Once its imports are done (``torch`` and ``tests/checkpoint_formats.py``, not Lightning) it creates
``STOP_FILE.ready``; then in a tight loop until ``STOP_FILE`` exists, it looks at ``DIRPATH/last.ckpt`` and at the
checkpoint named in ``DIRPATH/best.txt`` (the callback's ``best_model_path``, written there by rank 0), and counts
each look: ``last`` absent (once it has appeared), present but not loading completely
(``checkpoint_formats.loads_completely``), and the same for the best checkpoint; a best path that changed while it
looked is a stale read, not counted. Writes the counts to ``OUT_JSON``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from checkpoint_formats import loads_completely  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def _best(dirpath: str) -> str | None:
    try:
        with open(os.path.join(dirpath, "best.txt")) as f:
            return f.read() or None
    except FileNotFoundError:
        return None


def main() -> None:
    dirpath, strategy, stop_file, out = sys.argv[1:]
    last = os.path.join(dirpath, "last.ckpt")
    counts = {"polls": 0, "last_absent": 0, "last_incomplete": 0, "best_polls": 0, "best_absent": 0,
              "best_incomplete": 0}
    seen_last = False
    open(stop_file + ".ready", "w").close()  # imports done: training may start
    while not os.path.exists(stop_file):
        if os.path.lexists(last):
            seen_last = True
            counts["polls"] += 1
            if not loads_completely(strategy, last):
                counts["last_incomplete" if os.path.lexists(last) else "last_absent"] += 1
        elif seen_last:
            counts["polls"] += 1
            counts["last_absent"] += 1
        best = _best(dirpath)
        if best is not None:
            counts["best_polls"] += 1
            whole = loads_completely(strategy, best)
            if not whole and _best(dirpath) == best:  # still the best: not a stale read
                counts["best_incomplete" if os.path.lexists(best) else "best_absent"] += 1
    with open(out, "w") as f:
        json.dump(counts, f)


if __name__ == "__main__":
    main()
