"""What does trimming a torn last line before every append cost an append-only file?

draftlab.appendlog.append opens the file once more per record to read its last byte (and cuts
a partial line a kill or a full disk left). This times, per record, a plain `open(path, "a")`
write of a spool-sized JSON line against appendlog.append, `--records` records a round, rounds
interleaved (order alternating), on the folder given (default: a temporary one on /tmp), and
prints each one's median and range in µs per append.

    .venv/bin/python benchmarks/append_trim.py --records 5000 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from draftlab import appendlog

RECORD = {"run_id": "0" * 32, "kind": "metrics", "metrics": {f"train/loss_{k}": 1.0 for k in range(3)},
          "step": 1, "timestamp": 1_700_000_000_000}


def plain(path: Path) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(RECORD) + "\n")


def trimmed(path: Path) -> None:
    appendlog.append(path, RECORD)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dir", type=Path, default=None)
    a = ap.parse_args()
    us: dict[str, list[float]] = {"plain open-append": [], "appendlog.append": []}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        for rnd in range(a.rounds):
            order = [("plain open-append", plain), ("appendlog.append", trimmed)]
            for name, fn in order if rnd % 2 == 0 else order[::-1]:
                path = Path(d) / f"{rnd}-{name.split()[0]}.jsonl"
                started = time.perf_counter()
                for _ in range(a.records):
                    fn(path)
                us[name].append((time.perf_counter() - started) / a.records * 1e6)
    for name, values in us.items():
        print(f"{name:18s} median {statistics.median(values):7.1f} µs/append  "
              f"(range {min(values):.1f}–{max(values):.1f}, {a.rounds} rounds of {a.records})")


if __name__ == "__main__":
    main()
