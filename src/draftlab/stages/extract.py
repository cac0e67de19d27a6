"""The `extract` stage: the target's hidden states for every prepared sample, one
`hs_<i>.safetensors` per dataset row, exactly as speculators 0.9 reads them.

Auxiliary layer id k is the input of decoder layer k (vLLM's EAGLE-3 convention: the residual
stream after k layers); the 4th slot is the final layer's output *before* the final norm
(HF's last `output_hidden_states` entry is after it). Both are captured with forward
pre-hooks, so no other layer's states are kept in memory.

Resumable: batches are composed from sample lengths alone (index order, up to
`extract.batch_tokens` padded tokens), files are written atomically, and a batch counts as done
only once the journal says so — a kill -9 and a rerun give a byte-identical store.

Placement (`extract.device`, `draftlab.devices`): CUDA when visible, under bf16 autocast; every
visible GPU as a data-parallel rank (`draftlab.store.extract_ranks`), or one process spread over all of
them when the target does not fit one; the CPU path computes exactly as before.

Where: the store is written and kept in `store.work_dir(out)` (not a DVC output: DVC removes
its output before the stage runs), and published to `out`, the DVC output, as hardlinks of the
same files — no byte is copied, and DVC's cache then links the same inodes.

One extraction per store (draftlab.folder_lock, `data/.hidden_states.lock`): a second is refused
before it touches anything.

Refusals first (`check`: layer ids against the target's config.json, before any weight is
loaded or store moved); a store of other params is set aside under its key and brought back
when the params return; journaled files that fail verification are re-extracted, and only they
are rewritten (`drop_bad_files`).

    draftlab extract --params params.yaml --data data/prepared --out data/hidden_states
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import HostError, MissingInput
from draftlab.models import LayerCapture
from draftlab.params import Params, ParamsError
from draftlab.rundir import Manifest, StoreDir, TargetInfo
from draftlab.store import layout as store
from draftlab.store.capture import check_dtype, dataset_fingerprint, extract_batches, plan_batches, target_identity
from draftlab.util import sha256_file


@dataclass(frozen=True)
class ExtractResult:
    store_dir: Path
    num_files: int
    num_tokens: int
    total_bytes: int
    extracted_now: int
    tokens_per_s: float


def with_compute(key_fields: dict, placement) -> dict:
    """GPU (bf16 autocast) states differ from CPU ones: the key says which. A CPU key stays what
    it was before devices were recorded, so existing CPU stores still resume."""
    if placement is None or placement.device == "cpu":
        return key_fields
    return {**key_fields, "compute": placement.record()}


def _check_disk(out_dir: Path, need_bytes: int, min_free_frac: float) -> None:
    usage = shutil.disk_usage(out_dir)
    if need_bytes > usage.free - min_free_frac * usage.total:
        raise HostError(
            f"extract: the store needs {need_bytes / 2**30:.2f} GiB more but {out_dir} has "
            f"{usage.free / 2**30:.2f} GiB free (keeping {min_free_frac:.0%} spare); free space or move the store"
        )


@dataclass(frozen=True)
class Checked:
    """What `check` found from the target's config and the dataset, before anything is touched."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    layer_ids: list[int]
    key_fields: dict
    key: str
    placement: object = None  # devices.Placement (hf backend)
    processes: int = 1
    device_map: str | None = None


def resolve_layer_ids(asked: list[int] | None, num_layers: int) -> list[int]:
    """The aux layer ids for a target of `num_layers` layers, or a ParamsError naming the key."""
    ids = asked or store.default_layer_ids(num_layers)
    what = f"{ids}" if asked else f"the default [2, L//2, L-3] = {ids}"
    if max(ids) >= num_layers or min(ids) < 0:
        raise ParamsError(f"extract.layer_ids: {what} out of range for a target with {num_layers} layers; "
                          f"use ids in 0..{num_layers - 1}")
    if len(set(ids)) != 3:
        hint = f", e.g. [1, {num_layers // 2}, {num_layers - 2}]" if num_layers >= 4 else ""
        raise ParamsError(f"extract.layer_ids: {what} are not distinct for a target with {num_layers} layers; "
                          f"set 3 distinct ids in 0..{num_layers - 1}{hint}")
    return ids


