"""The typed params tree behind `params.yaml`, loaded once by every command.

Each section is a stage (`target`, `prepare`, `extract`, `train`, …) or shared (`data`).
Every field carries a description: that text is the params reference (`draftlab params`)
and the source of the one-line errors `load_params` raises as `ParamsError`.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from draftlab.errors import UserError
from draftlab.strict_yaml import DuplicateKey, UniqueKeyLoader

# `speculators train` flags draftlab sets itself from params and the stage's paths
# (draftlab.training.job.speculators_argv; a test keeps the two in step): train.extra_args may
# not give them (argparse keeps the last of two, so one there would silently win).
RESERVED_TRAIN_FLAGS = (
    "--verifier-name-or-path", "--data-path", "--hidden-states-path", "--hidden-states-backend", "--save-path",
    "--log-dir", "--epochs", "--lr", "--optimizer", "--scheduler-type", "--scheduler-warmup-steps",
    "--scheduler-total-steps", "--total-seq-len", "--num-workers", "--prefetch-factor", "--ttt-steps",
    "--draft-vocab-size", "--num-layers", "--seed", "--checkpoint-freq", "--train-data-ratio",
    "--hidden-states-dtype", "--target-layer-ids", "--d2t-path", "--t2d-path", "--on-missing", "--max-steps",
    "--fsdp-shard", "--vllm-endpoint",
)
# set only on a CPU run (speculators' GPU kernels have no CPU backward); a GPU run may choose them
CPU_TRAIN_FLAGS = ("--draft-attn-impl", "--loss-implementation")


def reserved_flag(args: list[str], reserved: tuple[str, ...] = RESERVED_TRAIN_FLAGS) -> tuple[str, str] | None:
    """(the argument as given, the flag it sets) for the first of `args` that would set one of
    `reserved` (`--flag`, `--flag=value`, or a prefix argparse expands to it), else None."""
    for arg in args:
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        hits = [f for f in reserved if f == name or (len(name) > 2 and f.startswith(name))]
        if hits:
            return arg, name if name in hits else hits[0]
    return None


PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class ParamsError(UserError, ValueError):
    """A user error in params: one line naming the dotted key and what to do."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyTarget(Section):
    """Architecture of the tiny Llama target the pipeline builds for itself."""

    hidden_size: PositiveInt = Field(64, description="Hidden size H of the tiny target.")
    num_layers: int = Field(
        8, ge=7, description="Decoder layers (≥ 7: the default aux ids [2, L//2, L-3] collide below)."
    )
    num_heads: PositiveInt = Field(
        2,
        description="Attention heads. The head size hidden_size / num_heads (32 by default) must be one "
        "vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512) for the "
        "suite's vLLM to serve the target.",
    )
    num_kv_heads: PositiveInt = Field(1, description="Key/value heads (GQA).")
    intermediate_size: PositiveInt = Field(192, description="MLP width.")
    max_position_embeddings: PositiveInt = Field(1024, description="Longest sequence the target accepts.")
    pretrain_steps: int = Field(
        300,
        ge=0,
        description="Optimizer steps of next-token training on the procedural corpus, so that the "
        "target's greedy continuations follow the data instead of collapsing into loops (0 = random init).",
    )
    pretrain_lr: PositiveFloat = Field(3e-3, description="AdamW learning rate of that pre-training.")
    pretrain_batch_size: PositiveInt = Field(16, description="Sequences per pre-training step.")
    seed: int = Field(0, description="Seed of the weights, the tokenizer corpus and pre-training.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyTarget:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        return self


class Target(Section):
    """The model the draft is trained for."""

    source: Literal["tiny", "local", "hub"] = Field(
        "tiny",
        description="`tiny`: the `target` stage builds a small Llama target (default, offline). "
        "`local`: `path` is an existing Hugging Face model folder. `hub`: `path` is a hub id "
        "(needs the hub or its cache on this host).",
    )
    path: str | None = Field(None, description="Model folder (local) or hub id (hub); unused for tiny.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the target runs in during extraction and evaluation."
    )
    revision: str | None = Field(
        None, description="Hub targets: the commit hash (40 hex digits) every load uses (transformers, vLLM, "
        "the trainer's verifier) and the store's and run's keys include; required with trust_remote_code "
        "before anything loads, since that code would otherwise be the hub's current one at every load.")
    trust_remote_code: StrictBool = Field(False, description="Pass trust_remote_code to transformers (a hub "
                                          "target needs target.revision with it).")
    tiny: TinyTarget = Field(default_factory=TinyTarget, description="Used when source is `tiny`.")

    @model_validator(mode="after")
    def _path_for_real_targets(self) -> Target:
        if self.source != "tiny" and not self.path:
            raise ValueError(f"a {self.source} target needs target.path")
        if self.revision is not None:
            if self.source != "hub":
                raise ValueError(f"revision: only a hub target has one (this one is {self.source}); remove it")
            if not re.fullmatch(r"[0-9a-f]{40}", self.revision):
                raise ValueError(f"revision: {self.revision!r} is not a commit hash (a branch or tag can move); "
                                 f"give the 40-hex commit from https://huggingface.co/{self.path}/commits/main")
        return self  # trust_remote_code without a revision: refused before any load (models.revision_kwargs)


class Data(Section):
    """Shared by prepare, train and evaluate."""

    train_ratio: float = Field(
        0.9,
        gt=0,
        lt=1,
        description="Fraction of rows in the train split. prepare writes rows shuffled by `seed` and "
        "speculators splits by row order with this same ratio (`--train-data-ratio`).",
    )
    seed: int = Field(0, description="Seed of the shuffle before the train/val split.")


class Prepare(Section):
    """Conversations → speculators' tokenized dataset (`input_ids`, `loss_mask`, `seq_len`)."""

    source: Literal["procedural", "jsonl", "dataset"] = Field(
        "procedural",
        description="`procedural`: conversations generated by draftlab (default, offline). `jsonl`: "
        "OpenAI `messages` records at `path`. `dataset`: a `datasets.save_to_disk` folder at `path` "
        "with a `messages` column.",
    )
    path: str | None = Field(None, description="Input file/folder for `jsonl` or `dataset` sources.")
    num_samples: PositiveInt = Field(160, description="Conversations to generate (procedural source).")
    max_seq_len: PositiveInt = Field(256, description="Tokens per sample; longer samples are truncated.")
    on_error: Literal["fail", "skip"] = Field(
        "fail",
        description="A malformed record: `fail` stops with file:line; `skip` drops it and counts it.",
    )
    regenerate: StrictBool = Field(
        True,
        description="Replace assistant turns by the target's own greedy output, so the draft learns "
        "what the target will actually say at serving time.",
    )
    regenerate_backend: Literal["hf", "openai"] = Field(
        "hf", description="`hf`: generate in-process; `openai`: an OpenAI-compatible server (vLLM)."
    )
    regenerate_url: str | None = Field(
        None, description="Base URL of the OpenAI-compatible server when regenerate_backend is `openai`."
    )
    max_new_tokens: PositiveInt = Field(48, description="Longest regenerated assistant turn, in tokens.")
    batch_size: PositiveInt = Field(32, description="Conversations per regeneration batch.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the target runs for `hf` regeneration: `auto` = cuda when visible, else cpu. On cuda it "
        "computes under bf16 autocast; the resolved device and compute dtype are recorded in prepare.json."
    )


class Extract(Section):
    """Target hidden states → `hs_<i>.safetensors` files in speculators' layout."""

    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="`hf`: transformers forward passes here (CPU or GPU). `vllm`: speculators' "
        "`generate-offline-data` against a vLLM server (a GPU host: upstream's connector; a CPU host: "
        "draftlab's synchronous one, with vLLM's CPU build).",
    )
    layer_ids: list[int] | None = Field(
        None,
        description="Exactly 3 auxiliary layer ids; null = speculators' default [2, L//2, L-3]. "
        "The final layer (before the final norm) is always appended.",
    )
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = Field(
        "bfloat16",
        description="dtype of the stored hidden states. `float8_e4m3fn`: half the bytes of bfloat16, "
        "one fp32 scale per token (hs_connectors' fp8 layout); train reads it with speculators' "
        "`--hidden-states-backend fp8`, which dequantizes to bfloat16.",
    )
    batch_tokens: PositiveInt = Field(
        4096, description="Tokens per forward pass (samples are batched in index order up to this)."
    )
    vllm_url: str | None = Field(
        None, description="vLLM endpoint for the `vllm` backend; null = draftlab starts the server itself."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the target runs (`hf` backend): `auto` = cuda when visible, else cpu. On cuda it "
        "computes under bf16 autocast; the resolved device and compute dtype are recorded in the store's manifest and key."
    )
    processes: PositiveInt | None = Field(
        None,
        description="Data-parallel extraction processes (`hf` backend), each a disjoint set of batches, "
        "one store and manifest identical to a 1-process run; null = one per visible GPU (1 on CPU). A "
        "target too large for one GPU runs in one process spread over all GPUs (device_map) instead.",
    )
    vllm_gpus: list[int] | None = Field(
        None, description="CUDA devices of the vLLM server draftlab starts; null = all visible."
    )
    vllm_tensor_parallel_size: PositiveInt = Field(1, description="vLLM --tensor-parallel-size of that server.")
    vllm_port: PositiveInt | None = Field(
        None, description="Port of the vLLM extraction server draftlab starts; null = a free port chosen at start."
    )
    vllm_gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM --gpu-memory-utilization.")
    vllm_startup_timeout_s: PositiveFloat = Field(
        1800, description="Seconds to wait for the vLLM extraction server's /health."
    )
    min_free_disk_frac: float = Field(
        0.05, ge=0, lt=1, description="Refuse to start if the store would leave less than this free."
    )
    dvc_track: Literal["files", "manifest"] = Field(
        "files",
        description="What DVC versions of the store. `files`: the whole store folder is extract's DVC output "
        "(md5 of every file, hardlinked into the cache; push/pull/checkout/gc move and restore stores). "
        "`manifest`: only its manifest.json (no cache), DVC never reads the store's files: for hosts where "
        "hashing a new store costs too much; move the files yourself, `draftlab verify` checks them. Change it "
        "with `draftlab dvc-track MODE`, which keeps dvc.yaml's extract outputs in step.",
    )

    @field_validator("layer_ids")
    @classmethod
    def _three_layers(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None:
            if len(ids) != 3:
                raise ValueError("needs exactly 3 ids (a 4th crashes vLLM's EAGLE-3 loader)")
            if len(set(ids)) != 3 or min(ids) < 0:
                raise ValueError("needs 3 distinct non-negative ids")
        return ids


class Watch(Section):
    """The convergence watch of a training (draftlab.training.watch): NaN/inf and the loss trend."""

    window_steps: PositiveInt | None = Field(
        None, description="Steps in each window the trend compares: the early window right after warm-up "
        "(train.warmup_steps) and the latest one at each check, every window_steps steps. "
        "null = 1 % of the run's steps, at least 5 and at most 500.")
    stall_frac: PositiveFloat = Field(
        0.02, description="A loss (median of a window) fallen below its early window's by more than this "
        "fraction and more than the noise (2.5 standard errors of the difference of the two medians) is "
        "`learning`; one shown, within its noise, to fall by less than this fraction (first half of the steps "
        "since warm-up against the second) is `stalled` (lr 0, frozen weights); neither shown is `cannot tell "
        "yet`, which stops nothing.")
    diverge_frac: PositiveFloat = Field(
        0.10, description="A loss that has risen above its early window's by more than this fraction, and "
        "more than the noise, is `diverging`.")
    stop_on: list[Literal["stalled", "diverging"]] = Field(
        default_factory=list, description="Trends that also stop the run (exit 5, tag draftlab.convergence). "
        "A NaN or inf loss always stops it (exit 3). A sweep's trials stop on both, so their budget goes to others.")


class Train(Section):
    """Draft training with speculators' trainer under torchrun (see README: step accounting)."""

    gpus: PositiveInt = Field(
        1, description="Training processes per node (GPUs on a GPU host; gloo ranks on CPU)."
    )
    nnodes: PositiveInt = Field(1, description="Nodes (multi-node: every node runs `draftlab train` on the "
                                "same shared run folder, with its own node_rank).")
    node_rank: int = Field(0, ge=0, description="This node's rank (multi-node). Node 0 owns the job: its launcher "
                           "opens the one MLflow run, computes and checks the accounting and hosts the rendezvous.")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of the c10d rendezvous, on node 0 (multi-node); null = standalone on this host."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto`: cuda if available, else cpu.")
    sharding: Literal["ddp", "fsdp"] = Field(
        "ddp", description="`ddp`: replicated parameters; `fsdp`: FSDP2 parameter sharding (speculators --fsdp-shard)."
    )
    epochs: PositiveInt = Field(3, description="Training epochs.")
    max_steps: PositiveInt | None = Field(
        None, description="Stop after this many global steps (speculators --max-steps): a calibration run, "
        "timing only (tagged draftlab.calibration; evaluate says so, export refuses it). With epochs: 2 it "
        "times one epoch boundary; each epoch after the limit still trains one step (draftlab.training.compat)."
    )
    lr: float = Field(
        3e-3, ge=0, description="Base learning rate at `lr_base_gpus` data-parallel ranks (before scaling); "
        "0 trains nothing (the convergence watch reports it `stalled`)."
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none",
        description="How lr follows the data-parallel world size W: none; linear (lr × W / base); "
        "sqrt (lr × sqrt(W / base)). The resolved lr is printed and logged.",
    )
    lr_base_gpus: PositiveInt = Field(1, description="World size at which `lr` was tuned.")
    total_seq_len: PositiveInt = Field(
        1024,
        description="Packing length: each rank's step is ONE row of up to this many tokens "
        "(speculators' batch_size = 1), so a global step holds world_size × total_seq_len tokens.",
    )
    num_workers: int = Field(0, ge=0, description="DataLoader workers per rank (0 = load in the rank).")
    prefetch_factor: PositiveInt = Field(4, description="Batches prefetched per worker.")
    optimizer: Literal["adamw", "muon"] = Field("adamw", description="speculators optimizer.")
    scheduler: Literal["linear", "cosine", "none"] = Field("cosine", description="LR schedule.")
    warmup_steps: int = Field(0, ge=0, description="LR warm-up steps.")
    ttt_steps: PositiveInt = Field(3, description="Test-time-training unroll steps (= num_speculative_tokens).")
    draft_vocab_size: PositiveInt = Field(256, description="Draft vocabulary (most frequent target tokens).")
    draft_layers: PositiveInt = Field(1, description="Decoder layers of the draft.")
    seed: int = Field(0, description="Seed of the draft init and the packing sampler's shuffle.")
    checkpoint_freq: PositiveFloat = Field(
        1.0, description="Checkpoint every N epochs (< 1: sub-epoch checkpoints, e.g. 0.5)."
    )
    hidden_states_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype the trainer loads hidden states in (the store's dtype)."
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More `speculators train` flags, passed through verbatim; a flag "
        "draftlab sets itself (paths, epochs, lr, seed, layer ids, …) is refused."
    )
    source: Literal["store", "vllm"] = Field(
        "store",
        description="Where the trainer's hidden states come from. `store`: the extract stage's store on disk "
        "(`--store`). `vllm` (online): a running vLLM computes each sample's hidden states when a rank's loader "
        "asks for it (speculators' `--on-missing generate`); no store is written or read. The server is "
        "draftlab's own (started and stopped with the training, configured as extraction's: extract.layer_ids, "
        "extract.vllm_*), or the one at `train.vllm_url`. `dvc.yaml`'s `train_online` stage is this mode.",
    )
    vllm_url: str | None = Field(
        None,
        description="With `source: vllm`: the OpenAI endpoint (`http://host:port/v1`) of a vLLM already serving "
        "the target for hidden-state extraction (the `extract_hidden_states` speculative config and a hidden-state "
        "connector writing where this host reads); null = draftlab starts its own.",
    )
    verify_reads: Literal["sha256", "header"] = Field(
        "sha256",
        description="What the training loader checks of each hidden-state file it reads against the "
        "store's manifest: `sha256` (size, header and content hash; README: loader verification) or "
        "`header` (size and header only). The first bad file stops the run, named.",
    )
    watch: Watch = Field(default_factory=Watch, description="The convergence watch: a NaN/inf loss stops the "
                         "run; after warm-up each TTT position's loss trend is `learning`, `stalled` or `diverging`.")

    @field_validator("extra_args")
    @classmethod
    def _not_draftlab_flags(cls, args: list[str]) -> list[str]:
        if hit := reserved_flag(args):
            given, flag = hit
            raise ValueError(f"{given} sets {flag}, which draftlab sets itself from params and the stage's "
                             "paths; remove it (set the matching params key instead)")
        return args

    @model_validator(mode="after")
    def _nodes(self) -> Train:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is not below nnodes {self.nnodes} (nodes are 0..{self.nnodes - 1})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes {self.nnodes} needs rdzv_endpoint: host:port on node 0, the same on every node")
        return self

    @model_validator(mode="after")
    def _online(self) -> Train:
        if self.source == "vllm" and self.nnodes > 1:
            raise ValueError(f"source: vllm trains on one node (the server's connector writes files the ranks read "
                             f"on its host); nnodes is {self.nnodes}: set nnodes: 1 or source: store")
        if self.vllm_url is not None:
            if self.source != "vllm":
                raise ValueError(f"vllm_url is set ({self.vllm_url}) but source is {self.source!r}: set source: vllm "
                                 "to train from that server, or remove vllm_url")
            if not re.match(r"^https?://[^/\s]+(/\S*)?$", self.vllm_url):
                raise ValueError(f"vllm_url: {self.vllm_url!r} is not an http(s) URL; give the server's OpenAI "
                                 "endpoint, e.g. http://127.0.0.1:8000/v1")
        return self

    def world_size(self) -> int:
        return self.gpus * self.nnodes

    def resolved_lr(self) -> float:
        ratio = self.world_size() / self.lr_base_gpus
        return {"none": 1.0, "linear": ratio, "sqrt": ratio**0.5}[self.lr_scaling] * self.lr


