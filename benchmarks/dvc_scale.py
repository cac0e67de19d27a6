"""What does versioning the hidden-state store with DVC cost, projected to the Kimi-K2.5 scale?

A generated store of `--files` files of `--file-mb` MB (default 135 MB: the reference's mean
2,353 tokens × 57.35 kB per token), written with fsync. Each round, in alternating order, on a
page cache evicted per file (posix_fadvise DONTNEED; `drop_caches` needs root):

  dd         `dd bs=16M` of every file to /dev/null: the disk's read rate
  md5        hashlib.md5 of every file read in 16 MB chunks on one core (DVC's hash)
  dvc jobs=N `dvc add data/hidden_states` in a fresh repo (`git init` + `dvc init`,
             cache.type hardlink,symlink as the project sets it), with core.checksum_jobs N:
             once at 1 and once at the machine's cores; the workspace files are hardlinks of
             the generated ones, so nothing is copied and every repo reads the same bytes
  start-up   `dvc add` of one small file in a fresh repo: what every DVC command pays
  per-file   `dvc add` of `--small-files` files of 4 kB: DVC's cost per file apart from bytes

and once, the in-memory md5 rate of one core (the same bytes, from memory). The projection to
the reference (37,312 files, 4.58 TiB; extraction 87.8 M tokens at 2,600 tokens/s = 9.4 h)
on a host of `--ref-cores` cores and a disk of `--ref-disk-gb-s` GB/s:
    start-up + bytes / min(disk, cores × md5 per core × DVC's efficiency) + files × per-file
where DVC's efficiency is its measured rate at jobs=1 over md5's (from cold files). Goal: DVC's
hashing + linking ≤ 10% of extraction there, and ≥ 0.8× dd here. Nothing passes or fails on
timing.

    python benchmarks/dvc_scale.py                         # 16 x 135 MB = 2.2 GB, 3 rounds
    python benchmarks/dvc_scale.py --files 24 --rounds 5 --json reports/dvc_scale.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The Kimi-K2.5 reference scenario (DESIGN.md, tests/unit/test_planning.py).
REF_FILES = 37_312
REF_BYTES = 5_034_000_000_000  # 4.58 TiB
REF_TOKENS = 87_800_000
REF_TOKENS_PER_S = 2_600
REF_EXTRACT_S = REF_TOKENS / REF_TOKENS_PER_S
GOAL_FRACTION = 0.10
CHUNK = 16 << 20


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=16, help="files in the generated store")
    ap.add_argument("--file-mb", type=float, default=135.0, help="MB per file (reference mean: 135)")
    ap.add_argument("--small-files", type=int, default=2000, help="4 kB files for DVC's per-file cost")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats")
    ap.add_argument("--ref-cores", type=int, default=16, help="cores of the reference host")
    ap.add_argument("--ref-disk-gb-s", type=float, default=2.0, help="read GB/s of the reference host's disk")
    ap.add_argument("--workdir", type=Path, default=None, help="where temp repos go (default: system temp)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap.parse_args()


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def dvc_exe() -> str:
    beside = Path(sys.executable).parent / "dvc"
    found = str(beside) if beside.exists() else shutil.which("dvc")
    if not found:
        raise SystemExit("dvc not found beside this python or on PATH; install draftlab's dev environment")
    return found


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed(cmd: list[str], cwd: Path, cpu: list | None = None) -> float:
    # DVC keeps per-repo state under a site cache dir (by default /var/tmp/dvc): point it into the
    # temp tree, removed at the end.
    env = {**os.environ, "DVC_SITE_CACHE_DIR": str(cwd.parent / "dvc-site"), "DVC_NO_ANALYTICS": "1"}
    t0, c0 = time.perf_counter(), children_cpu_s()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(children_cpu_s() - c0)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{proc.stdout}{proc.stderr}")
    return dt


def init_repo(root: Path, dvc: str, jobs: int) -> None:
    root.mkdir(parents=True)
    timed(["git", "init", "-q"], root)
    timed([dvc, "init", "-q"], root)
    (root / ".dvc" / "config").write_text(
        f'[core]\n    analytics = false\n    checksum_jobs = {jobs}\n[cache]\n    type = "hardlink,symlink"\n')


def generate(src: Path, args) -> float:
    """Random files written as extract writes them (one write + fsync); returns the in-memory
    md5 CPU-seconds of one core over the same bytes."""
    import numpy as np

    rng = np.random.default_rng(0)
    src.mkdir(parents=True)
    size, md5_s = int(args.file_mb * 1e6), 0.0
    for i in range(args.files):
        blob = rng.bytes(size)
        t0 = time.process_time()  # CPU time: the machine is shared, wall-clock would measure the others
        hashlib.md5(blob).hexdigest()
        md5_s += time.process_time() - t0
        with open(src / f"hs_{i}.safetensors", "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
    return md5_s


def evict(files: list[Path]) -> None:
    """Drop the files from the page cache (dirty pages first written back: they cannot be dropped)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_dd(files: list[Path]) -> dict:
    evict(files)
    t0, c0 = time.perf_counter(), children_cpu_s()
    for path in files:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "status=none"], check=True)
    return {"s": time.perf_counter() - t0, "cpu_s": children_cpu_s() - c0}


