"""Where a training or an evaluation reads its hidden states from: one interface, and the store.

    HiddenStateSource   what the trainer is told (its flags), what a rank installs before it
                        trains, the dataset an evaluation reads, what MLflow records of it, what
                        must run while it is read (`opened`: a server, or nothing), what its
                        loaders wait on when a run is data-bound (`describe_wait`, for the
                        bottleneck verdict)
    StoreSource         the store on disk (`draftlab.store.layout`): bf16/fp32 files, or fp8 with
                        per-token scales dequantized on read; every file checked against the
                        manifest before it is decoded (VerifiedTransfer)
    VllmSource          online: a live vLLM computes each sample's hidden states when a loader asks
                        (speculators' `--on-missing generate`: a max_tokens=1 completion whose
                        `kv_transfer_params` name the file its connector wrote, read once, then
                        deleted); draftlab's own server (`opened` starts and stops it, as
                        extraction's) or `train.vllm_url`. No store is written or read.
    source_for          the source params choose (`train.source`): the one place a source is chosen
    source_for_store    the source of a store folder (its manifest says the dtype)
    planned_source      the source `train.source` would read, named without starting or downloading
                        anything (the planner matches past runs by its `identity()`)
    source_from_trainer_args
                        the same source, rebuilt in a rank from the flags the launcher gave it
                        (so the store's path, or the server's endpoint, reaches the ranks once, in
                        speculators' own flags)

A new source is a new `HiddenStateSource` here and a branch of `source_for`: train, the ranks,
evaluate and the planner call only these methods. Nothing here imports torch, speculators or
hs_connectors at import time. (Over 400 lines on purpose: every source, and the store's verified
reader below, in the one module where hidden states are read.)

The reading itself: :class:`VerifiedTransfer` wraps the one place speculators reads a stored
sample (``train.data.ArrowDataset.transfer.get_cached``): each ``hs_<i>.safetensors`` is checked
against its manifest entry (size, header, sha256 of the bytes read) before it is decoded, and the
first bad file stops the rank with its name and the repair command (:class:`HiddenStateFileError`),
instead of a ``SafetensorError`` traceback or silent training on altered data.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from draftlab.pinned import check_speculators_version
from draftlab.store import layout as store

BACKEND_FLAG = "--hidden-states-backend"
PATH_FLAG = "--hidden-states-path"
ON_MISSING_FLAG = "--on-missing"
ENDPOINT_FLAG = "--vllm-endpoint"


def read_dtype(dtype: str) -> str:
    """The dtype speculators' reader hands the trainer: fp8 files are dequantized to bfloat16."""
    return "bfloat16" if dtype == store.FP8 else dtype


def backend(dtype: str) -> str:
    """speculators' `--hidden-states-backend` for a store of this dtype."""
    return "fp8" if dtype == store.FP8 else "file"


@dataclass(frozen=True)
class DataWait:
    """What a source's loaders wait on, when disk and CPU figures would misname it: the bottleneck
    verdict's data-bound label, why and remedy (`observe.bottleneck.classify`'s `wait`)."""

    label: str
    why: str
    remedy: str


class HiddenStateSource(ABC):
    """Where hidden states come from, as the trainer, a rank and an evaluation need to know it."""

    name: str  # `train.source`'s value: recorded on the run (param hidden_states.source)

    @property
    @abstractmethod
    def layer_ids(self) -> list[int]:
        """The target's 3 auxiliary layers these hidden states hold (the final layer follows them)."""

    @abstractmethod
    def identity(self) -> str:
        """sha256 of what these hidden states are: part of a training's run key, its MLflow tag
        `data.hidden_states_hash` and the cost model's match of past runs."""

    @property
    @abstractmethod
    def reads_from(self) -> Path:
        """The folder hidden-state files are read from (the telemetry's disk)."""

    def lineage(self) -> dict | None:
        """The source as an MLflow dataset input (name, sha, path, profile), or None."""
        return None

    def check(self) -> None:
        """What can be checked before anything is written or started (one line, exit 2, when wrong)."""

    def describe_wait(self) -> DataWait | None:
        """What a rank's loader waits on when the run is data-bound, as the bottleneck verdict
        names it (label, why, remedy), or None: reads from disk,
        judged by the disk's and the CPUs' figures (`data-bound (disk)` / `data-bound (CPU)`)."""
        return None

    @contextlib.contextmanager
    def opened(self, console) -> Iterator[HiddenStateSource]:
        """What must run while this source is read (a server), for the body of the `with`; yields
        the source to hand the trainer (its flags may name what was started). Stopped on every exit."""
        yield self

    @abstractmethod
    def trainer_args(self) -> list[str]:
        """speculators' `train` flags that name this source."""

    @abstractmethod
    def mlflow_params(self) -> dict[str, str]:
        """What the training run records of its source (MLflow params)."""

    @abstractmethod
    def install_in_rank(self, verify_reads: str) -> None:
        """In a rank, before the trainer builds its datasets: whatever reading through this
        source needs (the store: every file checked against its manifest)."""

    @abstractmethod
    def dataset(self, data_dir: Path, *, split: str, max_len: int, train_ratio: float, hidden_states_dtype: str):
        """speculators' own dataset (`ArrowDataset`) of one split, reading through this source."""