class Evaluate(Section):
    """Predicted (validation) and measured (speculative decoding) acceptance length."""

    backend: Literal["hf", "vllm"] = Field(
        "hf", description="`hf`: speculative decoding here with Hugging Face models (any device); "
        "`vllm`: the same, then vLLM serves the exported draft and the target alone on the same prompts and its "
        "figures (eval/vllm_*) are set beside draftlab's; wherever vLLM runs (the GPU image, or .venv-vllm on an "
        "x86 CPU with AVX2: scripts/install-vllm.sh)."
    )
    num_prompts: PositiveInt = Field(16, description="Held-out (val split) prompts decoded for the measured figure.")
    max_new_tokens: PositiveInt = Field(48, description="Tokens generated per prompt.")
    num_speculative_tokens: int | None = Field(
        None, ge=1, description="Draft tokens proposed per target forward; null = train.ttt_steps."
    )
    vllm_port: PositiveInt | None = Field(
        None, description="Port of the vLLM servers the vllm backend starts; null = a free port chosen at start."
    )
    vllm_gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM --gpu-memory-utilization.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the target runs for the `hf` backend: `auto` = cuda when visible, else cpu. On cuda it "
        "computes under bf16 autocast; the resolved device and compute dtype are recorded in the MLflow run's params."
    )


