"""Rules the container files must keep, as small checkers that return a list of problems.

Used by tests/unit/test_dockerfile.py, which runs each checker on the real Dockerfile,
.dockerignore, compose.yaml and requirements/, and on mutated copies to show it catches a break.
Each `check_*` takes file texts and returns human-readable problems; an empty list means clean.
The parsing is deliberately small: enough of Dockerfile, .dockerignore and compose syntax for the
files in this repository, not a general implementation. The module is longer than most because it
carries those three small parsers next to the rules that use them.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from urllib.parse import urlparse

import yaml

# Builds of these differ between the CPU environment and the GPU image by design, so the shared
# lock (requirements/common.txt) must not pin them.
ACCELERATOR_PACKAGES = {
    "torch", "torchvision", "torchaudio", "triton", "vllm", "flash-attn", "xformers",
    "flashinfer-python", "cuda-toolkit", "cuda-bindings",
}
ACCELERATOR_PATTERN = re.compile(r"^nvidia-.*-cu\d+$|^nvidia-(cublas|cuda-.*|cudnn.*|cufft|cufile|"
                                 r"curand|cusolver|cusparse.*|nccl.*|nvjitlink|nvshmem.*|nvtx)$")
# Packages whose version the Dockerfile owns because it builds them from source there.
SOURCE_BUILT = {"flash-attn"}
# ARG <NAME>_VERSION that must exist and equal the pin in requirements/gpu.txt.
REQUIRED_VERSION_ARGS = {"TORCH_VERSION": "torch", "VLLM_VERSION": "vllm"}
# What .dockerignore must keep out of the build context: a reason and a sample path for each.
REQUIRED_IGNORED = {
    "data/ (hidden-state stores, TiBs)": "data/prepared/data-00000-of-00001.arrow",
    ".dvc/cache": ".dvc/cache/files/md5/ab/cdef0123",
    ".dvc/tmp": ".dvc/tmp/rwlock",
    "mlflow.db": "mlflow.db",
    "mlruns/": "mlruns/0/meta.yaml",
    "mlartifacts/": "mlartifacts/1/artifacts/model.safetensors",
    ".venv": ".venv/bin/python",
    "a nested .venv": "tools/.venv/bin/python",
    "venv": "venv/bin/python",
    "reports/": "reports/metrics.json",
    "models/": "models/draft/model.safetensors",
    "checkpoints/": "checkpoints/epoch_0/model.safetensors",
    "__pycache__": "src/draftlab/__pycache__/cli.cpython-312.pyc",
    ".pytest_cache": ".pytest_cache/v/cache/nodeids",
    ".git": ".git/HEAD",
}


# ---- requirements files ----------------------------------------------------------------------

def canonical_name(name: str) -> str:
    """PEP 503 normalisation: `Flash_Attn` and `flash-attn` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(text: str) -> dict[str, str]:
    """`name==version` lines of a requirements file (options, comments and markers skipped)."""
    pins = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;]+)", line)
        if match:
            pins[canonical_name(match.group(1))] = match.group(3)
    return pins


def is_accelerator_package(name: str) -> bool:
    name = canonical_name(name)
    return name in ACCELERATOR_PACKAGES or bool(ACCELERATOR_PATTERN.match(name))


# ---- Dockerfile parsing ----------------------------------------------------------------------

@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, ARG, ...
    args: str  # the arguments, continuation lines joined with spaces
    line: int  # 1-based line of the keyword