class StoreSource(HiddenStateSource):
    """The hidden-state store on disk, in the dtype its manifest records."""

    name = "store"

    def __init__(self, store_dir: Path, dtype: str | None = None):
        self.store_dir = Path(store_dir)
        self.dtype = dtype or store.read_manifest(self.store_dir).dtype

    @property
    def backend(self) -> str:
        return backend(self.dtype)

    @property
    def layer_ids(self) -> list[int]:
        return store.read_manifest(self.store_dir).layer_ids

    def identity(self) -> str:
        return store.manifest_hash(self.store_dir)

    @property
    def reads_from(self) -> Path:
        return self.store_dir

    def lineage(self) -> dict:
        manifest = store.read_manifest(self.store_dir)
        profile = {"manifest_sha256": self.identity(), "dtype": manifest.dtype, "layer_ids": manifest.layer_ids,
                   "files": manifest.num_files, "tokens": manifest.num_tokens, "bytes": manifest.total_bytes,
                   "target": manifest.target.path or manifest.target.source, "hidden_size": manifest.target.hidden_size}
        return {"name": "hidden-states", "sha": self.identity(), "path": self.store_dir, "profile": profile}

    def trainer_args(self) -> list[str]:
        return [PATH_FLAG, str(self.store_dir), BACKEND_FLAG, self.backend, ON_MISSING_FLAG, "raise"]

    def mlflow_params(self) -> dict[str, str]:
        return {"hidden_states.source": self.name, "store.dtype": self.dtype, "hidden_states_backend": self.backend}

    def install_in_rank(self, verify_reads: str) -> None:
        verify_hidden_state_reads(self.store_dir, full=verify_reads == "sha256")

    def transfer(self):
        """speculators' own reader for this store's dtype (fp8 is dequantized on read)."""
        import torch
        from hs_connectors import FileTransfer, FP8Transfer

        if self.dtype == store.FP8:
            return FP8Transfer(self.store_dir, dequantize_dtype=getattr(torch, read_dtype(store.FP8)))
        return FileTransfer(self.store_dir)

    def dataset(self, data_dir: Path, *, split: str, max_len: int, train_ratio: float, hidden_states_dtype: str):
        import torch

        check_speculators_version()
        from speculators.train.data import ArrowDataset

        return ArrowDataset(max_len=max_len, datapath=str(data_dir), transfer=self.transfer(), on_missing="raise",
                            train_ratio=train_ratio, split=split,
                            hidden_states_dtype=getattr(torch, hidden_states_dtype))