class Export(Section):
    """The served draft folder."""

    verifier_path: str | None = Field(
        None, description="The target's path or hub id on the serving host, written into the draft's "
        "config; null = the hub id (hub targets) or this host's absolute target path."
    )
    registered_model: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$",
        description="The MLflow registered model each export adds a version to (letters, digits, `.`, `_`, "
        "`-`); null = `<target>-eagle3` (`tiny-eagle3` for the tiny default, the last part of the path or hub "
        "id otherwise). A sweep's best trial's version gets the alias `best-<study>`."
    )


class Params(Section):
    """The whole params.yaml."""

    target: Target = Field(default_factory=Target, description="The target model.")
    data: Data = Field(default_factory=Data, description="Split shared by all stages.")
    prepare: Prepare = Field(default_factory=Prepare, description="The prepare stage.")
    extract: Extract = Field(default_factory=Extract, description="The extract stage.")
    train: Train = Field(default_factory=Train, description="The train stage.")
    evaluate: Evaluate = Field(default_factory=Evaluate, description="The evaluate stage.")
    export: Export = Field(default_factory=Export, description="The export stage.")

    def with_paths_from(self, root: Path) -> Params:
        """These params with each relative path (a local target.path, prepare.path) made absolute
        against `root`: the one rule for paths in a params file is that they are relative to it."""

        def absolute(path: str) -> str:
            return str((Path(root) / Path(path).expanduser()).resolve())

        target, prepare = self.target, self.prepare
        if target.source == "local" and target.path:
            target = target.model_copy(update={"path": absolute(target.path)})
        if prepare.source != "procedural" and prepare.path:
            prepare = prepare.model_copy(update={"path": absolute(prepare.path)})
        return self.model_copy(update={"target": target, "prepare": prepare})

    def check_paths(self, root: Path) -> None:
        """Checks that need the filesystem (kept out of field validation so that tests and
        `plan` can build params for hosts that do not exist here)."""
        if self.target.source == "local" and not (root / self.target.path).expanduser().exists():
            raise ParamsError(
                f"target.path: {self.target.path!r} does not exist; point it at a Hugging Face model "
                "folder, or set target.source: hub for a hub id"
            )
        if self.prepare.source != "procedural":
            if not self.prepare.path:
                raise ParamsError(f"prepare.path: required when prepare.source is {self.prepare.source!r}")
            if not (root / self.prepare.path).exists():
                raise ParamsError(f"prepare.path: {self.prepare.path!r} does not exist")


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_all_keys(ann, dotted + "."))
    return keys