@dataclass
class Stage:
    index: int
    image: str  # as written after FROM (an image reference or an earlier stage's name)
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    global_args: dict[str, str | None]  # ARGs before the first FROM
    stages: list[Stage]

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def parent(self, stage: Stage, args: dict[str, str] | None = None) -> Stage | None:
        """The earlier stage this one is built FROM, if any (`FROM ${IMAGE}-env` resolves with
        the global ARG defaults, overridden by `args` like --build-arg)."""
        image = substitute(stage.image, {**self.global_args, **(args or {})})
        earlier = [s for s in self.stages[: stage.index] if s.name == image]
        return earlier[-1] if earlier else None

    def chain(self, stage: Stage, args: dict[str, str] | None = None) -> list[Stage]:
        """The stage and its ancestors, nearest first."""
        out = [stage]
        while (parent := self.parent(out[-1], args)) is not None:
            out.append(parent)
        return out

    def root_image(self, stage: Stage, args: dict[str, str] | None = None) -> str:
        """The external image a stage finally starts from, global ARGs (and `args`) substituted."""
        return substitute(self.chain(stage, args)[-1].image, {**self.global_args, **(args or {})})

    def args_of(self, stage: Stage) -> dict[str, str | None]:
        """ARG values visible in a stage: its own ARGs, defaulting to the global ones."""
        values: dict[str, str | None] = {}
        for instruction in stage.instructions:
            if instruction.keyword == "ARG":
                for name, value in parse_arg(instruction.args).items():
                    values[name] = value if value is not None else self.global_args.get(name)
        return values

    def all_arg_defaults(self) -> dict[str, str]:
        """Every ARG default anywhere (global first, stage values override)."""
        values = {k: v for k, v in self.global_args.items() if v is not None}
        for stage in self.stages:
            values.update({k: v for k, v in self.args_of(stage).items() if v is not None})
        return values


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) per instruction: comments dropped, `\\` continuations joined."""
    out: list[tuple[int, str]] = []
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not buffer and (not stripped or stripped.startswith("#")):
            continue
        if buffer and stripped.startswith("#"):
            continue  # Docker drops comment lines inside a continued instruction
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer.append(stripped[:-1].strip())
            continue
        buffer.append(stripped)
        out.append((start, " ".join(part for part in buffer if part)))
        buffer = []
    if buffer:
        out.append((start, " ".join(buffer)))
    return out


def parse_arg(args: str) -> dict[str, str | None]:
    values: dict[str, str | None] = {}
    for token in shlex.split(args):
        name, sep, value = token.partition("=")
        values[name] = value if sep else None
    return values


def parse_dockerfile(text: str) -> Dockerfile:
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for line, content in logical_lines(text):
        keyword, _, args = content.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip(), line)
        if instruction.keyword == "FROM":
            tokens = [t for t in instruction.args.split() if not t.startswith("--")]
            name = tokens[2] if len(tokens) >= 3 and tokens[1].upper() == "AS" else None
            stages.append(Stage(len(stages), tokens[0] if tokens else "", name))
        elif not stages:
            if instruction.keyword == "ARG":
                global_args.update(parse_arg(instruction.args))
        else:
            stages[-1].instructions.append(instruction)
    return Dockerfile(global_args, stages)


def substitute(text: str, values: dict[str, str | None]) -> str:
    """Replace $NAME / ${NAME} / ${NAME:-default} with known values (unknown ones are kept)."""
    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        default = match.group(2)
        value = values.get(name)
        if value is not None:
            return value
        return default if default is not None else match.group(0)

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", replace, text)


def builder_stages(dockerfile: Dockerfile) -> list[Stage]:
    """Stages that build the flash-attn wheel."""
    return [
        stage for stage in dockerfile.stages
        if any(i.keyword == "RUN" and "pip wheel" in i.args for i in stage.instructions)
        and any("flash" in i.args.lower() for i in stage.instructions)
    ]


def declared_in_chain(dockerfile: Dockerfile, stage: Stage, name: str) -> bool:
    """Whether ARG/ENV `name` reaches the RUNs of a stage: an ARG in the stage or one it is built
    from, or an ENV there whose value uses only such ARGs (`ENV X=${X}` without `ARG X` is empty)."""
    chain = dockerfile.chain(stage)

    def has_arg(arg: str) -> bool:
        return any(i.keyword == "ARG" and arg in parse_arg(i.args) for s in chain for i in s.instructions)

    if has_arg(name):
        return True
    for ancestor in chain:
        for instruction in ancestor.instructions:
            if instruction.keyword != "ENV":
                continue
            for key, value in parse_arg(instruction.args).items():
                refs = re.findall(r"\$\{?(\w+)", value or "")
                if key == name and all(has_arg(ref) for ref in refs):
                    return True
    return False


# ---- Dockerfile checks -----------------------------------------------------------------------

IMAGE_PINNED = re.compile(r"^(?P<repo>[^\s:@]+(?::\d+)?/?[^\s:@]*):(?P<tag>[^\s@]+)@sha256:[0-9a-f]{64}$")


def _is_cuda_13_0_ubuntu2404(image: str) -> bool:
    match = IMAGE_PINNED.match(image)
    if not match:
        return False
    repo = match.group("repo").removeprefix("docker.io/")
    tag = match.group("tag")
    return repo == "nvidia/cuda" and tag.startswith("13.0") and "ubuntu24.04" in tag


def check_base_image_pinned(dockerfile_text: str) -> list[str]:
    """Every external FROM is name:tag@sha256:digest; the final image and the flash-attn builder
    start from nvidia/cuda 13.0 on Ubuntu 24.04, the builder from a devel variant."""
    dockerfile = parse_dockerfile(dockerfile_text)
    problems = []
    if not dockerfile.stages:
        return ["no FROM instruction"]
    for stage in dockerfile.stages:
        if dockerfile.parent(stage) is not None:
            continue
        image = substitute(stage.image, dockerfile.global_args)
        if not IMAGE_PINNED.match(image):
            problems.append(f"FROM {image}: pin it as name:tag@sha256:<digest>")
    final = dockerfile.stages[-1]
    root = dockerfile.root_image(final)
    if not _is_cuda_13_0_ubuntu2404(root):
        problems.append(f"final stage starts from {root}, not a pinned nvidia/cuda:13.0.*-ubuntu24.04")
    builders = builder_stages(dockerfile)
    if not builders:
        problems.append("no stage builds the flash-attn wheel (RUN pip wheel ...)")
    for builder in builders:
        root = dockerfile.root_image(builder)
        if not _is_cuda_13_0_ubuntu2404(root) or "devel" not in root:
            problems.append(f"builder stage {builder.name or builder.index} starts from {root}, "
                            "not a pinned nvidia/cuda:13.0.*-devel-ubuntu24.04")
    return problems


def check_versions_agree(dockerfile_text: str, gpu_txt: str, common_txt: str) -> list[str]:
    """Dockerfile version ARGs equal requirements/gpu.txt; versions written in the Dockerfile
    equal requirements/; gpu.txt and common.txt agree; common.txt pins no accelerator build."""
    dockerfile = parse_dockerfile(dockerfile_text)
    gpu, common = parse_pins(gpu_txt), parse_pins(common_txt)
    problems = []
    for name, version in gpu.items():
        if name in common and common[name] != version:
            problems.append(f"gpu.txt pins {name}=={version} but common.txt pins {common[name]}")
    for name, version in common.items():
        if is_accelerator_package(name):
            problems.append(f"common.txt pins {name}=={version}: its build differs between the CPU "
                            "environment and the GPU image, so pin it in cpu.txt / gpu.txt")
    pins = {**common, **gpu}
    defaults = dockerfile.all_arg_defaults()
    for arg, package in REQUIRED_VERSION_ARGS.items():
        if arg not in defaults:
            problems.append(f"Dockerfile has no ARG {arg} (must equal {package} in gpu.txt)")
        elif package not in gpu:
            problems.append(f"requirements/gpu.txt does not pin {package} (ARG {arg}={defaults[arg]})")
    for arg, value in defaults.items():
        if not arg.endswith("_VERSION"):
            continue
        package = canonical_name(arg.removesuffix("_VERSION"))
        if package in pins and pins[package] != value:
            problems.append(f"ARG {arg}={value} but requirements/ pins {package}=={pins[package]}")
        elif package not in pins and package not in SOURCE_BUILT:
            problems.append(f"ARG {arg}={value}: {package} is pinned in neither gpu.txt nor common.txt")
    for stage in dockerfile.stages:
        values = {**defaults, **{k: v for k, v in dockerfile.args_of(stage).items() if v}}
        for instruction in stage.instructions:
            if instruction.keyword != "RUN":
                continue
            text = substitute(instruction.args, values)
            for name, version in re.findall(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\"';&|)\\]+)", text):
                package = canonical_name(name)
                if package in pins and pins[package] != version:
                    problems.append(f"line {instruction.line}: {name}=={version} but requirements/ "
                                    f"pins {pins[package]}")
                elif package not in pins and package not in SOURCE_BUILT:
                    problems.append(f"line {instruction.line}: {name}=={version} is pinned nowhere in "
                                    "requirements/; pin it there instead")
    return problems


def _arch_tokens(value: str | None) -> list[str]:
    return [t for t in re.split(r"[;,\s]+", value or "") if t]


def check_sm120(dockerfile_text: str) -> list[str]:
    """flash-attn and torch extensions are compiled for sm_120, and the builder sees the settings."""
    dockerfile = parse_dockerfile(dockerfile_text)
    defaults = dockerfile.all_arg_defaults()
    problems = []
    if "120" not in _arch_tokens(defaults.get("FLASH_ATTN_CUDA_ARCHS")):
        problems.append(f"FLASH_ATTN_CUDA_ARCHS={defaults.get('FLASH_ATTN_CUDA_ARCHS')!r} lacks 120")
    if not any(t.startswith("12.0") for t in _arch_tokens(defaults.get("TORCH_CUDA_ARCH_LIST"))):
        problems.append(f"TORCH_CUDA_ARCH_LIST={defaults.get('TORCH_CUDA_ARCH_LIST')!r} lacks 12.0")
    for builder in builder_stages(dockerfile):
        for name in ("FLASH_ATTN_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS"):
            if not declared_in_chain(dockerfile, builder, name):
                problems.append(f"builder stage {builder.name or builder.index} does not declare "
                                f"{name} (ARG/ENV), so its build never sees it")
    return problems


def check_final_user_not_root(dockerfile_text: str) -> list[str]:
    """The final stage's last USER exists and is not root."""
    dockerfile = parse_dockerfile(dockerfile_text)
    if not dockerfile.stages:
        return ["no FROM instruction"]
    final = dockerfile.stages[-1]
    users = [i for i in final.instructions if i.keyword == "USER"]
    if not users:
        return ["the final stage sets no USER, so the image runs as root"]
    values = {**dockerfile.all_arg_defaults(), **{k: v for k, v in dockerfile.args_of(final).items() if v}}
    user = substitute(users[-1].args.strip(), values).split(":")[0]
    if "$" in user:
        return [f"line {users[-1].line}: USER {users[-1].args} does not resolve from ARG defaults"]
    if user in ("root", "0"):
        return [f"line {users[-1].line}: the final USER is root ({users[-1].args})"]
    return []