class VllmSource(HiddenStateSource):
    """Online: a live vLLM computes each sample's hidden states when a rank's loader asks for them
    (speculators' `ArrowDataset` with `on_missing="generate"`: nothing is cached, so every sample
    of every epoch is a `max_tokens: 1` completion; the file the connector writes is read once and
    deleted). `endpoint` None: draftlab's own server, started by `opened` with extraction's
    command (`store.vllm_extract`: the aux layers plus the last one, prefix caching off, the
    synchronous connector on a CPU host) on 127.0.0.1, under `draftlab.guard`, stopped on every
    exit path. `exchange_dir`: where that server's connector writes (empty while nothing is
    asked; the trainer's cache path, so no sample is ever found cached)."""

    name = "vllm"

    def __init__(self, *, model: str, layer_ids: list[int], exchange_dir: Path, endpoint: str | None = None,
                 dtype: str = "bfloat16", params=None, num_layers: int | None = None):
        self.model, self._layer_ids, self.exchange_dir = model, list(layer_ids), Path(exchange_dir)
        self.endpoint, self.dtype, self.params, self.num_layers = endpoint, dtype, params, num_layers

    @property
    def layer_ids(self) -> list[int]:
        return self._layer_ids

    def identity(self) -> str:
        # the endpoint is where, not what: a resumed run on a new port is the same run
        what = {"source": self.name, "model": self.model, "layer_ids": self._layer_ids, "dtype": self.dtype}
        if self.params is not None and self.params.target.revision:
            what["revision"] = self.params.target.revision
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()

    @property
    def reads_from(self) -> Path:
        return self.exchange_dir

    def lineage(self) -> dict:
        profile = {"source": self.name, "target": self.model, "layer_ids": self._layer_ids, "dtype": self.dtype,
                   "endpoint": self.endpoint or "draftlab's own vLLM server"}
        return {"name": "hidden-states.vllm", "sha": self.identity(), "path": self.exchange_dir, "profile": profile}

    def describe_wait(self) -> DataWait:
        return DataWait(
            "data-bound (vLLM)",
            "the loaders wait on the target's forward in vLLM (online source: every sample of every epoch is a "
            "completion), not on a disk or on decode",
            "raise train.num_workers (each worker keeps one sample's completion in flight, so vLLM batches more "
            "of them), give the server more or faster GPUs (or point train.vllm_url at one), or, when "
            "train.epochs > 1, extract once (extract.backend: vllm) and train from the store (train.source: "
            "store): `draftlab plan` prices both modes")

    def check(self) -> None:
        if self.endpoint is not None:  # a user's server: it answers and serves the target
            check_server(self.endpoint, self.model)

    @contextlib.contextmanager
    def opened(self, console) -> Iterator[HiddenStateSource]:
        if self.endpoint is not None:
            self.check()
            yield self
            return
        yield from _own_server(self, console)

    def trainer_args(self) -> list[str]:
        assert self.endpoint is not None, "an online source is handed to the trainer once opened"
        return [PATH_FLAG, str(self.exchange_dir), BACKEND_FLAG, "file", ON_MISSING_FLAG, "generate",
                ENDPOINT_FLAG, self.endpoint]

    def mlflow_params(self) -> dict[str, str]:
        return {"hidden_states.source": self.name, "hidden_states_backend": "file",
                "hidden_states.vllm_server": "user" if self.params is None or self.params.train.vllm_url else "draftlab"}

    def install_in_rank(self, verify_reads: str) -> None:
        """Nothing to check against: each sample is validated by speculators as it arrives (its
        tokens equal the sample's, every value finite)."""

    def dataset(self, data_dir: Path, *, split: str, max_len: int, train_ratio: float, hidden_states_dtype: str):
        import torch
        from hs_connectors import FileTransfer

        check_speculators_version()
        from speculators.train.data import ArrowDataset

        assert self.endpoint is not None, "an online source is read once opened"
        return ArrowDataset(max_len=max_len, datapath=str(data_dir), transfer=FileTransfer(self.exchange_dir),
                            vllm_endpoint=self.endpoint, on_missing="generate", model=self.model,
                            train_ratio=train_ratio, split=split, hidden_states_dtype=getattr(torch, hidden_states_dtype))


def check_server(endpoint: str, model: str, timeout_s: float = 10.0) -> None:
    """A user's server (`train.vllm_url`) answers `/models` and serves the target under the name the
    trainer asks for, or one line saying which, before any rank starts (speculators' loader would
    retry, then fail in every rank with a traceback)."""
    import json as json_
    import urllib.error
    import urllib.request

    from draftlab.errors import HostError
    from draftlab.params import ParamsError

    url = endpoint.rstrip("/") + "/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            served = [m.get("id") for m in json_.loads(r.read()).get("data", [])]
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise HostError(f"train.vllm_url: {url} does not answer ({reason}); start the vLLM server for hidden-state "
                        "extraction there, fix the URL, or set it to null (draftlab starts its own)") from None
    if model not in served:
        raise ParamsError(f"train.vllm_url: the server at {endpoint} serves {served}, not the target {model!r}; "
                          "start it with --model set to the target's path as this host names it")


