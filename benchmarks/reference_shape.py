"""The Kimi-K2.5 reference scenario's shape, simulated by counts: 37,312 store files, 177,230
steps of history, 8 ranks. What costs per file or per step, measured here and projected there.

    python benchmarks/reference_shape.py store                 # 37,312 files (the figures)
    python benchmarks/reference_shape.py store --files 2000    # a smoke run
    python benchmarks/reference_shape.py history               # 177,230 steps
    python benchmarks/reference_shape.py history --steps 5000  # a smoke run
    python benchmarks/reference_shape.py ranks --world-size 8  # 8 gloo ranks, kill -9, resume

`store`: a store of `--files` files written by extract's own writer (`store.capture.write_batch`,
`store.layout.Journal`, `stages.extract.write_manifest`) and its prepared dataset. Tokens per file
are the reference's length distribution (`plan.steps.synthesise_lengths`: 37,312 lognormal(σ=0.7)
lengths summing to 87.8 M tokens, capped at 8,192) divided by `--token-scale`, at a small H, so
the files are small and per-file cost dominates. It times what a user meets: dvc commit / status
(unchanged) / push (local remote) / pull (fresh clone) / checkout (a params flip and back);
`draftlab verify` (--report as dvc repro runs it, --quick, full); extract's resume scan after a
kill at 90 %; manifest write and read; train's preflight up to step one and the loader's open per
file; `draftlab plan` from counts. Each is projected to the reference (37,312 files, 4.58 TiB) as
    start-up + files × (measured per file) + bytes / (the reference host's rate for that work)
with the host stated by --ref-*: per-byte rates are measured here on one core (sha256, md5) and
capped by the reference disk. Goals there: the store's per-file overheads together ≤ 1 % of the
9.4 h extraction; `dvc status` unchanged ≤ 30 s; train preflight ≤ 60 s; resume scan ≤ 30 s.

`history`: a run of `--steps` steps driven through rank 0's own writers (training.rank's
MetricsToTracker: metrics.jsonl, the batched MLflow writer into a sqlite store), then the spool
(rundir.append_spool) and `draftlab tracking-import` of it, evaluate's curve reading, and the MLflow
UI's run page and train/loss chart in headless Chromium (`--ui`; needs chromium + chromedriver).

`ranks`: the tiny pipeline trained with `--world-size` gloo ranks, killed with kill -9 after its
first checkpoint and resumed: one MLflow run, each step once, accounting and sharding verified.

Nothing passes or fails on timing; the machine and its load (uptime) are printed with the figures.
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
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REF_FILES = 37_312
REF_TOKENS = 87_800_000
REF_BYTES = 5_034_000_000_000  # 4.58 TiB
REF_STEPS = 177_230
REF_EXTRACT_S = REF_TOKENS / 2_600  # 9.4 h
GOALS = {"per_file_total": 0.01 * REF_EXTRACT_S, "dvc_status": 30.0, "train_preflight": 60.0, "resume_scan": 30.0}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def machine() -> str:
    return f"{os.cpu_count()} CPUs, {os.uname().sysname} {os.uname().release}; {uptime()}"


def exe(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found beside this python or on PATH; run scripts/install.sh --test")
    return found


def timed(cmd: list[str], cwd: Path, env: dict | None = None) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed in {cwd} ({proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-3000:]}")
    return dt


def clock(fn, repeats: int = 1) -> tuple[float, object]:
    """Median wall seconds of `repeats` calls, and the last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def one_core_rate(algo: str, nbytes: int = 256 << 20) -> float:
    """Bytes/s of hashlib `algo` on one core over in-memory bytes (CPU time: the host is shared)."""
    blob = os.urandom(1 << 20) * (nbytes >> 20)
    t0 = time.process_time()
    hashlib.new(algo, blob).hexdigest()
    return nbytes / (time.process_time() - t0)


# ---------------------------------------------------------------- store


def ref_lengths(token_scale: int, files: int):
    import numpy as np

    from draftlab.plan.steps import CENTRAL_SIGMA, synthesise_lengths

    full = synthesise_lengths(REF_FILES, REF_TOKENS, sigma=CENTRAL_SIGMA, max_len=8192, seed=0)
    scaled = np.maximum(1, np.rint(full / token_scale)).astype(int)
    return [int(x) for x in scaled[:files]]