def check_flash_attn_build(dockerfile_text: str) -> list[str]:
    """flash-attn comes from the hash-checked sdist, patched to C++20, built without isolation
    against the installed torch; the final stage copies only the wheel."""
    dockerfile = parse_dockerfile(dockerfile_text)
    builders = builder_stages(dockerfile)
    if not builders:
        return ["no stage builds the flash-attn wheel (RUN pip wheel ...)"]
    builder = builders[0]
    runs = [i for stage in dockerfile.chain(builder) for i in stage.instructions if i.keyword == "RUN"]
    text = "\n".join(i.args for i in runs)
    env = "\n".join(i.args for s in dockerfile.chain(builder) for i in s.instructions if i.keyword == "ENV")
    problems = []
    if not re.search(r"pip download\b.*--no-binary", text):
        problems.append("the sdist is not fetched with `pip download --no-binary :all:`")
    sha = dockerfile.all_arg_defaults().get("FLASH_ATTN_SDIST_SHA256", "")
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        problems.append(f"ARG FLASH_ATTN_SDIST_SHA256={sha!r} is not a sha256 hex digest")
    if not any(re.search(r"sha256sum\s+(--check|-c)\b", i.args) and "FLASH_ATTN_SDIST_SHA256" in i.args
               and "|| true" not in i.args for i in runs):
        problems.append("the sdist's sha256 is not verified (`sha256sum --check` against "
                        "FLASH_ATTN_SDIST_SHA256)")
    patch = next((i for i in runs if re.search(r"sed\s+-i\s+['\"]?s/-std=c\+\+17/-std=c\+\+20/", i.args)), None)
    if patch is None:
        problems.append("setup.py's -std=c++17 is not patched to -std=c++20 (flash-attention#2863)")
    else:
        after_sed = patch.args.split("sed", 1)[1]
        if not re.search(r"grep -q\b[^&|]*c\+\+20", after_sed) or "|| true" in patch.args:
            problems.append(f"line {patch.line}: the c++20 patch is not asserted (grep -q ... after sed)")
    if "FLASH_ATTENTION_FORCE_BUILD=TRUE" not in text + "\n" + env:
        problems.append("FLASH_ATTENTION_FORCE_BUILD=TRUE is not set for the build")
    if not re.search(r"pip wheel\b.*--no-build-isolation", text):
        problems.append("the wheel is not built with --no-build-isolation against the installed torch")
    gpu_chain = dockerfile.chain(dockerfile.stages[-1], {"IMAGE": "gpu"})
    copies = [i for stage in gpu_chain for i in stage.instructions
              if i.keyword == "COPY" and f"--from={builder.name}" in i.args]
    if not copies:
        problems.append(f"the GPU image copies nothing from {builder.name}")
    for copy in copies:
        sources = [t for t in copy.args.split() if not t.startswith("--")][:-1]
        if not all(s.endswith(".whl") or "wheels" in s for s in sources):
            problems.append(f"line {copy.line}: copy only the wheel from {builder.name}, not {sources}")
    return problems


