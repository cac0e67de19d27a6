"""What does versioning the hidden-state store with DVC cost, projected to the Kimi-K2.5 scale?

In fresh temp repositories (`git init` + `dvc init`), on a generated store of `--files` random
files of `--file-mb` MB each (written with fsync, then evicted from the page cache unless
`--warm`, so DVC reads them from disk as it would 4.6 TiB), each round measures, in
alternating order:

  store    DVC tracks the whole store folder: `dvc add data/hidden_states` (md5 of every file,
           transfer into the cache), then a second `dvc status` with nothing changed (DVC's
           cached-state path); once per `--cache-type` (default: the project's
           `reflink,hardlink,symlink`, and `hardlink,symlink`: on a file system without reflink
           the first *copies* the store into the cache during `add`, the second links it);
  manifest draftlab's design (dvc.yaml's extract stage): DVC tracks only
           `data/hidden_states/manifest.json`, written here at the reference's size
           (`--manifest-records`, default 37,312 entries), + the in-stream sha256 that extract
           computes on each file's bytes while they are in memory (hashlib MB/s, same bytes).

It then projects both to the reference scenario (37,312 files, 4.58 TiB; extraction 87.8 M
tokens at 2,600 tok/s ≈ 9.4 h) and prints each one's fraction of extraction time (goal ≤ 10%).
Medians and min–max over `--rounds`; nothing passes or fails on timing.

    python benchmarks/dvc_scale.py                        # 200 files x 4 MB, 3 rounds: ~1-2 min on 2 cores
    python benchmarks/dvc_scale.py --files 50 --file-mb 64 --json reports/dvc_scale.json
    python benchmarks/dvc_scale.py --cache-type hardlink,symlink --warm
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The Kimi-K2.5 reference scenario (DESIGN.md).
REF_FILES = 37_312
REF_BYTES = 4.58 * 2**40
REF_TOKENS = 87.8e6
REF_TOKENS_PER_S = 2_600
REF_EXTRACT_S = REF_TOKENS / REF_TOKENS_PER_S
GOAL_FRACTION = 0.10


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200, help="files in the generated store")
    ap.add_argument("--file-mb", type=float, default=4.0, help="MB (1e6 bytes) per file")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats")
    ap.add_argument("--cache-type", action="append", default=None,
                    help="DVC cache.type for whole-store tracking; repeat to compare "
                    "(default: reflink,hardlink,symlink and hardlink,symlink)")
    ap.add_argument("--manifest-records", type=int, default=REF_FILES,
                    help="entries in the tracked manifest (default: the reference's file count)")
    ap.add_argument("--warm", action="store_true", help="leave the store in the page cache (optimistic for DVC)")
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


def timed(cmd: list[str], cwd: Path) -> float:
    # DVC keeps per-repo state under a site cache dir (by default /var/tmp/dvc, and `dvc init`
    # writes there before any config exists): point it into the temp tree, removed at the end.
    env = {**os.environ, "DVC_SITE_CACHE_DIR": str(cwd.parent / "dvc-site"), "DVC_NO_ANALYTICS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{proc.stdout}{proc.stderr}")
    return dt


def init_repo(root: Path, dvc: str, cache_type: str) -> None:
    root.mkdir(parents=True)
    timed(["git", "init", "-q"], root)
    timed([dvc, "init", "-q"], root)
    # Written directly: three `dvc config` calls would cost seconds.
    (root / ".dvc" / "config").write_text(f'[core]\n    analytics = false\n[cache]\n    type = "{cache_type}"\n')


def generate_store(store_dir: Path, args, seed: int) -> dict:
    """Random files, each written as extract writes it (one write + fsync); returns the
    manifest records and the in-memory sha256 / md5 (/ xxh3) seconds over the same bytes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    store_dir.mkdir(parents=True)
    size = int(args.file_mb * 1e6)
    try:  # a non-cryptographic alternative for comparison (xxhash comes with datasets)
        from xxhash import xxh3_128
    except ImportError:
        xxh3_128 = None
    records, sha_s, md5_s, xxh_s = [], 0.0, 0.0, 0.0
    for i in range(args.files):
        blob = rng.bytes(size)
        t0 = time.perf_counter()
        digest = hashlib.sha256(blob).hexdigest()
        t1 = time.perf_counter()
        hashlib.md5(blob).hexdigest()
        t2 = time.perf_counter()
        if xxh3_128 is not None:
            xxh3_128(blob).hexdigest()
        xxh_s += time.perf_counter() - t2
        md5_s += t2 - t1
        sha_s += t1 - t0
        name = f"hs_{i}.safetensors"
        with open(store_dir / name, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        records.append({"index": i, "name": name, "bytes": size, "sha256": digest, "tokens": size // 57_352})
    return {"records": records, "bytes": size * args.files, "sha256_s": sha_s, "md5_s": md5_s,
            "xxh3_128_s": xxh_s if xxh3_128 is not None else None}


def write_manifest(path: Path, records: list[dict], num_records: int) -> int:
    """A manifest like extract's, padded with made-up entries to the reference's file count."""
    mean_bytes, fake = int(REF_BYTES / REF_FILES), hashlib.sha256(b"padding").hexdigest()
    padded = records + [{"index": i, "name": f"hs_{i}.safetensors", "bytes": mean_bytes, "sha256": fake,
                         "tokens": mean_bytes // 57_352} for i in range(len(records), num_records)]
    text = json.dumps({"key": "benchmark", "num_files": len(padded), "files": padded}, indent=2) + "\n"
    path.write_text(text)
    return len(text)


def link_kind(path: Path, nlink_before: int) -> str:
    if path.is_symlink():
        return "symlink"
    return "hardlink" if os.lstat(path).st_nlink > nlink_before else "copy (or reflink)"


def link_store(src: Path, store_dir: Path, records: list[dict]) -> None:
    """The generated files, hard-linked: every approach sees the same bytes, none is copied."""
    store_dir.mkdir(parents=True)
    for rec in records:
        os.link(src / rec["name"], store_dir / rec["name"])


def evict(store_dir: Path) -> None:
    """Drop the (clean, fsynced) files from the page cache so that DVC reads them from disk."""
    for path in store_dir.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_store(root: Path, dvc: str, cache_type: str, src: Path, records: list[dict], warm: bool) -> dict:
    """Whole-store tracking: dvc add of the folder, then a no-change dvc status (timed 2nd)."""
    init_repo(root, dvc, cache_type)
    store_dir = root / "data" / "hidden_states"
    link_store(src, store_dir, records)
    if not warm:
        evict(store_dir)
    probe = store_dir / "hs_0.safetensors"
    nlink_before = os.lstat(probe).st_nlink
    add_s = timed([dvc, "add", "-q", "data/hidden_states"], root)
    timed([dvc, "status", "-q"], root)
    status_s = timed([dvc, "status", "-q"], root)
    return {"add_s": add_s, "status_s": status_s, "link": link_kind(probe, nlink_before)}


def run_manifest(root: Path, dvc: str, cache_type: str, src: Path, records, num_records: int) -> dict:
    """draftlab's design: the store's files sit in the workspace, DVC tracks manifest.json only."""
    init_repo(root, dvc, cache_type)
    store_dir = root / "data" / "hidden_states"
    link_store(src, store_dir, records)
    manifest_bytes = write_manifest(store_dir / "manifest.json", records, num_records)
    add_s = timed([dvc, "add", "-q", "data/hidden_states/manifest.json"], root)
    timed([dvc, "status", "-q"], root)
    status_s = timed([dvc, "status", "-q"], root)
    return {"add_s": add_s, "status_s": status_s, "manifest_bytes": manifest_bytes}


def main() -> None:
    args = parse_args()
    cache_types = args.cache_type or ["reflink,hardlink,symlink", "hardlink,symlink"]
    dvc = dvc_exe()
    dvc_version = subprocess.run([dvc, "--version"], capture_output=True, text=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="draftlab-dvc-bench-", dir=args.workdir))
    approaches = [f"store[{c}]" for c in cache_types] + ["manifest"]
    runs: dict[str, list[dict]] = {a: [] for a in approaches}
    gens = []
    print(f"DVC {dvc_version}; {os.cpu_count()} CPUs; store {args.files} files x {args.file_mb:g} MB "
          f"= {args.files * args.file_mb / 1e3:.2f} GB, {'warm' if args.warm else 'evicted from'} page cache; "
          f"{args.rounds} rounds; temp dir {work}", flush=True)
    try:
        for r in range(args.rounds):
            rd = work / f"round-{r}"
            gens.append(generate_store(rd / "src", args, seed=r))
            records = gens[-1]["records"]
            order = approaches if r % 2 == 0 else approaches[::-1]
            for a in order:
                if a == "manifest":
                    res = run_manifest(rd / "repo-manifest", dvc, cache_types[0], rd / "src", records,
                                       args.manifest_records)
                else:
                    c = a[len("store["):-1]
                    res = run_store(rd / f"repo-{cache_types.index(c)}", dvc, c, rd / "src", records, args.warm)
                runs[a].append(res)
                print(f"  round {r + 1} {a}: dvc add {res['add_s']:.2f} s, 2nd dvc status {res['status_s']:.2f} s"
                      + (f" (workspace: {res['link']})" if "link" in res else ""), flush=True)
            shutil.rmtree(rd, ignore_errors=True)
        results = summarize(args, runs, gens, cache_types, dvc_version)
        report(results)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2) + "\n")
            print(f"results → {args.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(args, runs, gens, cache_types, dvc_version) -> dict:
    nbytes = args.files * int(args.file_mb * 1e6)
    man = runs["manifest"]
    man_add = spread([m["add_s"] for m in man])
    man_status = spread([m["status_s"] for m in man])
    sha_mb_s = spread([g["bytes"] / g["sha256_s"] / 1e6 for g in gens])
    write_mb_s = REF_BYTES / REF_EXTRACT_S / 1e6
    out = {
        "machine": {"cpus": os.cpu_count(), "dvc": dvc_version},
        "store": {"files": args.files, "file_mb": args.file_mb, "bytes": nbytes,
                  "page_cache": "warm" if args.warm else "evicted"},
        "reference": {"files": REF_FILES, "bytes": REF_BYTES, "tokens": REF_TOKENS,
                      "tokens_per_s": REF_TOKENS_PER_S, "extract_s": REF_EXTRACT_S, "write_mb_s": write_mb_s},
        "in_memory_mb_s": {"sha256": sha_mb_s, **{
            name: spread([g["bytes"] / g[f"{name}_s"] / 1e6 for g in gens])
            for name in ("md5", "xxh3_128") if gens[0].get(f"{name}_s")}},
        "approaches": {},
    }
    for c in cache_types:
        rs = runs[f"store[{c}]"]
        # DVC's own start-up is paid by every command: the manifest repo's `dvc add` of the same
        # round measures it, so the store's per-byte rate is bytes / (difference).
        marginal = spread([nbytes / max(x["add_s"] - m["add_s"], 1e-3) / 1e6 for x, m in zip(rs, man)])
        status = spread([x["status_s"] for x in rs])
        per_file_status_s = max(status["median"] - man_status["median"], 0.0) / args.files
        ref_add_s = REF_BYTES / (marginal["median"] * 1e6) + man_add["median"]
        out["approaches"][f"store[{c}]"] = {
            "dvc_add_s": spread([x["add_s"] for x in rs]),
            "add_mb_per_s": spread([nbytes / x["add_s"] / 1e6 for x in rs]),
            "add_marginal_mb_per_s": marginal,
            "add_files_per_s": spread([args.files / x["add_s"] for x in rs]),
            "dvc_status_no_change_s": status,
            "workspace_after_add": rs[0]["link"],
            "ref_dvc_add_s": ref_add_s,
            "ref_dvc_status_no_change_s": man_status["median"] + per_file_status_s * REF_FILES,
            "ref_fraction_of_extraction": ref_add_s / REF_EXTRACT_S,
        }
    sha_ref_s = REF_BYTES / (sha_mb_s["median"] * 1e6)
    out["approaches"]["manifest"] = {
        "manifest_records": args.manifest_records, "manifest_bytes": man[0]["manifest_bytes"],
        "dvc_add_s": man_add, "dvc_status_no_change_s": man_status,
        "ref_dvc_add_s": man_add["median"], "ref_dvc_status_no_change_s": man_status["median"],
        "ref_sha256_cpu_s": sha_ref_s,
        "sha256_fraction_of_one_core": write_mb_s / sha_mb_s["median"],
        "ref_fraction_of_extraction_dvc_only": man_add["median"] / REF_EXTRACT_S,
        "ref_fraction_of_extraction": (man_add["median"] + sha_ref_s) / REF_EXTRACT_S,
    }
    return out


def report(res: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(highlight=False, width=max(Console().width, 120))

    def ms(s, fmt="{:.2f}"):
        return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"

    def dur(s):
        return f"{s / 3600:.2f} h" if s >= 360 else f"{s:.1f} s"

    st, ref, aps = res["store"], res["reference"], res["approaches"]
    names = list(aps)
    t = Table(title=f"DVC on a generated store: {st['files']} files x {st['file_mb']:g} MB, "
              f"{st['page_cache']} page cache; median (min–max) over rounds")
    t.add_column("measure")
    for n in names:
        a = aps[n]
        head = (f"manifest only\n({a['manifest_records']:,} entries, {a['manifest_bytes'] / 1e6:.1f} MB)"
                if n == "manifest" else f"whole store\ncache.type {n[6:-1]}")
        t.add_column(escape(head), justify="right")

    def row(label, fn):
        t.add_row(label, *[escape(fn(aps[n], n)) for n in names])

    store_only = lambda f: (lambda a, n: "" if n == "manifest" else f(a))  # noqa: E731
    row("dvc add, s", lambda a, n: ms(a["dvc_add_s"]))
    row("dvc add, MB/s (incl. DVC start-up)", store_only(lambda a: ms(a["add_mb_per_s"], "{:.0f}")))
    row("dvc add, MB/s (start-up subtracted)", store_only(lambda a: ms(a["add_marginal_mb_per_s"], "{:.0f}")))
    row("dvc add, files/s", store_only(lambda a: ms(a["add_files_per_s"], "{:.0f}")))
    row("2nd dvc status, no change, s", lambda a, n: ms(a["dvc_status_no_change_s"]))
    row("workspace files after dvc add", lambda a, n: "untouched" if n == "manifest" else a["workspace_after_add"])
    row("reference: dvc add per change", lambda a, n: dur(a["ref_dvc_add_s"]))
    row("reference: no-change dvc status", lambda a, n: dur(a["ref_dvc_status_no_change_s"]))
    row("reference: in-stream sha256 (CPU)", lambda a, n: dur(a["ref_sha256_cpu_s"]) if n == "manifest" else "")
    row(f"reference: fraction of {ref['extract_s'] / 3600:.2f} h extraction",
        lambda a, n: (f"{a['ref_fraction_of_extraction_dvc_only']:.3%} DVC + "
                      f"{a['sha256_fraction_of_one_core']:.1%} sha256") if n == "manifest"
        else f"{a['ref_fraction_of_extraction']:.1%}")
    con.print(t)
    hashing = ", ".join(f"{k} {ms(v, '{:.0f}')}" for k, v in res["in_memory_mb_s"].items())
    m = aps["manifest"]
    con.print(f"in-memory hashing of the same bytes, MB/s on one core: {hashing}", markup=False)
    con.print(f"reference: {ref['files']:,} files, {ref['bytes'] / 2**40:.2f} TiB, {ref['tokens'] / 1e6:.1f} M tokens "
              f"at {ref['tokens_per_s']:,} tok/s = {ref['extract_s'] / 3600:.2f} h of extraction writing "
              f"{ref['write_mb_s']:.0f} MB/s; in-stream sha256 keeps {m['sha256_fraction_of_one_core']:.1%} of one "
              "core busy (added to extraction wall time if done serially, ~0 if overlapped with the next forward)",
              markup=False)
    parts = [f"whole store (cache.type {k[6:-1]}) {a['ref_fraction_of_extraction']:.1%} per change"
             for k, a in aps.items() if k != "manifest"]
    con.print(f"RESULT projected overhead at the reference, goal <= {GOAL_FRACTION:.0%} of extraction: "
              + "; ".join(parts) + f"; manifest only: DVC {m['ref_fraction_of_extraction_dvc_only']:.3%}"
              f" + in-stream sha256 {m['sha256_fraction_of_one_core']:.1%} of one core", markup=False)


if __name__ == "__main__":
    main()