def _one_line(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = re.sub(r"\.(\d+)", r"[\1]", ".".join(str(p) for p in first["loc"]))
    if first["type"] == "extra_forbidden":
        known = _all_keys(Params)
        close = difflib.get_close_matches(loc, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else "; remove it or check the params reference"
        return f"{source}: unknown key {loc!r}{hint}"
    got = first.get("input")
    if first["type"] == "bool_type" and isinstance(got, str):  # strict booleans: no "yes", "1", "on"
        return f"{source}: {loc}: {got!r} is a string, not a boolean; write true or false (unquoted)"
    got_s = "" if isinstance(got, dict) else f" (got {got!r})"
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return f"{source}: {loc or '<root>'}: {msg}{got_s}"


def parse_params(raw: dict[str, Any] | None, source: str = "params.yaml") -> Params:
    try:
        return Params.model_validate(raw or {})
    except ValidationError as err:
        raise ParamsError(_one_line(err, source)) from None


def load_params(path: str | Path = "params.yaml", *, root: Path | None = None, check_paths: bool = True) -> Params:
    """Read, validate and path-check a params file; raises ParamsError with one line. Relative
    paths in it are relative to its folder (or `root`) and come back absolute, so a copy of the
    params written elsewhere (a sweep trial's) still names the same files.
    check_paths=False: for `draftlab plan`, which plans data that is not there yet."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found; pass --params PATH")
    try:
        raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # noqa: S506 — a SafeLoader subclass
    except DuplicateKey as err:
        raise ParamsError(f"{path}:{err.line}: duplicated key {err.key!r} (the second value would "
                          "silently win); keep one") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ParamsError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not raw:
        raise ParamsError(f"{path}: empty params file; restore it (`git checkout {path}`) or "
                          "start from `draftlab use experiments/<profile>.yaml`")
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    params, root = parse_params(raw, str(path)), root if root is not None else path.resolve().parent
    if check_paths:
        params.check_paths(root)  # before they are made absolute: errors name the paths as written
    return params.with_paths_from(root)


def flatten(params: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Dotted-key view of the params (MLflow params, dvc.yaml dependency lists)."""
    out: dict[str, Any] = {}
    for name, value in params:
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def reference(model: type[BaseModel], prefix: str = "") -> str:
    """The params reference: one line per key with its default and description."""
    lines = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.append(f"{dotted}:  {field.description or ''}")
            lines.append(reference(ann, dotted + "."))
        else:
            default = field.get_default(call_default_factory=True)
            lines.append(f"  {dotted} = {default!r}  —  {field.description or ''}")
    return "\n".join(lines)


def merge(base: dict, overlay: dict) -> dict:
    """Deep-merge `overlay` into a copy of `base` (sections merge, values replace)."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