# ---- .dockerignore ---------------------------------------------------------------------------

def _pattern_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex over slash-separated paths (Go filepath.Match plus **)."""
    out, i = "", 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif char == "*":
            out, i = out + "[^/]*", i + 1
        elif char == "?":
            out, i = out + "[^/]", i + 1
        elif char == "[":
            end = pattern.find("]", i + 1)
            body = pattern[i + 1:end].replace("\\", "\\\\")
            out, i = out + "[" + ("^" + body[1:] if body.startswith(("!", "^")) else body) + "]", end + 1
        elif char == "\\" and i + 1 < len(pattern):
            out, i = out + re.escape(pattern[i + 1]), i + 2
        else:
            out, i = out + re.escape(char), i + 1
    return re.compile(out + r"\Z")


def parse_dockerignore(text: str) -> list[tuple[re.Pattern, bool]]:
    """(regex, is_exception) per pattern, in file order."""
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        line = line.lstrip("!").strip().strip("/")
        line = re.sub(r"/+", "/", line)
        if line:
            patterns.append((_pattern_regex(line), exception))
    return patterns


def is_ignored(path: str, patterns: list[tuple[re.Pattern, bool]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent dirs decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for regex, exception in patterns:
        if any(regex.match(candidate) for candidate in candidates):
            ignored = not exception
    return ignored


def check_dockerignore(dockerignore_text: str, dockerfile_text: str | None = None) -> list[str]:
    """Large and local paths stay out of the build context; what the Dockerfile COPYs stays in."""
    patterns = parse_dockerignore(dockerignore_text)
    problems = [f".dockerignore lets {what} into the build context ({sample})"
                for what, sample in REQUIRED_IGNORED.items() if not is_ignored(sample, patterns)]
    if dockerfile_text is not None:
        for stage in parse_dockerfile(dockerfile_text).stages:
            for instruction in stage.instructions:
                if instruction.keyword not in ("COPY", "ADD") or "--from=" in instruction.args:
                    continue
                sources = [t for t in instruction.args.split() if not t.startswith("--")][:-1]
                for source in sources:
                    probes = [source] if not source.endswith("/") else [f"{source}pkg/mod.py", f"{source}file.txt"]
                    problems += [f"line {instruction.line}: COPY {source} but .dockerignore excludes {p}"
                                 for p in probes if is_ignored(p, patterns)]
    return problems


# ---- compose.yaml ----------------------------------------------------------------------------

def _interpolate(value: str) -> str:
    """Compose interpolation with defaults: ${VAR:-default} -> default, ${VAR} -> ''."""
    value = re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", value)
    value = re.sub(r"\$\{\w+(:?\?[^}]*)?\}", "", value)
    return value.replace("$$", "$")


def _command_tokens(command) -> list[str]:
    tokens = shlex.split(command) if isinstance(command, str) else [str(t) for t in command or []]
    out = []
    for token in tokens:
        token = _interpolate(token)
        out += token.split("=", 1) if token.startswith("--") and "=" in token else [token]
    return out


def _option(tokens: list[str], name: str) -> str | None:
    return tokens[tokens.index(name) + 1] if name in tokens and tokens.index(name) + 1 < len(tokens) else None


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env if "=" in item)
    return {k: _interpolate(str(v)) for k, v in env.items()}


def _volume_targets(service: dict) -> list[str]:
    targets = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            targets.append(volume.get("target", ""))
        else:
            parts = str(volume).split(":")
            targets.append(parts[1] if len(parts) > 1 else parts[0])
    return targets


def check_compose(compose_text: str) -> list[str]:
    """compose.yaml parses; the trainer has the GPUs, shared memory, the checkout and the cache,
    and reaches the mlflow service through MLFLOW_TRACKING_URI; mlflow stores runs in the
    postgres service, which is pinned and health-checked."""
    try:
        doc = yaml.safe_load(compose_text)
    except yaml.YAMLError as error:
        return [f"compose file does not parse: {error}"]
    services = (doc or {}).get("services") or {}
    problems = [f"no `{name}` service" for name in ("trainer", "mlflow", "postgres") if name not in services]
    if problems:
        return problems
    trainer, mlflow, postgres = services["trainer"], services["mlflow"], services["postgres"]

    mlflow_cmd = _command_tokens(mlflow.get("command"))
    mlflow_port = int(_option(mlflow_cmd, "--port") or 5000)
    uri = _environment(trainer).get("MLFLOW_TRACKING_URI")
    if not uri:
        problems.append("trainer has no MLFLOW_TRACKING_URI")
    else:
        parsed = urlparse(uri)
        if parsed.hostname != "mlflow" or (parsed.port or 80) != mlflow_port:
            problems.append(f"trainer's MLFLOW_TRACKING_URI={uri} does not point at the mlflow "
                            f"service (http://mlflow:{mlflow_port})")
        allowed = _option(mlflow_cmd, "--allowed-hosts")
        if allowed is not None and parsed.netloc not in allowed.split(",") and "*" not in allowed:
            problems.append(f"mlflow --allowed-hosts={allowed} rejects the trainer's Host {parsed.netloc}")
    if "mlflow" not in mlflow_cmd or "server" not in mlflow_cmd:
        problems.append("the mlflow service does not run `mlflow server`")
    backend = _option(mlflow_cmd, "--backend-store-uri") or ""
    if not backend.startswith("postgresql") or urlparse(backend).hostname != "postgres":
        problems.append(f"mlflow --backend-store-uri={backend!r} is not the postgres service")
    if not _option(mlflow_cmd, "--artifacts-destination"):
        problems.append("mlflow has no --artifacts-destination")

    devices = (((trainer.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    if not any("gpu" in (d.get("capabilities") or []) for d in devices):
        problems.append("trainer reserves no GPU (deploy.resources.reservations.devices)")
    if trainer.get("ipc") != "host" and not trainer.get("shm_size"):
        problems.append("trainer has neither ipc: host nor shm_size (64 MB /dev/shm kills DataLoader workers)")
    targets = _volume_targets(trainer)
    problems += [f"trainer does not mount {t}" for t in ("/workspace", "/cache") if t not in targets]

    # closed by default: a login on the tracking server, no default password, the UI on localhost
    if _option(mlflow_cmd, "--app-name") != "basic-auth":
        problems.append("mlflow server runs without authentication (--app-name=basic-auth)")
    for default in re.findall(r"\$\{(\w*(?:PASSWORD|SECRET|TOKEN)\w*):?-([^}$]*)\}", compose_text):
        problems.append(f"${{{default[0]}}} has a default value {default[1]!r}: require it (${{{default[0]}:?…}})")
    for url in re.findall(r"\w+(?:\+\w+)?://[^\s'\"]+", _interpolate(compose_text)):
        if urlparse(url).password:
            problems.append(f"a password written into a URL: {url}")
    for port in mlflow.get("ports") or []:
        host = _interpolate(str(port)).rsplit(":", 2)[0] if str(port).count(":") >= 2 else ""
        if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
            problems.append(f"mlflow port {port} is published on every interface by default; bind 127.0.0.1")

    if not IMAGE_PINNED.match(str(postgres.get("image", ""))):
        problems.append(f"postgres image {postgres.get('image')} is not pinned as name:tag@sha256:<digest>")
    if not postgres.get("healthcheck"):
        problems.append("postgres has no healthcheck")
    return problems


# ---- the two images and their locks ----------------------------------------------------------

# The stage each image's locked Python set is installed in, and the lock it installs.
IMAGE_LOCKS = {"base": "gpu-base-lock.txt", "gpu-env": "gpu-lock.txt", "cpu-env": "cpu.txt"}
DEBIAN_PINNED = re.compile(r"^(docker\.io/)?(library/)?(debian|python):[^\s@]*bookworm[^\s@]*@sha256:[0-9a-f]{64}$")


def check_two_images(dockerfile_text: str) -> list[str]:
    """One final stage on `${IMAGE}-env` (default gpu) serves both images; the CPU image starts
    from a digest-pinned Debian 12 image; every pip install of the Python set uses a hash lock
    with --require-hashes (only the flash-attn wheel built here and draftlab itself do not; uv, the
    installer, comes from its own hash lock, requirements/uv.txt)."""
    dockerfile = parse_dockerfile(dockerfile_text)
    problems = []
    if dockerfile.global_args.get("IMAGE") != "gpu":
        problems.append(f"global ARG IMAGE={dockerfile.global_args.get('IMAGE')!r}: the default image must be gpu")
    final = dockerfile.stages[-1] if dockerfile.stages else None
    if final is None or final.image != "${IMAGE}-env":
        problems.append("the final stage is not `FROM ${IMAGE}-env`, so the two images do not share it")
    for image in ("gpu", "cpu"):
        if dockerfile.stage(f"{image}-env") is None:
            problems.append(f"no stage {image}-env")
    if final is not None and dockerfile.stage("cpu-env") is not None:
        root = dockerfile.root_image(final, {"IMAGE": "cpu"})
        if not DEBIAN_PINNED.match(root):
            problems.append(f"the CPU image starts from {root}, not a digest-pinned Debian 12 (bookworm) image")
    for stage in dockerfile.stages:
        for instruction in stage.instructions:
            if instruction.keyword != "RUN":
                continue
            for command in re.split(r"&&|;|\|\|", instruction.args):
                if not re.search(r"\bpip install\b", command):
                    continue
                words = command.split()
                local = [w for w in words if w.endswith(".whl") or w == "."]
                if local and "--no-deps" in words:
                    continue
                if "--require-hashes" not in words:
                    problems.append(f"line {instruction.line}: `{command.strip()}` installs without --require-hashes")
                want = IMAGE_LOCKS.get(stage.name or "")
                if want is None:
                    problems.append(f"line {instruction.line}: stage {stage.name} installs packages; only "
                                    f"{sorted(IMAGE_LOCKS)} install the locked sets")
                elif not any(w.endswith((f"requirements/{want}", "requirements/uv.txt")) for w in words):
                    problems.append(f"line {instruction.line}: stage {stage.name} must install requirements/{want}")
    for name, lock in IMAGE_LOCKS.items():
        stage = dockerfile.stage(name)
        if stage is not None and not any(i.keyword == "RUN" and f"requirements/{lock}" in i.args
                                         and "--require-hashes" in i.args for i in stage.instructions):
            problems.append(f"stage {name} does not install requirements/{lock} with --require-hashes")
    return problems