def write_dataset(data_dir: Path, lengths: list[int], vocab: int = 256) -> None:
    """A prepared dataset of these lengths (speculators' columns), as prepare saves it."""
    import numpy as np
    from datasets import Dataset

    rng = np.random.default_rng(0)
    ids = [rng.integers(0, vocab, n).tolist() for n in lengths]
    masks = [[0] * (n // 4) + [1] * (n - n // 4) for n in lengths]
    Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": lengths}).save_to_disk(str(data_dir))
    freq = np.bincount(np.concatenate([np.asarray(x) for x in ids]), minlength=vocab)
    import torch

    torch.save({i: int(c) for i, c in enumerate(freq)}, data_dir / "token_freq.pt")


def write_store(store_dir: Path, lengths: list[int], hidden: int, key: str, seed: int, batch_tokens: int) -> dict:
    """Every file through extract's writer, journaled batch by batch; the writer's own seconds."""
    import torch

    from draftlab.store import layout as store
    from draftlab.store.capture import plan_batches, write_batch

    journal = store.Journal.open(store_dir, key)
    gen = torch.Generator().manual_seed(seed)
    write_s = journal_s = 0.0
    for batch in plan_batches(lengths, batch_tokens):
        lens = [lengths[i] for i in batch]
        hidden_BT4H = torch.randn(len(batch), max(lens), 4, hidden, generator=gen).to(torch.bfloat16)
        ids = torch.randint(0, 256, (len(batch), max(lens)), generator=gen)
        t0 = time.perf_counter()
        records = write_batch(store_dir, batch, lens, hidden_BT4H, ids)
        t1 = time.perf_counter()
        journal.record(records)
        write_s += t1 - t0
        journal_s += time.perf_counter() - t1
    return {"write_s": write_s, "journal_s": journal_s, "journal": journal}


def fsync_cost(folder: Path, n: int, size: int = 5_000) -> dict:
    """Seconds per small file of util.write_bytes_atomic (write, fsync, rename) against the same
    write and rename without the fsync, interleaved: the disk's flush latency in the writer."""
    from draftlab.util import write_bytes_atomic

    folder.mkdir()
    blob, atomic, plain = os.urandom(size), [], []
    for i in range(n):
        t0 = time.perf_counter()
        write_bytes_atomic(folder / f"a{i}", blob)
        t1 = time.perf_counter()
        tmp = folder / f".p{i}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, folder / f"p{i}")
        plain.append(time.perf_counter() - t1)
        atomic.append(t1 - t0)
    shutil.rmtree(folder)
    return {"atomic_s": statistics.median(atomic), "no_fsync_s": statistics.median(plain),
            "atomic_mean_s": statistics.mean(atomic)}


def manifest_of(params, journal, lengths, hidden: int, key: str):
    from draftlab.stages.extract import Checked

    c = Checked(num_layers=8, hidden_size=hidden, vocab_size=256, layer_ids=[2, 4, 5], key_fields={"bench": key},
                key=key)
    files = [{k: v for k, v in journal.done[i].items() if k != "mtime_ns"} for i in range(len(lengths))]
    return c, files


def resume_scan(store_dir: Path, data_dir: Path, key: str, batch_tokens: int) -> int:
    """What extract does after a kill before its first new forward: journal, checks of the
    journaled files, torn files, the batch plan, what is left (stages.extract.run's prologue)."""
    from datasets import load_from_disk

    from draftlab.console import console
    from draftlab.stages.extract import drop_bad_files
    from draftlab.store import layout as store
    from draftlab.store.capture import plan_batches

    seq_lens = list(load_from_disk(str(data_dir))["seq_len"])
    journal = store.Journal.open(store_dir, key)
    drop_bad_files(store_dir, journal, console)
    for torn in store_dir.glob(".hs_*.tmp-*"):
        torn.unlink()
    todo = [b for b in plan_batches(seq_lens, batch_tokens) if not all(i in journal.done for i in b)]
    store.predicted_bytes([seq_lens[i] for b in todo for i in b], 8, "bfloat16")
    return len(todo)


def killed_at(src: Path, dst: Path, fraction: float) -> None:
    """A copy (hardlinks) of `src` as a kill at `fraction` of its journal's batches leaves it."""
    from draftlab.store import layout as store

    lines = store.StoreDir(src).journal_path.read_text().splitlines()
    keep = lines[: 1 + int((len(lines) - 1) * fraction)]
    dst.mkdir(parents=True)
    names = {r["name"] for line in keep[1:] for r in json.loads(line)["files"]}
    for name in names:
        os.link(src / name, dst / name)
    store.StoreDir(dst).journal_path.write_text("\n".join(keep) + "\n")


def train_preflight(params, data_dir: Path, store_dir: Path) -> dict:
    """The launcher's work before torchrun starts (stages.train.run up to the launch), phase by phase."""
    from draftlab.console import console
    from draftlab.rundir import RankPlan
    from draftlab.store import layout as store
    from draftlab.training import job

    out = {}
    t0 = time.perf_counter()
    job.preflight(params, data_dir, store_dir, console)
    out["checks_s"] = (t1 := time.perf_counter()) - t0
    sha = store.manifest_hash(store_dir)
    job.run_key(params, sha, data_dir)
    out["key_s"] = (t2 := time.perf_counter()) - t1
    a, step_tokens = job.plan(params, data_dir)
    out["accounting_s"] = (t3 := time.perf_counter()) - t2
    RankPlan(total_steps=a.total_steps, step_tokens=step_tokens).model_dump_json()
    out["plan_file_s"] = time.perf_counter() - t3
    out["total_s"] = time.perf_counter() - t0
    out["total_steps"] = a.total_steps
    return out


def loader_open(store_dir: Path, files: int) -> float:
    """Seconds per file of the rank's checked read (hidden_states.VerifiedTransfer over speculators'
    FileTransfer: map, sha256, decode), page cache warm: the per-file part of every read."""
    from draftlab.store import layout as store
    from draftlab.store import hidden_states

    records = {f.index: f.model_dump() for f in store.read_manifest(store_dir).files}
    from hs_connectors.transfer import FileTransfer

    inner = FileTransfer.__new__(FileTransfer)
    inner.__dict__.update({"path": str(store_dir), "hidden_states_path": str(store_dir)})
    vt = hidden_states.VerifiedTransfer(inner, store_dir, records, full=True)
    n = min(files, len(records))
    t0 = time.perf_counter()
    for i in range(n):
        vt.get_cached(i)
    return (time.perf_counter() - t0) / n


def dvc_env(work: Path) -> dict:
    return {**os.environ, "DVC_SITE_CACHE_DIR": str(work / "dvc-site"), "DVC_NO_ANALYTICS": "1",
            "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost", "GIT_COMMITTER_NAME": "bench",
            "GIT_COMMITTER_EMAIL": "bench@localhost"}


DVC_YAML = """stages:
  extract:
    cmd: "true"
    params:
      - extract
    outs:
      - data/hidden_states
"""


def run_store(args) -> dict:
    import yaml

    from draftlab.params import load_params, parse_params
    from draftlab.rundir import StoreDir
    from draftlab.stages.extract import write_manifest
    from draftlab.store import layout as store

    work = Path(tempfile.mkdtemp(prefix="draftlab-refshape-", dir=args.workdir))
    dvc, git, draftlab = exe("dvc"), "git", exe("draftlab")
    env = dvc_env(work)
    lengths = ref_lengths(args.token_scale, args.files)
    n, tokens = len(lengths), sum(lengths)
    bpt = store.bytes_per_token(args.hidden, "bfloat16")
    print(f"store: {n:,} files, {tokens:,} tokens (the reference's lengths / {args.token_scale}, mean "
          f"{tokens / n:.1f}), H = {args.hidden}, bf16 ({bpt} B/token); {work}", flush=True)
    print(f"machine: {machine()}", flush=True)
    res: dict = {"files": n, "tokens": tokens, "hidden": args.hidden, "token_scale": args.token_scale}
    try:
        repo = work / "repo"
        data_dir, store_dir = repo / "data" / "prepared", repo / "data" / "hidden_states"
        repo.mkdir()
        write_dataset(data_dir, lengths)
        raw = yaml.safe_load((REPO / "params.yaml").read_text())
        raw["train"].update({"gpus": args.world_size, "epochs": 5, "total_seq_len": -(-8192 // args.token_scale)})
        (repo / "params.yaml").write_text(yaml.safe_dump(raw))
        params = parse_params(raw)
        key = "a" * 64
        t0 = time.perf_counter()
        w = write_store(store_dir, lengths, args.hidden, key, seed=0, batch_tokens=args.batch_tokens)
        res["write"] = {"wall_s": time.perf_counter() - t0, "writer_s": w["write_s"], "journal_s": w["journal_s"]}
        res["fsync"] = fsync_cost(work / "fsync", 300)
        c, files = manifest_of(params, w["journal"], lengths, args.hidden, key)
        mw, _ = clock(lambda: write_manifest(store_dir, params, c, key=key, files=files), 3)
        mr, manifest = clock(lambda: store.read_manifest(store_dir), 3)
        nbytes = manifest.total_bytes
        res["bytes"] = nbytes
        res["manifest"] = {"write_s": mw, "read_s": mr, "bytes": StoreDir(store_dir).manifest.path.stat().st_size}
        print(f"  written: {res['write']['writer_s']:.1f} s writer + {res['write']['journal_s']:.1f} s journal "
              f"({nbytes / 1e6:.0f} MB); manifest write {mw:.2f} s, read {mr:.2f} s; {uptime()}", flush=True)

        # resume scan after a kill at 90 % (on hardlinks of the untouched store)
        killed_at(store_dir, work / "killed", 0.9)
        rs, todo = clock(lambda: resume_scan(work / "killed", data_dir, key, args.batch_tokens), 3)
        res["resume_scan"] = {"s": rs, "batches_left": todo, "journaled_files": len(list((work / "killed").iterdir())) - 1}
        print(f"  resume scan at 90 %: {rs:.2f} s ({todo} batches left); {uptime()}", flush=True)

        # train preflight and the loader's open
        tp = [train_preflight(params, data_dir, store_dir) for _ in range(2)]
        res["train_preflight"] = min(tp, key=lambda x: x["total_s"])
        res["loader_open_s_per_file"] = loader_open(store_dir, min(n, 2000))
        print(f"  train preflight {res['train_preflight']}; loader open {res['loader_open_s_per_file'] * 1e6:.0f} "
              f"µs/file; {uptime()}", flush=True)

        # draftlab verify, as dvc repro runs it, --quick, full
        startup = statistics.median(timed([draftlab, "verify", "--help"], repo) for _ in range(3))
        res["draftlab_startup_s"] = startup
        modes = {"report": ["--report", str(work / "check.json")], "quick": ["--quick"], "full": []}
        runs: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(3):  # interleaved, the order turned each round: the host is shared
            for m in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                runs[m].append(timed([draftlab, "verify", "data/hidden_states", *modes[m]], repo))
        assert json.loads((work / "check.json").read_text())["problems"] == []
        v = {m: statistics.median(x) for m, x in runs.items()}
        res["verify"], res["verify_runs"] = v, runs
        print(f"  verify: {v} (CLI start-up {startup:.2f} s); {uptime()}", flush=True)

        # plan from counts
        res["plan_counts_s"] = statistics.median(
            timed([draftlab, "plan", "--samples", str(REF_FILES), "--tokens", str(REF_TOKENS), "--hidden-size",
                   "7168", "--tokens-per-s", "13200", "--at-gpus", "4", "--extract-tokens-per-s", "2600",
                   "--gpus", "4,8", "--json"], repo) for _ in range(2))
        print(f"  plan from counts: {res['plan_counts_s']:.2f} s", flush=True)

        # DVC
        timed([git, "init", "-q"], repo, env)
        timed([dvc, "init", "-q"], repo, env)
        (repo / ".dvc" / "config").write_text('[core]\n    analytics = false\n[cache]\n    type = "hardlink,symlink"\n')
        (repo / "dvc.yaml").write_text(DVC_YAML)
        (repo / ".gitignore").write_text("/data/prepared\n")
        d = {"startup": statistics.median(timed([dvc, "version"], repo, env) for _ in range(3))}
        d["commit"] = timed([dvc, "commit", "-f", "-q", "extract"], repo, env)
        timed([git, "add", "-A"], repo, env)
        timed([git, "commit", "-q", "-m", "store A"], repo, env)
        timed([dvc, "status", "-q"], repo, env)  # the state database of every file is warm from here
        d["status"] = statistics.median(timed([dvc, "status", "-q"], repo, env) for _ in range(3))
        print(f"  dvc commit {d['commit']:.1f} s, status (unchanged) {d['status']:.1f} s; {uptime()}", flush=True)
        remote = work / "remote"
        timed([dvc, "remote", "add", "-q", "-d", "local", str(remote)], repo, env)
        timed([git, "commit", "-q", "-am", "remote"], repo, env)
        d["push"] = timed([dvc, "push", "-q"], repo, env)
        clone = work / "clone"
        timed([git, "clone", "-q", str(repo), str(clone)], work, env)
        d["pull"] = timed([dvc, "pull", "-q"], clone, env)
        print(f"  dvc push {d['push']:.1f} s, pull into a fresh clone {d['pull']:.1f} s; {uptime()}", flush=True)
        shutil.rmtree(clone)
        # a params flip: another store B (every file differs, as a new key makes it), committed
        raw["extract"]["batch_tokens"] = raw["extract"]["batch_tokens"] + 1
        (repo / "params.yaml").write_text(yaml.safe_dump(raw))
        shutil.rmtree(store_dir)
        w2 = write_store(store_dir, lengths, args.hidden, "b" * 64, seed=1, batch_tokens=args.batch_tokens)
        c2, files2 = manifest_of(params, w2["journal"], lengths, args.hidden, "b" * 64)
        write_manifest(store_dir, params, c2, key="b" * 64, files=files2)
        timed([dvc, "commit", "-f", "-q", "extract"], repo, env)
        timed([git, "commit", "-q", "-am", "store B"], repo, env)
        timed([git, "checkout", "-q", "HEAD~2", "--", "dvc.lock", "params.yaml"], repo, env)
        d["checkout_flip"] = timed([dvc, "checkout", "-q"], repo, env)
        assert json.loads((store_dir / "manifest.json").read_text())["key"] == key
        timed([git, "checkout", "-q", "HEAD", "--", "dvc.lock", "params.yaml"], repo, env)
        d["checkout_back"] = timed([dvc, "checkout", "-q"], repo, env)
        assert json.loads((store_dir / "manifest.json").read_text())["key"] == "b" * 64
        res["dvc"] = d
        print(f"  dvc checkout after the flip {d['checkout_flip']:.1f} s, back {d['checkout_back']:.1f} s; {uptime()}",
              flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["rates"] = {"sha256_one_core_b_s": one_core_rate("sha256"), "md5_one_core_b_s": one_core_rate("md5")}
    res["machine"] = machine()
    res["projection"] = project_store(res, args)
    return res


def project_store(res: dict, args) -> dict:
    """Each operation at the reference: start-up + files × per file + bytes / the host's rate."""
    n, nbytes = res["files"], res["bytes"]
    disk = args.ref_disk_gb_s * 1e9
    sha = min(disk, res["rates"]["sha256_one_core_b_s"])  # verify hashes on one thread
    md5 = min(disk, res["rates"]["md5_one_core_b_s"] * args.ref_cores)  # DVC hashes files in parallel
    copy = disk / 2  # read + write on one disk
    su, dsu = res["draftlab_startup_s"], res["dvc"]["startup"]

    def line(measured, startup, byte_rate=None, per_byte_here=None):
        per_file = max(measured - startup - (nbytes / per_byte_here if per_byte_here else 0), 0) / n
        ref = startup + REF_FILES * per_file + (REF_BYTES / byte_rate if byte_rate else 0)
        return {"measured_s": measured, "per_file_s": per_file, "reference_s": ref}

    here_sha, here_md5 = res["rates"]["sha256_one_core_b_s"], res["rates"]["md5_one_core_b_s"]
    v, d = res["verify"], res["dvc"]
    w = res["write"]
    # the writer's per-byte part (serialise, sha256, write) is extraction's own: only its per-file part counts
    writer = line(w["writer_s"], 0, None, here_sha / 2)
    tp = res["train_preflight"]
    out = {
        "extract writer (per file: atomic write + fsync)": writer,
        "extract journal (one fsync'd line per batch)": line(w["journal_s"], 0),
        "manifest write": line(res["manifest"]["write_s"], 0),
        "manifest read": line(res["manifest"]["read_s"], 0),
        "resume scan after a kill at 90 %": line(res["resume_scan"]["s"], 0),
        "draftlab verify --report (dvc repro)": line(v["report"], su),
        "draftlab verify --quick": line(v["quick"], su),
        "draftlab verify (full)": line(v["full"], su, sha, here_sha),
        "dvc commit": line(d["commit"], dsu, md5, here_md5 * min(os.cpu_count() or 1, 4)),
        "dvc status (unchanged)": line(d["status"], dsu),
        "dvc push (local remote)": line(d["push"], dsu, copy),
        "dvc pull (fresh clone)": line(d["pull"], dsu, copy),
        "dvc checkout (params flip)": line(d["checkout_flip"], dsu),
        "dvc checkout (back)": line(d["checkout_back"], dsu),
        # the run key hashes the dataset's Arrow files: that part scales with tokens, the rest with files
        "train preflight (to step one)": {**line(tp["total_s"] - tp["key_s"], 0),
                                          "measured_s": tp["total_s"]},
        "loader open (per file read)": {"measured_s": res["loader_open_s_per_file"] * n,
                                        "per_file_s": res["loader_open_s_per_file"],
                                        "reference_s": res["loader_open_s_per_file"] * REF_FILES},
        "plan from counts": {"measured_s": res["plan_counts_s"], "per_file_s": 0.0, "reference_s": res["plan_counts_s"]},
    }
    out["train preflight (to step one)"]["reference_s"] += tp["key_s"] * REF_TOKENS / res["tokens"]
    per_file_ops = ["extract writer (per file: atomic write + fsync)", "extract journal (one fsync'd line per batch)",
                    "manifest write", "draftlab verify --report (dvc repro)", "dvc status (unchanged)"]
    commit_per_file = dsu + REF_FILES * out["dvc commit"]["per_file_s"]
    total = sum(out[k]["reference_s"] for k in per_file_ops) + commit_per_file
    out["_per_file_total"] = {"ops": per_file_ops + ["dvc commit (per-file part)"], "reference_s": total,
                              "fraction_of_extraction": total / REF_EXTRACT_S}
    out["_host"] = {"cores": args.ref_cores, "disk_gb_s": args.ref_disk_gb_s,
                    "sha256_b_s": sha, "md5_b_s": md5, "copy_b_s": copy}
    return out


def report_store(res: dict) -> None:
    p = res["projection"]
    print(f"\nreference shape: {res['files']:,} files ({res['bytes'] / 1e6:.0f} MB here) → {REF_FILES:,} files, "
          f"{REF_BYTES / 2**40:.2f} TiB; host {p['_host']['cores']} cores, {p['_host']['disk_gb_s']:g} GB/s")
    print(f"{'operation':48} {'here s':>9} {'µs/file':>9} {'reference s':>12}")
    for name, v in p.items():
        if not name.startswith("_"):
            print(f"{name:48} {v['measured_s']:9.2f} {v['per_file_s'] * 1e6:9.1f} {v['reference_s']:12.1f}")
    t = p["_per_file_total"]
    print(f"RESULT per-file overheads at the reference: {t['reference_s']:.0f} s = {t['fraction_of_extraction']:.2%} "
          f"of the {REF_EXTRACT_S / 3600:.1f} h extraction (goal ≤ 1 %); dvc status "
          f"{p['dvc status (unchanged)']['reference_s']:.0f} s (goal ≤ 30); train preflight "
          f"{p['train preflight (to step one)']['reference_s']:.0f} s (goal ≤ 60); resume scan "
          f"{p['resume scan after a kill at 90 %']['reference_s']:.0f} s (goal ≤ 30)")
    if "fsync" in res:
        f = res["fsync"]
        print(f"the writer's per-file cost holds the disk's flush: write_bytes_atomic of a 5 kB file "
              f"{f['atomic_s'] * 1e3:.2f} ms (median), the same without fsync {f['no_fsync_s'] * 1e3:.2f} ms")
    print(f"machine at the end: {res['machine']}")


# ---------------------------------------------------------------- history


class TimedTracker:
    """The MLflow tracker the rank's batched writer sends to, with the writes' CPU per step: each
    batch's CPU is shared by the steps in it."""

    def __init__(self, inner, cpu_by_step: dict, sent: list | None):
        self.inner, self.cpu_by_step, self.sent = inner, cpu_by_step, sent
        self.cpu_total = 0.0  # the writes run inside the handler's emit: `drive` leaves them out of its count
        self.outages = 0
        self.failed_call_s_max = 0.0

    def log_metrics_many(self, records):
        t0 = time.thread_time()
        self.inner.log_metrics_many(records)
        spent = time.thread_time() - t0
        self.cpu_total += spent
        per = spent / max(len(records), 1)
        for _, step, _ in records:
            self.cpu_by_step[step] = self.cpu_by_step.get(step, 0.0) + per
        if self.sent is not None:
            self.sent.extend(records)

    def log_metrics(self, metrics, step=None):
        self.log_metrics_many([(metrics, step, int(time.time() * 1000))])


def speculators_record(step: int, epoch: int, ttt: int = 3):
    """A log record as speculators 0.9's trainer emits it to `speculators.metrics` each step."""
    import logging
    import math

    loss = [5.5 * math.exp(-step / 40_000) + 0.5 + 0.1 * k for k in range(ttt)]
    train = {"loss": sum(loss)}
    for k in range(ttt):
        train.update({f"loss_{k}": loss[k], f"full_acc_{k}": 0.5 - 0.1 * k, f"cond_acc_{k}": 0.6 - 0.1 * k})
    profile = {"fetch_ms": 1.0, "fwd_ms": 300.0, "bwd_ms": 350.0, "opt_ms": 50.0, "step_ms": 714.0,
               "tokens_per_s": 13_200.0, "fetch_frac": 0.01}
    rec = logging.LogRecord("speculators.metrics", logging.INFO, __file__, 0,
                            {"train": train, "profile": profile, "epoch": epoch, "lr": 1e-4, "global_step": step},
                            None, None)
    rec.step = step
    return rec


class Recorder:
    """A tracker that keeps what it is sent (the records an outage would spool)."""

    def __init__(self):
        self.sent: list = []

    def log_metrics_many(self, records):
        self.sent.extend(records)


def drive(handler, steps: int) -> list[float]:
    """Every step's speculators record through the rank's handler; its CPU per step, without the
    batched writes it makes once a second (a TimedTracker counts those per step)."""
    ends, epoch, cpu = set(handler.eta.ends), 0, []
    t0 = time.perf_counter()
    for step in range(steps):
        rec = speculators_record(step, epoch)
        timed = handler.tracker.tracker
        writes = getattr(timed, "cpu_total", 0.0)
        c = time.thread_time()
        handler.emit(rec)
        cpu.append(time.thread_time() - c - (getattr(timed, "cpu_total", 0.0) - writes))
        if step in ends:
            handler.tracker.drain()  # what the trainer's checkpoint hook does
            epoch += 1
        if step % 25_000 == 0:
            print(f"  step {step:,}: {time.perf_counter() - t0:.0f} s; {uptime()}", flush=True)
    handler.tracker.close()
    return cpu


def run_history(args) -> dict:
    from draftlab import threads, tracking
    from draftlab.rundir import RankPlan, RunDir, append_spool
    from draftlab.training import metrics as train_metrics
    from draftlab.training.rank import MetricsToTracker

    # the writer thread runs at nice 19 in a rank; here it would wait for the other tenants' CPU,
    # and only its CPU time is measured
    threads.yield_cpu = lambda: None
    work = Path(tempfile.mkdtemp(prefix="draftlab-refhistory-", dir=args.workdir))
    db = work / "mlflow.db"
    steps, epochs = args.steps, 5
    print(f"history: {steps:,} steps in {epochs} epochs through rank 0's writers; {work}", flush=True)
    print(f"machine: {machine()}", flush=True)
    res: dict = {"steps": steps}
    per_epoch = [steps // epochs + (1 if e < steps % epochs else 0) for e in range(epochs)]
    plan = RankPlan(total_steps=steps, step_tokens=[13_000] * steps, epoch_steps=per_epoch)
    importer = None
    try:
        # 1. what rank 0 sends, recorded: the spool of an outage that lasted the whole run
        (work / "dry").mkdir()
        rec = MetricsToTracker(Recorder(), plan, work / "dry")
        recorder = rec.tracker.tracker
        drive(rec, steps)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'import.db'}"
        client2 = tracking.client()
        run2 = client2.create_run(tracking.experiment_id(client2), run_name="imported").info.run_id
        spool = work / "tracking-spool.jsonl"
        t = time.perf_counter()
        for metrics, step, ts in recorder.sent:
            append_spool(spool, {"run_id": run2, "kind": "metrics", "metrics": metrics, "step": step, "timestamp": ts})
        res["spool_write_s"] = time.perf_counter() - t
        res["spool_records"] = len(recorder.sent)
        res["spool_bytes"] = spool.stat().st_size
        res["values_per_step"] = sum(len(m) for m, _, _ in recorder.sent) / steps
        del recorder.sent
        # 2. `draftlab tracking-import` of it, in its own process, while 3. runs
        import_started = time.perf_counter()
        importer = subprocess.Popen([exe("draftlab"), "tracking-import", str(spool)], cwd=work,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # the import's own end: communicate() below comes after the writers and the UI, and the
        # time up to it once passed for the import's (1,051 s "for 20 k records")
        import_done: list = []
        import_err: list = []

        def await_import(p=importer):
            import_err.append(p.stderr.read())
            p.wait()
            import_done.append(time.perf_counter())

        waiter = threading.Thread(target=await_import, daemon=True)
        waiter.start()
        print(f"  spool: {res['spool_records']:,} records ({res['spool_bytes'] / 1e6:.0f} MB) in "
              f"{res['spool_write_s']:.1f} s; importing; {uptime()}", flush=True)

        # 3. the real writers: metrics.jsonl and the batched MLflow writer into a sqlite store
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{db}"
        client = tracking.client()
        exp = tracking.experiment_id(client)
        run_id = client.create_run(exp, run_name="reference-history").info.run_id
        run_dir = work / "run"
        run_dir.mkdir()
        sender_cpu: dict[int, float] = {}
        handler = MetricsToTracker(tracking.MlflowTracker(run_id), plan, run_dir)
        handler.tracker.tracker = TimedTracker(handler.tracker.tracker, sender_cpu, None)
        t0 = time.perf_counter()
        emit_cpu = drive(handler, steps)
        res["write_wall_s"] = time.perf_counter() - t0
        res["mlflow_db_bytes"] = db.stat().st_size
        res["metrics_jsonl_bytes"] = RunDir(run_dir).step_metrics_path.stat().st_size

        def window(at: int, width: int = 1000) -> dict:
            lo = max(0, min(at, steps - width))
            hi = min(steps, lo + width)
            e = statistics.mean(emit_cpu[lo:hi])
            s = sum(sender_cpu.get(i, 0.0) for i in range(lo, hi)) / (hi - lo)
            return {"steps": [lo, hi], "emit_cpu_s": e, "sender_cpu_s": s, "total_cpu_s": e + s}

        c = res["cpu_per_step"] = {"at_1k": window(1000), "at_170k": window(170_000)}
        c["ratio_170k_over_1k"] = c["at_170k"]["total_cpu_s"] / c["at_1k"]["total_cpu_s"]
        c["mean_all"] = (sum(emit_cpu) + sum(sender_cpu.values())) / steps
        print(f"  written in {res['write_wall_s']:.0f} s; mlflow.db {res['mlflow_db_bytes'] / 1e6:.0f} MB; "
              f"CPU per step {c}; {uptime()}", flush=True)

        # 4. evaluate's reading of the curves (metrics.jsonl → train_loss.csv and the loss figure)
        from draftlab.stages import evaluate

        reports = work / "reports"
        reports.mkdir()
        res["evaluate_read_s"], curves = clock(lambda: train_metrics.read(run_dir), 1)
        assert len(curves) == steps
        t = time.perf_counter()
        evaluate._plots(run_dir, 3, {}, reports)
        res["evaluate_csv_s"] = time.perf_counter() - t
        t = time.perf_counter()
        evaluate._figures(run_dir, {}, 3, reports)
        res["evaluate_figures_s"] = time.perf_counter() - t
        print(f"  evaluate: read {res['evaluate_read_s']:.1f} s, train_loss.csv {res['evaluate_csv_s']:.1f} s, "
              f"figures {res['evaluate_figures_s']:.1f} s; {uptime()}", flush=True)

        # 5. the MLflow UI, beside a short run of the same store (the page's fixed cost)
        if args.ui:
            short = client.create_run(exp, run_name="short").info.run_id  # the same metrics, 100 steps
            (work / "short").mkdir()
            drive(MetricsToTracker(tracking.MlflowTracker(short), RankPlan(
                total_steps=100, step_tokens=[13_000] * 100, epoch_steps=[20] * 5), work / "short"), 100)
            res["ui"] = time_ui(db, exp, {f"{steps:,} steps": run_id, "100 steps": short}, work, args.ui_rounds)

        waiter.join()
        err = import_err[0] if import_err else ""
        res["import_s"] = import_done[0] - import_started
        if importer.returncode:
            raise SystemExit(f"tracking-import failed: {err[-2000:]}")
        importer = None
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'import.db'}"
        got = [m.step for m in tracking.client().get_metric_history(run2, "train/loss")]
        assert sorted(got) == list(range(steps)), "every step imported once"
        print(f"  tracking-import {res['import_s']:.0f} s (beside the writers above); {uptime()}", flush=True)
    finally:
        if importer is not None:
            importer.kill()
            importer.wait()
        shutil.rmtree(work, ignore_errors=True)
    res["machine"] = machine()
    return res


def time_ui(db: Path, experiment_id: str, runs: dict[str, str], work: Path, rounds: int = 2) -> dict:
    """`mlflow ui` on the store; headless Chromium opens each run's page, then its model-metrics
    tab, timed until the train/loss chart has drawn its line; runs interleaved, `rounds` times."""
    import socket
    import urllib.request

    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([exe("mlflow"), "ui", "--backend-store-uri", f"sqlite:///{db}", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1"], cwd=work, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    out: dict = {name: {"run_page_s": [], "chart_s": []} for name in runs}
    driver = None

    def drawn(d):
        return any(panel.find_elements(By.CSS_SELECTOR, ".scatterlayer path.js-line")
                   for panel in d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot"))

    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        opts = webdriver.ChromeOptions()
        for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1600,1000"):
            opts.add_argument(a)
        opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
        service = webdriver.ChromeService(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
        driver = webdriver.Chrome(options=opts, service=service)
        driver.get(f"http://127.0.0.1:{port}/")  # the UI's bundle, cached for what follows
        WebDriverWait(driver, 300).until(lambda d: "MLflow" in d.title or d.find_elements(By.ID, "root"))
        for r in range(rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                base = f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs/{runs[name]}"
                driver.get("about:blank")
                t = time.perf_counter()
                driver.get(base + "?workflowType=machine_learning")
                WebDriverWait(driver, 600, poll_frequency=0.2).until(lambda d: "train/loss" in d.page_source)
                out[name]["run_page_s"].append(time.perf_counter() - t)
                driver.get("about:blank")
                t = time.perf_counter()
                driver.get(base + "/model-metrics?workflowType=machine_learning")
                WebDriverWait(driver, 600, poll_frequency=0.2).until(drawn)
                out[name]["chart_s"].append(time.perf_counter() - t)
                print(f"  UI {name}: run page {out[name]['run_page_s'][-1]:.1f} s, chart "
                      f"{out[name]['chart_s'][-1]:.1f} s; {uptime()}", flush=True)
        out["chromium"] = driver.capabilities.get("browserVersion")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
    return out


def report_history(res: dict) -> None:
    c = res["cpu_per_step"]
    print(f"\nRESULT {res['steps']:,} steps: writers' CPU per step {c['at_1k']['total_cpu_s'] * 1e3:.2f} ms at "
          f"step {c['at_1k']['steps'][0]:,}, {c['at_170k']['total_cpu_s'] * 1e3:.2f} ms at step "
          f"{c['at_170k']['steps'][0]:,} (ratio {c['ratio_170k_over_1k']:.2f}; goal: no growth); mlflow.db "
          f"{res['mlflow_db_bytes'] / 1e6:.0f} MB ({res['mlflow_db_bytes'] / res['steps']:.0f} B/step); "
          f"metrics.jsonl {res['metrics_jsonl_bytes'] / 1e6:.0f} MB; tracking-import of {res['spool_records']:,} "
          f"records {res['import_s']:.0f} s; evaluate read {res['evaluate_read_s']:.1f} s"
          + "".join(f"; UI {name}: run page {statistics.median(v['run_page_s']):.1f} s, train/loss chart "
                    f"{statistics.median(v['chart_s']):.1f} s" for name, v in res.get("ui", {}).items()
                    if isinstance(v, dict)))
    print(f"machine at the end: {res['machine']}")


# ---------------------------------------------------------------- ranks


def run_ranks(args) -> dict:
    """tests/integration/test_train_ranks.py at `--world-size` ranks (the tiny pipeline built by
    its fixture): shards against speculators' sampler, kill -9 after the first checkpoint, resume."""
    env = {**os.environ, "DRAFTLAB_TEST_WORLD_SIZE": str(args.world_size)}
    print(f"ranks: {args.world_size} gloo ranks; machine: {machine()}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/integration/test_train_ranks.py"], cwd=REPO, env=env, capture_output=True, text=True)
    res = {"world_size": args.world_size, "passed": proc.returncode == 0, "wall_s": time.perf_counter() - t0,
           "machine": machine(), "tail": proc.stdout[-1500:]}
    print(proc.stdout[-1500:])
    print(f"RESULT {args.world_size} ranks: accounting, disjoint shards against speculators' sampler, kill -9 + "
          f"resume into one MLflow run with each step once: {'held' if res['passed'] else 'FAILED'} "
          f"({res['wall_s']:.0f} s, with the tiny pipeline's build)")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("store", help="37,312 files: DVC, verify, resume, manifest, preflight, plan")
    s.add_argument("--files", type=int, default=REF_FILES)
    s.add_argument("--token-scale", type=int, default=32, help="reference tokens per file divided by this")
    s.add_argument("--hidden", type=int, default=8, help="H of the generated files")
    s.add_argument("--batch-tokens", type=int, default=4096, help="extract.batch_tokens (journal lines)")
    s.add_argument("--world-size", type=int, default=4, help="ranks the preflight plans for (the reference: 4)")
    s.add_argument("--ref-cores", type=int, default=16)
    s.add_argument("--ref-disk-gb-s", type=float, default=2.0)
    s.add_argument("--workdir", type=Path, default=None)
    s.add_argument("--json", type=Path, default=None)
    s.add_argument("--from-json", type=Path, default=None, help="report a finished run's results again")
    h = sub.add_parser("history", help="177,230 steps through rank 0's writers, the spool, import, UI")
    h.add_argument("--steps", type=int, default=REF_STEPS)
    h.add_argument("--ui", action="store_true", help="also time the MLflow UI in headless Chromium")
    h.add_argument("--ui-rounds", type=int, default=2, help="interleaved UI repeats")
    h.add_argument("--workdir", type=Path, default=None)
    h.add_argument("--json", type=Path, default=None)
    r = sub.add_parser("ranks", help="the tiny pipeline at --world-size gloo ranks, kill -9, resume")
    r.add_argument("--world-size", type=int, default=8)
    r.add_argument("--workdir", type=Path, default=None)
    r.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.what == "store":
        if args.from_json:  # the projection and table again, from a run's results
            res = json.loads(args.from_json.read_text())
            res["projection"] = project_store(res, args)
            args.json = None
        else:
            res = run_store(args)
        report_store(res)
    elif args.what == "history":
        res = run_history(args)
        report_history(res)
    else:
        res = run_ranks(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(f"results → {args.json}")


if __name__ == "__main__":
    main()