def check(params: Params, *, target_dir: Path, data_dir: Path) -> Checked:
    """Every refusal extraction can make, from the target's config.json alone (no weights
    loaded, no store moved, no MLflow run): the layer ids, the store key."""
    from transformers import AutoConfig

    from draftlab.models import resolve, revision_kwargs

    placement, processes, device_map = None, 1, None
    if params.extract.backend == "hf":
        from draftlab.store.extract_ranks import plan_placement

        placement, processes, device_map = plan_placement(params, target_dir)  # cuda asked, GPUs visible
    elif not params.extract.vllm_url:
        from draftlab.store import vllm_extract

        vllm_extract.preflight(params)  # a GPU and a vllm executable to start the server with
    if not (Path(data_dir) / "dataset_info.json").exists():
        raise MissingInput(f"{data_dir}: no prepared dataset; run `dvc repro prepare`")
    cfg = AutoConfig.from_pretrained(resolve(params, target_dir), **revision_kwargs(params))
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layer_ids = resolve_layer_ids(params.extract.layer_ids, cfg.num_hidden_layers)
    key_fields = {
        "target": target_identity(params, target_dir),
        "layer_ids": layer_ids,
        "dtype": params.extract.dtype,
        "dataset": dataset_fingerprint(data_dir),
        "format": "speculators-0.9/hs_i.safetensors" + ("+fp8-per-token-scales" if params.extract.dtype == store.FP8 else ""),
    }
    key_fields = with_compute(key_fields, placement)
    if params.extract.backend == "vllm":  # another engine's numerics: never mixed with an hf store
        key_fields = {**key_fields, "compute": {"backend": "vllm", "server": params.extract.vllm_url or "draftlab"}}
    return Checked(cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, layer_ids, key_fields,
                   store.store_key(key_fields), placement, processes, device_map)


def open_store(out_dir: Path, key: str, console, named: Path | None = None) -> store.Journal:
    """The store's journal for `key`. A store of another key is set aside under its own key,
    never mixed in or deleted; one set aside earlier under `key` is brought back and reused.
    `named`: the store's published path, which names the set-aside folders."""
    named = named or out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return store.Journal.open(out_dir, key)
    except store.StaleStoreError as stale:
        aside, back = store.stale_dir(named, stale.old_key), store.stale_dir(named, key)
        console.print(f"[yellow]extract[/]: params changed; moving the old store aside to {aside} (delete it when not needed)")
        shutil.rmtree(aside, ignore_errors=True)
        out_dir.rename(aside)
        if back.is_dir():
            console.print(f"[green]extract[/]: reusing the store set aside for these params ({back})")
            back.rename(out_dir)
        else:
            out_dir.mkdir(parents=True)
        return store.Journal.open(out_dir, key)


def open_work(out_dir: Path, key: str, console) -> tuple[Path, store.Journal]:
    """The folder extraction writes and keeps (store.work_dir) and its journal. A store published
    at `out_dir` with no work folder (pulled by DVC, or an older layout) becomes the work folder."""
    work = store.work_dir(out_dir)
    if not work.exists() and StoreDir(out_dir).journal_path.exists():
        out_dir.rename(work)
    return work, open_store(work, key, console, named=out_dir)