def _own_server(source: VllmSource, console):
    """draftlab's vLLM server for `source`, as extraction starts it; yields the source with its endpoint."""
    import shutil

    from draftlab.params import ParamsError
    from draftlab.serve import serving
    from draftlab.serve.vllm_env import VllmMissing, vllm_python
    from draftlab.store import vllm_extract

    try:
        vllm_python()
    except VllmMissing as err:
        raise ParamsError(f"train.source: `vllm` asks draftlab to start a vLLM server: {err}; or set "
                          "train.vllm_url, or train.source: store") from None
    p = source.params
    # the server's connector writes what the trainer loads (the file transfer reads it as stored)
    p = p.model_copy(update={"extract": p.extract.model_copy(update={"dtype": source.dtype,
                                                                      "layer_ids": source.layer_ids})})
    python, gpus = vllm_extract.preflight(p)
    shared = source.exchange_dir
    shutil.rmtree(shared, ignore_errors=True)  # what a killed run left: files no loader will ask for
    shared.mkdir(parents=True)
    cmd = vllm_extract.server_command(p, python=python, model=source.model, num_layers=source.num_layers,
                                      hidden_states_path=shared, cuda=bool(gpus))
    where = f"GPU(s) {','.join(gpus)}" if gpus else "the CPU (draftlab's synchronous connector)"
    console.print(f"[bold]hidden states[/]: online, starting vLLM on {where}: " + " ".join(cmd), soft_wrap=True)
    try:
        with serving.running(vllm_extract.guard_command(cmd), port=p.extract.vllm_port,
                             log_path=shared.parent / f"{shared.name.removeprefix('.vllm-')}-vllm.log",
                             what="online hidden states", startup_timeout_s=p.extract.vllm_startup_timeout_s,
                             env=vllm_extract.server_env(gpus), port_key="extract.vllm_port", api_key=False) as server:
            yield VllmSource(model=source.model, layer_ids=source.layer_ids, exchange_dir=shared,
                             endpoint=f"{server.base_url}/v1", dtype=source.dtype, params=source.params,
                             num_layers=source.num_layers)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def exchange_dir(out_dir: Path) -> Path:
    """Where draftlab's online server writes for a stage writing `out_dir` (beside it)."""
    out_dir = Path(out_dir).absolute()  # the server and the ranks may not share a working directory
    return out_dir.parent / f".vllm-{out_dir.name}"


def source_for(params, *, store_dir: Path | None, target_dir: Path, out_dir: Path) -> HiddenStateSource:
    """The source `train.source` chooses for a stage writing `out_dir` (train, evaluate)."""
    if params.train.source == "store":
        if store_dir is None:
            from draftlab.params import ParamsError

            raise ParamsError("train.source: `store` reads the hidden-state store: give --store, or set "
                              "train.source: vllm")
        return StoreSource(store_dir)
    from transformers import AutoConfig

    from draftlab.models import resolve, revision_kwargs

    model = resolve(params, target_dir)
    config = AutoConfig.from_pretrained(model, **revision_kwargs(params))
    num_layers = getattr(config, "text_config", config).num_hidden_layers
    layer_ids = params.extract.layer_ids or store.default_layer_ids(num_layers)
    return VllmSource(model=model, layer_ids=layer_ids, exchange_dir=exchange_dir(out_dir),
                      endpoint=params.train.vllm_url, dtype=params.train.hidden_states_dtype, params=params,
                      num_layers=num_layers)


def planned_source(params, *, store_dir: Path, target_dir: Path, config: dict | None) -> HiddenStateSource | None:
    """The source a training with `params` would read, as `draftlab plan` can name it before anything
    runs (no server started, nothing downloaded): its `identity()` is the `data.hidden_states_hash`
    of the past runs that trained on the same hidden states. None when it cannot be named yet: no
    store of this target (`train.source: store`), or neither the target's config.json (`config`,
    as the planner found it) nor its built folder to count its layers (`train.source: vllm`)."""
    from draftlab.errors import MissingInput
    from draftlab.params import ParamsError

    if params.train.source == "store":
        if not store.has_manifest(store_dir):
            return None
        target = store.read_manifest(store_dir).target
        if target.path != params.target.path or target.source != params.target.source:
            return None  # another target's store: its runs price nothing here
        return StoreSource(store_dir)
    from draftlab.models import resolve

    try:
        model = resolve(params, target_dir)
    except (MissingInput, ParamsError):
        return None
    if params.target.source == "tiny":
        num_layers = params.target.tiny.num_layers
    else:
        text = (config or {}).get("text_config") or config or {}
        num_layers = text.get("num_hidden_layers")
        if not isinstance(num_layers, int):
            return None
    layer_ids = params.extract.layer_ids or store.default_layer_ids(num_layers)
    return VllmSource(model=model, layer_ids=layer_ids, exchange_dir=exchange_dir(Path(target_dir)),
                      endpoint=params.train.vllm_url, dtype=params.train.hidden_states_dtype, params=params,
                      num_layers=num_layers)