def run_md5(files: list[Path]) -> dict:
    evict(files)
    t0, c0 = time.perf_counter(), time.process_time()
    for path in files:
        h = hashlib.md5()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    return {"s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def run_dvc(root: Path, dvc: str, jobs: int, src: Path, files: list[Path]) -> dict:
    init_repo(root, dvc, jobs)
    store = root / "data" / "hidden_states"
    store.mkdir(parents=True)
    for path in files:
        os.link(path, store / path.name)
    evict(files)
    cpu: list[float] = []
    add_s = timed([dvc, "add", "-q", "data/hidden_states"], root, cpu)
    probe = store / files[0].name
    return {"s": add_s, "cpu_s": cpu[0], "linked": os.lstat(probe).st_nlink >= 2 or probe.is_symlink()}


def run_small(root: Path, dvc: str, jobs: int, n: int) -> dict:
    init_repo(root, dvc, jobs)
    store = root / "data" / "small"
    store.mkdir(parents=True)
    for i in range(n):
        (store / f"f{i}").write_bytes(os.urandom(4096))
    cpu: list[float] = []
    return {"s": timed([dvc, "add", "-q", "data/small"], root, cpu), "cpu_s": cpu[0]}


def run_startup(root: Path, dvc: str, jobs: int) -> dict:
    init_repo(root, dvc, jobs)
    (root / "one").write_bytes(b"x")
    cpu: list[float] = []
    return {"s": timed([dvc, "add", "-q", "one"], root, cpu), "cpu_s": cpu[0]}


def main() -> None:
    args = parse_args()
    dvc, cores = dvc_exe(), os.cpu_count() or 1
    version = subprocess.run([dvc, "--version"], capture_output=True, text=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="draftlab-dvc-bench-", dir=args.workdir))
    nbytes = args.files * int(args.file_mb * 1e6)
    jobs_list = sorted({1, cores})
    print(f"DVC {version}; {cores} CPUs; store {args.files} files x {args.file_mb:g} MB = {nbytes / 1e9:.2f} GB "
          f"(H = 7168, 2,353 tokens per file at the reference's 57.35 kB/token), evicted; {args.rounds} rounds; "
          f"{work}", flush=True)
    try:
        md5_mem_cpu_s = generate(work / "src", args)
        files = sorted((work / "src").iterdir())
        res: dict[str, list] = {"dd": [], "md5": [], "startup": [], "small": [],
                                **{f"dvc{j}": [] for j in jobs_list}}
        for r in range(args.rounds):
            steps = {"dd": lambda: run_dd(files), "md5": lambda: run_md5(files),
                     "startup": lambda: run_startup(work / f"r{r}-startup", dvc, cores),
                     "small": lambda: run_small(work / f"r{r}-small", dvc, cores, args.small_files),
                     **{f"dvc{j}": (lambda j=j: run_dvc(work / f"r{r}-jobs{j}", dvc, j, work / "src", files))
                        for j in jobs_list}}
            for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
                res[name].append(steps[name]())
            line = ", ".join(f"{n} {nbytes / vs[-1]['s'] / 1e6:.0f} MB/s ({vs[-1]['cpu_s']:.1f} CPU-s)"
                             for n, vs in res.items() if n not in ("startup", "small"))
            print(f"  round {r + 1}: {line}; dvc start-up {res['startup'][-1]['s']:.2f} s, "
                  f"{args.small_files} small files {res['small'][-1]['s']:.2f} s; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            for j in jobs_list:
                shutil.rmtree(work / f"r{r}-jobs{j}", ignore_errors=True)
        out = summarize(args, res, md5_mem_cpu_s, nbytes, jobs_list, cores, version)
        report(out)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=2) + "\n")
            print(f"results → {args.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(args, res, md5_mem_cpu_s, nbytes, jobs_list, cores, version) -> dict:
    gb = nbytes / 1e9
    med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    startup_s, startup_cpu = med(res["startup"], "s"), med(res["startup"], "cpu_s")
    wall = {n: spread([gb * 1e3 / max(x["s"] - (startup_s if n.startswith("dvc") else 0), 1e-3) for x in res[n]])
            for n in ["dd", "md5", *(f"dvc{j}" for j in jobs_list)]}  # MB/s (DVC: start-up subtracted)
    over_dd = {n: spread([(gb * 1e3 / max(x["s"] - (startup_s if n.startswith("dvc") else 0), 1e-3))
                          / (gb * 1e3 / d["s"]) for x, d in zip(res[n], res["dd"])]) for n in wall if n != "dd"}
    cpu_per_gb = {n: spread([max(x["cpu_s"] - (startup_cpu if n.startswith("dvc") else 0), 0.0) / gb
                             for x in res[n]]) for n in wall}
    md5_core_mb_s = nbytes / md5_mem_cpu_s / 1e6
    # DVC's CPU per byte (hash, state, link), from its own jobs=1 run: the rate one core sustains
    dvc_core_mb_s = 1e3 / max(cpu_per_gb["dvc1"]["median"], 1e-6)
    per_file_cpu = max(med(res["small"], "cpu_s") - startup_cpu, 0.0) / args.small_files
    per_file_s = max(med(res["small"], "s") - startup_s, 0.0) / args.small_files

    def ref_s(jobs: int) -> float:
        rate = min(args.ref_disk_gb_s * 1e3, min(jobs, args.ref_cores) * dvc_core_mb_s)
        return startup_cpu + REF_BYTES / (rate * 1e6) + REF_FILES * per_file_cpu

    default_jobs = max(1, min(4, args.ref_cores // 2))
    return {
        "machine": {"cpus": cores, "dvc": version, "load_average_end": os.getloadavg()},
        "store": {"files": args.files, "file_mb": args.file_mb, "bytes": nbytes, "page_cache": "evicted"},
        "wall_mb_s": wall, "over_dd": over_dd, "cpu_s_per_gb": cpu_per_gb,
        "md5_in_memory_one_core_mb_s": md5_core_mb_s, "dvc_one_core_mb_s": dvc_core_mb_s,
        "linked_not_copied": all(x["linked"] for j in jobs_list for x in res[f"dvc{j}"]),
        "dvc_startup_s": spread([x["s"] for x in res["startup"]]), "dvc_startup_cpu_s": startup_cpu,
        "dvc_per_file_s": per_file_s, "dvc_per_file_cpu_s": per_file_cpu,
        "reference": {"files": REF_FILES, "bytes": REF_BYTES, "extract_s": REF_EXTRACT_S, "cores": args.ref_cores,
                      "disk_gb_s": args.ref_disk_gb_s, "dvc_s": ref_s(args.ref_cores),
                      "fraction_of_extraction": ref_s(args.ref_cores) / REF_EXTRACT_S,
                      "default_jobs": default_jobs, "dvc_s_default_jobs": ref_s(default_jobs),
                      "fraction_at_default_jobs": ref_s(default_jobs) / REF_EXTRACT_S},
    }


def report(out: dict) -> None:
    def ms(s, f="{:.0f}"):
        return f"{f.format(s['median'])} ({f.format(s['min'])}–{f.format(s['max'])})"

    ref, w, c = out["reference"], out["wall_mb_s"], out["cpu_s_per_gb"]
    print(f"wall-clock MB/s, median (min–max): " + "; ".join(f"{n} {ms(v)}" for n, v in w.items())
          + " (dvc: start-up subtracted)")
    print("over dd: " + "; ".join(f"{n} {ms(v, '{:.2f}')}" for n, v in out["over_dd"].items()))
    print("CPU-s per GB: " + "; ".join(f"{n} {ms(v, '{:.2f}')}" for n, v in c.items()))
    print(f"one core: md5 in memory {out['md5_in_memory_one_core_mb_s']:.0f} MB/s, DVC (its CPU per byte at jobs=1) "
          f"{out['dvc_one_core_mb_s']:.0f} MB/s; dvc start-up {ms(out['dvc_startup_s'], '{:.2f}')} s "
          f"({out['dvc_startup_cpu_s']:.2f} CPU-s); per file {out['dvc_per_file_cpu_s'] * 1e3:.2f} CPU-ms "
          f"({out['dvc_per_file_s'] * 1e3:.2f} ms wall); workspace linked, not copied: {out['linked_not_copied']}; "
          f"load average at the end {out['machine']['load_average_end'][0]:.1f}")
    print(f"RESULT reference ({ref['files']:,} files, {ref['bytes'] / 2**40:.2f} TiB) on {ref['cores']} cores, "
          f"{ref['disk_gb_s']:g} GB/s: dvc add {ref['dvc_s'] / 3600:.2f} h = {ref['fraction_of_extraction']:.1%} of the "
          f"{ref['extract_s'] / 3600:.1f} h extraction at checksum_jobs = cores (goal <= {GOAL_FRACTION:.0%}); "
          f"{ref['dvc_s_default_jobs'] / 3600:.2f} h = {ref['fraction_at_default_jobs']:.1%} at DVC's default "
          f"{ref['default_jobs']}")


if __name__ == "__main__":
    main()