def publish(work: Path, out_dir: Path, key: str, console) -> None:
    """`out_dir` becomes the finished store as hardlinks of `work`'s files (metadata only, at any
    size), swapped in by one rename. What was there is replaced if it was this store, else set aside."""
    tmp = out_dir.with_name(f".{out_dir.name}.publish-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in work.iterdir():
        if path.is_file() and ".tmp-" not in path.name:
            os.link(path, tmp / path.name)
    if out_dir.exists():
        journal = StoreDir(out_dir).journal_path
        old_key = json.loads(journal.read_text().splitlines()[0]).get("key") if journal.exists() else None
        aside = store.stale_dir(out_dir, old_key)
        if old_key == key or (old_key and aside.is_dir()):
            shutil.rmtree(out_dir)  # links of a store kept in full elsewhere (work, or its set-aside work)
        else:
            console.print(f"[yellow]extract[/]: moving the store published for other params aside to {aside}")
            out_dir.rename(aside)
    tmp.rename(out_dir)


def drop_bad_files(out_dir: Path, journal: store.Journal, console, published: Path | None = None) -> list[str]:
    """Repair: journaled files that fail verification are forgotten, so they are re-extracted.
    An untouched file (size and mtime as written) is trusted, unless a reader or `draftlab
    verify` recorded it bad (store.record_bad, here or in the `published` store): that one is
    re-hashed; a touched one is re-hashed too. The record is consumed here: what it names is
    either good or forgotten by the journal (so redone even after a kill)."""
    suspect = set(store.recorded_bad(out_dir)) | (set(store.recorded_bad(published)) if published else set())
    bad, restamped = {}, False
    for i, rec in journal.done.items():
        path = out_dir / rec["name"]
        problem = store.file_problem(path, rec, full=True, trust_stat=rec["name"] not in suspect)
        if problem:
            bad[i] = f"{path}: {problem}"
        elif rec.get("mtime_ns") != (mtime := path.stat().st_mtime_ns):
            rec["mtime_ns"], restamped = mtime, True  # re-hashed and good: not re-hashed next time
    for line in bad.values():
        console.print(f"[yellow]extract[/]: re-extracting {line}", soft_wrap=True)
    if bad or restamped:
        journal.forget(set(bad))
    store.clear_bad(out_dir)
    return sorted(bad.values())


def run(params: Params, *, target_dir: Path, data_dir: Path, out_dir: Path, tracker=None,
        checked: Checked | None = None) -> ExtractResult:
    """One extraction per store: its lock (beside `out_dir`, draftlab.folder_lock) is taken before
    the store, its work folder or their temporary files are moved, written or deleted; a second
    extract is refused in one line naming the first one's pid and host."""
    import errno

    from draftlab import folder_lock

    with folder_lock.hold(out_dir, "draftlab extract", reentrant=True):
        try:
            return _extract(params, target_dir=target_dir, data_dir=data_dir, out_dir=out_dir, tracker=tracker,
                            checked=checked)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # every batch the journal holds is kept; a torn file or journal line is dropped on the rerun
            raise HostError(f"extract: the disk of {out_dir} filled up ({err.filename or 'a store file'}); the "
                            "batches already journaled are kept: free space, then rerun `draftlab extract` "
                            "to resume") from None


def _extract(params: Params, *, target_dir: Path, data_dir: Path, out_dir: Path, tracker=None,
             checked: Checked | None = None) -> ExtractResult:
    from datasets import load_from_disk
    from rich.progress import Progress, TextColumn

    from draftlab.console import console, progress_columns
    from draftlab.models import load_target

    check_dtype(params.extract.dtype)
    c = checked or check(params, target_dir=target_dir, data_dir=data_dir)
    if params.extract.backend == "vllm":
        return _run_vllm(params, c, target_dir=target_dir, data_dir=data_dir, out_dir=out_dir, tracker=tracker)

    ds = load_from_disk(str(data_dir))
    seq_lens = list(ds["seq_len"])
    num_layers, hidden, layer_ids, key_fields, key = c.num_layers, c.hidden_size, c.layer_ids, c.key_fields, c.key
    dtype = params.extract.dtype
    work, journal = open_work(out_dir, key, console)
    written = {i: r["sha256"] for i, r in journal.done.items()}
    drop_bad_files(work, journal, console, published=out_dir)
    heal = {i: sha for i, sha in written.items() if i not in journal.done}

    for torn in work.glob(".hs_*.tmp-*"):  # a kill mid-write leaves these; never counted as done
        torn.unlink()
    batches = plan_batches(seq_lens, params.extract.batch_tokens)
    todo = [b for b in batches if not all(i in journal.done for i in b)]
    _check_disk(work, store.predicted_bytes([seq_lens[i] for b in todo for i in b], hidden, dtype),
                params.extract.min_free_disk_frac)

    from draftlab.observe import telemetry

    placement, processes = c.placement, c.processes
    model = None
    if todo and processes == 1:  # a store that is complete and verified needs no target at all
        model, _ = load_target(params, target_dir, device=placement.device, device_map=c.device_map)
    sampler = telemetry.TelemetrySampler(work, tracker).start() if tracker is not None and todo else None
    capture = LayerCapture(model, layer_ids) if model is not None else None
    done = frozenset(journal.done)  # files of a todo batch that are already good: kept, not rewritten
    remaining_tokens = sum(seq_lens[i] for b in todo for i in b if i not in done)
    started = time.perf_counter()
    done_tokens = 0
    console.print(
        f"[bold]extract[/]: {len(seq_lens)} samples, layers {layer_ids} + final (pre-norm), H={hidden}, "
        f"{dtype}; on {placement.device} ({placement.compute_dtype} compute"
        f"{', device_map over all GPUs' if c.device_map else ''}), {processes} process(es); "
        f"{len(batches) - len(todo)}/{len(batches)} batches already done"
    )
    try:
        with Progress(*progress_columns(TextColumn("{task.fields[rate]}")), console=console) as progress:
            task = progress.add_task("extracting", total=remaining_tokens, rate="")

            def on_done(records: list[dict]) -> None:
                nonlocal done_tokens
                journal.record(records)
                tokens = sum(r["tokens"] for r in records)
                done_tokens += tokens
                rate = done_tokens / max(time.perf_counter() - started, 1e-9)
                progress.update(task, advance=tokens, rate=f"{rate:,.0f} tok/s")

            if processes == 1:
                extract_batches(model, capture, ds, todo, work, dtype, placement, on_done, done, heal)
            elif todo:
                from draftlab.store.extract_ranks import run_ranks

                run_ranks(params, processes=processes, placement=placement, target_dir=target_dir,
                          data_dir=data_dir, out_dir=work, layer_ids=layer_ids, batches=todo, on_done=on_done,
                          done=done)
    finally:
        if capture is not None:
            capture.close()
        if sampler is not None:
            sampler.stop()

    files = [{k: v for k, v in journal.done[i].items() if k != "mtime_ns"} for i in range(len(seq_lens))]
    manifest = write_manifest(work, params, c, key=key, key_fields=key_fields, files=files,
                              compute=placement.record(), bytes_per_token_analytic=store.bytes_per_token(hidden, dtype))
    publish(work, out_dir, key, console)
    elapsed = time.perf_counter() - started
    tps = done_tokens / elapsed if done_tokens else 0.0
    if tracker is not None:
        tracker.log_metrics({"perf/extract_tokens_per_s": tps, "extract/num_tokens": manifest.num_tokens,
                             "extract/total_bytes": manifest.total_bytes})
        tracker.log_params({"extract.layer_ids": layer_ids, "extract.dtype": dtype,
                            "extract.resolved_device": placement.device,
                            "extract.compute_dtype": placement.compute_dtype, "extract.processes_used": processes})
        tracker.set_tags({"data.hidden_states_hash": store.manifest_hash(out_dir), "draftlab.stage": "extract"})
    console.print(
        f"[bold]extract[/]: {len(files)} files, {manifest.num_tokens:,} tokens, "
        f"{manifest.total_bytes / 2**20:.1f} MiB → {out_dir} "
        f"({done_tokens:,} tokens extracted now at {tps:,.0f} tok/s)"
    )
    return ExtractResult(out_dir, len(files), manifest.num_tokens, manifest.total_bytes, done_tokens, tps)


def write_manifest(store_dir: Path, params: Params, c: Checked, *, key: str, files: list[dict],
                   key_fields: dict | None = None, compute: dict | None = None,
                   bytes_per_token_analytic: int | None = None) -> Manifest:
    """The store's manifest, for either backend: written last, so its presence means complete.
    The model refuses what a reader could not use (no layer ids, not exactly 3)."""
    known = {"key_fields": key_fields, "compute": compute, "bytes_per_token_analytic": bytes_per_token_analytic}
    manifest = Manifest(
        key=key, layer_ids=c.layer_ids, dtype=params.extract.dtype, files=files, num_files=len(files),
        num_tokens=sum(f["tokens"] for f in files), total_bytes=sum(f["bytes"] for f in files),
        target=TargetInfo(path=params.target.path, source=params.target.source, num_layers=c.num_layers,
                          hidden_size=c.hidden_size, vocab_size=c.vocab_size),
        **{k: v for k, v in known.items() if v is not None})  # what a backend does not know is left out
    StoreDir(store_dir).manifest.write(manifest)
    return manifest


def _run_vllm(params: Params, c: Checked, *, target_dir: Path, data_dir: Path, out_dir: Path,
              tracker=None) -> ExtractResult:
    """The vllm backend, kept like the hf one: vLLM writes into the work folder (speculators'
    generator skips the readable files a killed run left), then every new file is checked,
    hashed and journaled, the manifest written and the store published. A journaled file that
    fails verification is deleted first, so the generator writes it again."""
    from datasets import load_from_disk

    from draftlab.console import console
    from draftlab.store import vllm_extract

    ds = load_from_disk(str(data_dir))
    seq_lens = [int(n) for n in ds["seq_len"]]
    work, journal = open_work(out_dir, c.key, console)
    before = set(journal.done)
    drop_bad_files(work, journal, console, published=out_dir)
    for i in before - set(journal.done):
        (work / store.file_name(i)).unlink(missing_ok=True)
    todo = [i for i in range(len(seq_lens)) if i not in journal.done]
    _check_disk(work, store.predicted_bytes([seq_lens[i] for i in todo], c.hidden_size, params.extract.dtype),
                params.extract.min_free_disk_frac)
    on_disk = {i for i in todo if (work / store.file_name(i)).exists()}  # a killed run's files: not redone
    startup_s, generate_s = (vllm_extract.run(params, target_dir=target_dir, data_dir=data_dir, out_dir=work)
                             if todo else (0.0, 0.0))
    if todo:
        journal.record([_vllm_record(params, c, work, i, ds[i]["input_ids"]) for i in todo])
    files = [{k: v for k, v in journal.done[i].items() if k != "mtime_ns"} for i in range(len(seq_lens))]
    manifest = write_manifest(work, params, c, key=c.key, key_fields=c.key_fields,
                              compute={"backend": "vllm", "server": params.extract.vllm_url or "draftlab"},
                              bytes_per_token_analytic=store.bytes_per_token(c.hidden_size, params.extract.dtype),
                              files=files)
    publish(work, out_dir, c.key, console)
    done_tokens = sum(seq_lens[i] for i in todo if i not in on_disk)
    tps = done_tokens / generate_s if done_tokens else 0.0  # the generation's rate; the server's start apart
    if tracker is not None:
        tracker.log_metrics({"perf/extract_tokens_per_s": tps, "extract/num_tokens": manifest.num_tokens,
                             "extract/total_bytes": manifest.total_bytes, "extract/vllm_startup_s": startup_s})
        tracker.log_params({"extract.layer_ids": c.layer_ids, "extract.dtype": params.extract.dtype,
                            "extract.backend": "vllm"})
        tracker.set_tags({"data.hidden_states_hash": store.manifest_hash(out_dir), "draftlab.stage": "extract"})
    console.print(
        f"[bold]extract[/]: {len(files)} files, {manifest.num_tokens:,} tokens, "
        f"{manifest.total_bytes / 2**20:.1f} MiB → {out_dir} through vLLM "
        f"({done_tokens:,} tokens extracted now at {tps:,.0f} tok/s; the server started in {startup_s:.0f} s)"
    )
    return ExtractResult(out_dir, len(files), manifest.num_tokens, manifest.total_bytes, done_tokens, tps)


def _vllm_record(params: Params, c: Checked, work: Path, i: int, input_ids) -> dict:
    """The journal record of the file vLLM wrote for row i, once it is shown to be what this
    store holds: the row's tokens, 4 layers of the target's width, `extract.dtype`, finite scales
    (a user's server keeps its own connector and model: draftlab cannot change them)."""
    import torch
    from safetensors import safe_open

    path = work / store.file_name(i)
    if not path.exists():
        raise MissingInput(f"{path}: speculators generate-offline-data did not write it")
    got = store.file_dtype(path)
    if got != params.extract.dtype:
        raise ParamsError(f"{path}: holds {got} hidden states but extract.dtype is {params.extract.dtype}; "
                          f"restart the vLLM server with the matching hs_connectors connector or set extract.dtype")
    with safe_open(path, "pt") as f:
        shape = f.get_slice("hidden_states").get_shape()
        token_ids = f.get_tensor("token_ids")
        scales_finite = store.SCALES_KEY not in f.keys() or bool(torch.isfinite(f.get_tensor(store.SCALES_KEY)).all())
    if shape[2] != c.hidden_size or shape[1] != 4:
        raise ParamsError(f"{path}: hidden states {shape}, the target's config.json says [T, 4, {c.hidden_size}]; "
                          "point extract.vllm_url at a server of this target (target.path)")
    if token_ids.tolist() != list(map(int, input_ids)) or shape[0] != len(token_ids) or not scales_finite:
        raise MissingInput(f"{path}: not the hidden states of row {i} of the dataset (other tokens, or non-finite "
                           "fp8 scales); delete it and rerun")
    return {"index": i, "name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path),
            "tokens": shape[0], "mtime_ns": path.stat().st_mtime_ns}