def source_for_store(store_dir: Path) -> HiddenStateSource:
    """The source that reads the store in `store_dir` (its manifest must exist)."""
    return StoreSource(store_dir)


def source_from_trainer_args(argv: Sequence[str]) -> HiddenStateSource | None:
    """The source a launcher named in a rank's speculators flags (None: the flags name none)."""
    argv = list(argv)
    if ENDPOINT_FLAG in argv:
        return VllmSource(model=argv[argv.index("--verifier-name-or-path") + 1] if "--verifier-name-or-path" in argv
                          else "", layer_ids=[], exchange_dir=Path(argv[argv.index(PATH_FLAG) + 1]),
                          endpoint=argv[argv.index(ENDPOINT_FLAG) + 1])
    if PATH_FLAG not in argv:
        return None
    store_dir = Path(argv[argv.index(PATH_FLAG) + 1])
    named = argv[argv.index(BACKEND_FLAG) + 1] if BACKEND_FLAG in argv else "file"
    return StoreSource(store_dir, dtype=store.FP8 if named == "fp8" else None)


def verify_hidden_state_reads(store_dir: Path, *, full: bool = True) -> None:
    """Make every ``ArrowDataset`` built from now on read through :class:`VerifiedTransfer`."""
    check_speculators_version()
    from speculators.train import data

    records = {f.index: f.model_dump() for f in store.read_manifest(store_dir).files}
    stock_init = data.ArrowDataset.__init__
    if getattr(stock_init, "_draftlab_verified", False):
        return

    def __init__(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        self.transfer = VerifiedTransfer(self.transfer, store_dir, records, full=full)

    __init__._draftlab_verified = True
    data.ArrowDataset.__init__ = __init__


class HiddenStateFileError(RuntimeError):
    """A stored hidden-state file disagrees with the store's manifest; the message names it."""


class VerifiedTransfer:
    """Wraps a hidden-states transfer: every file read is checked against the manifest first.

    For speculators' ``FileTransfer`` and hs_connectors' ``FP8Transfer`` the checked bytes are
    decoded in place (``read_file``: the hash and the tensors read one memory map of the file)
    and fp8 is dequantized by ``dequantize_fp8`` (bit-identical to ``FP8Transfer``'s, about a
    third of its CPU on one thread); another transfer is verified, then reads the file itself, and
    so does ``FileTransfer`` for a file already verified. A file whose size and mtime
    were already verified by this process is not re-hashed (epochs reread every file)."""

    def __init__(self, inner, store_dir: Path, records: dict[int, dict], *, full: bool = True):
        self.inner, self.store_dir, self.records, self.full = inner, Path(store_dir), records, full
        self.verified: dict[int, tuple[int, int]] = {}

    def __getattr__(self, name):  # setup(), delete(), get_generated() … stay the stock ones
        if name == "inner" or name.startswith("__"):  # unpickling in a loader worker looks up
            raise AttributeError(name)  # __setstate__ before `inner` exists
        return getattr(self.inner, name)

    def get_cached(self, file_idx: int):
        import hashlib

        from hs_connectors.transfer import FileTransfer, FP8Transfer

        path = self.store_dir / store.file_name(file_idx)
        rec = self.records.get(file_idx)
        if rec is None:
            raise HiddenStateFileError(f"{path}: not in {store.manifest_path(self.store_dir)}; {store.REPAIR}")
        try:
            st = path.stat()
        except FileNotFoundError:
            raise HiddenStateFileError(f"{path}: missing; {store.REPAIR}") from None
        known = self.verified.get(file_idx) == (st.st_size, st.st_mtime_ns)
        decodes = type(self.inner) in (FileTransfer, FP8Transfer)
        if known and type(self.inner) is not FP8Transfer:  # verified before: the stock (lazy) read
            return self.inner.get_cached(file_idx)
        buf = read_file(path)
        blob = memoryview(buf.numpy())
        problem = None
        if len(blob) != rec["bytes"]:
            problem = f"truncated or rewritten ({len(blob)} bytes, manifest says {rec['bytes']})"
        else:
            n = int.from_bytes(blob[:8], "little")
            problem = store.header_problem(path, rec, head=bytes(blob[: 8 + min(n, len(blob))]))
        if problem is None and self.full and not known and hashlib.sha256(blob).hexdigest() != rec["sha256"]:
            problem = "corrupt (sha256 differs from the manifest)"
        if problem:
            store.record_bad(self.store_dir, {path.name: problem})  # extract re-hashes it, whatever its mtime
            raise HiddenStateFileError(f"{path}: {problem}; {store.REPAIR}")
        self.verified[file_idx] = (st.st_size, st.st_mtime_ns)
        if not decodes:
            return self.inner.get_cached(file_idx)
        tensors = decode_safetensors(buf)
        if type(self.inner) is FP8Transfer and store.SCALES_KEY in tensors:
            import torch

            scales = tensors.pop(store.SCALES_KEY)
            want = getattr(self.inner, "dequantize_dtype", torch.bfloat16)
            tensors["hidden_states"] = dequantize_fp8(tensors["hidden_states"], scales, want)
        return tensors


def read_file(path: Path):
    """The whole file as a uint8 tensor over a private memory map of it: hashing and decoding
    read the page cache in place, and the collate's copy into the batch is the only copy (as
    with speculators' own lazy `safetensors` read). Copy-on-write, so the tensors are writable
    without ever writing the file."""
    import mmap

    import torch

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the map alive as long as a view


def decode_safetensors(buf) -> dict:
    """A safetensors file's tensors as views of `buf` (uint8, the whole file)."""
    import json

    import torch

    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    header = json.loads(buf[8 : 8 + n].numpy().tobytes())
    base, out = 8 + n, {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, store.SAFETENSORS_DTYPES[t["dtype"]])
        a, b = t["data_offsets"]
        raw = buf[base + a : base + b]
        size = torch.empty((), dtype=dtype).element_size()
        if (base + a) % size:  # view(dtype) needs an aligned offset; safetensors' writer aligns
            raw = raw.clone()
        out[name] = raw.view(dtype).view(t["shape"])
    return out


# elements per lookup chunk: small enough that a chunk's int32 indices stay in cache, large
# enough that each op's parallel region (torch's intra-op threads) is worth starting
_FP8_LUT_CHUNK = 1 << 22


def dequantize_fp8(fp8_TLH, scales_T11, dtype=None):
    """``hs_connectors.fp8_utils.dequantize_fp8_tensor`` (``fp8.to(dtype) * scale.to(dtype)``),
    bit for bit, for bf16: the 256 fp8 values' bf16 bits by table lookup, in token chunks, then
    one in-place multiply. torch 2.13's CPU fp8 → bf16 cast is scalar; this runs in the loader's
    workers on every file of every epoch. Other dtypes: the stock expression."""
    import torch

    dtype = dtype or torch.bfloat16
    if dtype != torch.bfloat16 or fp8_TLH.dtype != torch.float8_e4m3fn or fp8_TLH.dim() == 0:
        return fp8_TLH.to(dtype) * scales_T11.to(dtype)
    global _FP8_LUT
    if _FP8_LUT is None:
        _FP8_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16).view(torch.int16)
    rows = fp8_TLH.shape[0]
    per = fp8_TLH[0].numel() if rows else 0
    chunk = max(1, _FP8_LUT_CHUNK // max(per, 1))  # tokens per chunk
    src = fp8_TLH.contiguous().view(torch.uint8).view(rows, per)
    out = torch.empty((rows, per), dtype=torch.int16)
    idx = torch.empty(min(rows, chunk) * per, dtype=torch.int32)
    for a in range(0, rows, chunk):
        b = min(a + chunk, rows)
        i = idx[: (b - a) * per]
        i.copy_(src[a:b].reshape(-1))
        torch.index_select(_FP8_LUT, 0, i, out=out[a:b].view(-1))
    return out.view(torch.bfloat16).view(fp8_TLH.shape).mul_(scales_T11.to(torch.bfloat16))


_FP8_LUT = None


def clean_message(err: BaseException) -> str:
    """The one-line message of an error a DataLoader worker re-raised in the rank (torch puts
    the worker's traceback text in front of it)."""
    text = str(err).strip().splitlines()
    last = text[-1] if text else type(err).__name__
    marker = f"{type(err).__name__}: "
    return last.split(marker, 1)[1] if marker in last else last
