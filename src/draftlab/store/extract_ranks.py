"""Data-parallel HF extraction: `extract.processes` ranks, one per GPU (or N CPU processes), each
forwarding a disjoint share of the store's batches, one store and one manifest written by the
launcher (`draftlab extract`) exactly as a 1-process run writes them.

Batches are composed from sample lengths alone (`plan_batches`) and dealt round-robin over the
ranks; a rank sends each batch's file records back on its stdout once the files are on disk, and
the launcher alone appends them to the journal. So a kill -9 of anything resumes like a
1-process run, and the store does not depend on how many ranks wrote it. Ranks die with the
launcher (`procs.spawn`). A target too large for one GPU is not split into ranks: it runs in one
process spread over all GPUs (`device_map="auto"`).

    python -m draftlab.store.extract_ranks      # a rank; reads its job (JSON) on stdin
"""

from __future__ import annotations

import json
import os
import queue
import sys
import tempfile
import threading
from pathlib import Path

from draftlab.errors import UserError
from draftlab.params import Params, ParamsError

RECORDS = "draftlab-records "  # prefix of the one kind of line a rank writes on its stdout


class ExtractFailed(UserError, RuntimeError):
    """A rank exited with an error; the message carries the tail of its log."""

    exit_code = 1


def plan_placement(params: Params, target_dir: Path):
    """(placement, processes, device_map) for the HF backend on this host; bad asks → ParamsError."""
    from draftlab import devices
    from draftlab.models import resolve

    e = params.extract
    placement = devices.resolve("extract.device", e.device, params.target.dtype)
    if placement.device == "cpu":
        return placement, e.processes or 1, None
    gpus = devices.cuda_count()
    fits = devices.fits_one_gpu(devices.weight_bytes(resolve(params, target_dir)))
    if not fits:
        if e.processes not in (None, 1):
            raise ParamsError(f"extract.processes: the target does not fit one GPU, so it runs in one process "
                              f"spread over all {gpus} GPUs (device_map); set extract.processes: null or 1")
        return placement, 1, "auto"
    processes = e.processes or gpus
    devices.check_gpus("extract.processes", processes)
    return placement, processes, None


def _visible_gpus() -> list[str]:
    from draftlab import devices

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(devices.cuda_count())]


def _reader(rank: int, stream, out: queue.Queue) -> None:
    for line in stream:
        if line.startswith(RECORDS):
            out.put((rank, json.loads(line[len(RECORDS):])))
    out.put((rank, None))


def _tail(log, lines: int = 8) -> str:
    log.seek(0)
    return " | ".join(log.read().decode(errors="replace").strip().splitlines()[-lines:])


def run_ranks(params: Params, *, processes: int, placement, target_dir: Path, data_dir: Path, out_dir: Path,
              layer_ids: list[int], batches: list[list[int]], on_done, done: frozenset[int] = frozenset()) -> None:
    """Start the ranks, hand each its batches, journal their records (`on_done`) as they come."""
    import subprocess

    import torch

    from draftlab import procs

    gpus = _visible_gpus() if placement.device == "cuda" else []
    records: queue.Queue = queue.Queue()
    ranks = []
    try:
        for r in range(processes):
            job = {"params": params.model_dump(mode="json"), "target_dir": str(target_dir), "data_dir": str(data_dir),
                   "out_dir": str(out_dir), "layer_ids": layer_ids, "batches": (mine := batches[r::processes]),
                   "done": sorted(i for b in mine for i in b if i in done),
                   "device": placement.device, "num_threads": torch.get_num_threads()}
            env = dict(os.environ)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[r]
            log = tempfile.TemporaryFile()  # noqa: SIM115 — read on failure, closed below
            proc = procs.spawn([sys.executable, "-m", "draftlab.store.extract_ranks"], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=log, text=True)
            proc.stdin.write(json.dumps(job))
            proc.stdin.close()
            threading.Thread(target=_reader, args=(r, proc.stdout, records), daemon=True).start()
            ranks.append((proc, log))
        running = processes
        while running:
            rank, recs = records.get()
            if recs is not None:
                on_done(recs)
                continue
            running -= 1
            proc, log = ranks[rank]
            if proc.wait() != 0:
                raise ExtractFailed(f"extract: rank {rank} of {processes} exited with {proc.returncode}; "
                                    f"its log: {_tail(log)} (rerun to resume: finished batches are kept)")
    finally:
        for proc, log in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def main() -> None:
    """One rank: load the target on this process's device, extract its batches."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints of libraries go to the log, never into the record stream
    job = json.load(sys.stdin)

    import torch
    from datasets import load_from_disk

    from draftlab import devices
    from draftlab.models import LayerCapture, load_target
    from draftlab.params import parse_params
    from draftlab.store.capture import extract_batches

    torch.set_num_threads(job["num_threads"])  # the same threads as the launcher: the same bytes on CPU
    params = parse_params(job["params"])
    placement = devices.on(job["device"], params.target.dtype)
    ds = load_from_disk(job["data_dir"])
    model, _ = load_target(params, Path(job["target_dir"]), device=placement.device)
    capture = LayerCapture(model, job["layer_ids"])

    def send(records: list[dict]) -> None:
        out.write(RECORDS + json.dumps(records) + "\n")
        out.flush()

    try:
        extract_batches(model, capture, ds, job["batches"], Path(job["out_dir"]), params.extract.dtype, placement, send,
                        frozenset(job["done"]))
    finally:
        capture.close()


if __name__ == "__main__":
    main()
