"""The container files keep their rules: hadolint-clean, pinned base, versions equal to
requirements/, sm_120, non-root, a tight .dockerignore, a verified and patched flash-attn build,
and a compose file whose trainer reaches its MLflow server.

CPU only, no Docker needed: `python -m pytest tests/unit/test_dockerfile.py -q`. Each rule runs on
the real files, then on a copy mutated in tmp_path, to show that the checker catches the break.
hadolint itself runs in tests/integration/test_hadolint.py.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import dockerfile_rules as rules  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# Stand-in for requirements/common.txt in the mutation tests, so they do not depend on the lock.
FIXTURE_COMMON = "speculators==0.9.0\ntransformers==5.19.0\nmlflow==3.17.2\ndvc==3.67.1\noptuna==5.0.0\n"


def repo_text(relative: str) -> str:
    return (ROOT / relative).read_text()


@pytest.fixture
def copies(tmp_path: Path) -> Path:
    """The container files copied into tmp_path, with the fixture common.txt beside gpu.txt."""
    for relative in ("Dockerfile", ".dockerignore", "compose.yaml", ".hadolint.yaml", "requirements/gpu.txt"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / relative, tmp_path / relative)
    (tmp_path / "requirements" / "common.txt").write_text(FIXTURE_COMMON)
    return tmp_path


def mutate(path: Path, old: str, new: str) -> str:
    """Replace `old` by `new` in the copy at `path` and return the new text. Fails if `old` is gone
    from the file, so a mutation never silently stops testing anything."""
    text = path.read_text()
    assert old in text, f"mutation target {old!r} not found in {path.name}: update this test"
    path.write_text(text.replace(old, new))
    return path.read_text()


def checked(copies: Path, check: str) -> list[str]:
    """Run one named rule on the (possibly mutated) copies."""
    dockerfile = (copies / "Dockerfile").read_text()
    if check == "versions":
        return rules.check_versions_agree(dockerfile, (copies / "requirements/gpu.txt").read_text(),
                                          (copies / "requirements/common.txt").read_text())
    if check == "dockerignore":
        return rules.check_dockerignore((copies / ".dockerignore").read_text(), dockerfile)
    if check == "compose":
        return rules.check_compose((copies / "compose.yaml").read_text())
    return {
        "base": rules.check_base_image_pinned,
        "sm120": rules.check_sm120,
        "user": rules.check_final_user_not_root,
        "flash_attn": rules.check_flash_attn_build,
        "images": rules.check_two_images,
    }[check](dockerfile)


# ---- the real files -------------------------------------------------------------------------

def test_real_files_keep_every_rule() -> None:
    dockerfile = repo_text("Dockerfile")
    common_path = ROOT / "requirements" / "common.txt"
    assert common_path.exists(), "requirements/common.txt is the lock every other pin must equal"
    problems = {
        "base": rules.check_base_image_pinned(dockerfile),
        "versions": rules.check_versions_agree(dockerfile, repo_text("requirements/gpu.txt"),
                                               common_path.read_text()),
        "sm120": rules.check_sm120(dockerfile),
        "user": rules.check_final_user_not_root(dockerfile),
        "flash_attn": rules.check_flash_attn_build(dockerfile),
        "images": rules.check_two_images(dockerfile),
        "dockerignore": rules.check_dockerignore(repo_text(".dockerignore"), dockerfile),
        "compose": rules.check_compose(repo_text("compose.yaml")),
    }
    assert {name: found for name, found in problems.items() if found} == {}


def test_versions_in_dockerfile_equal_gpu_requirements() -> None:
    args = rules.parse_dockerfile(repo_text("Dockerfile")).all_arg_defaults()
    gpu = rules.parse_pins(repo_text("requirements/gpu.txt"))
    assert (args["TORCH_VERSION"], args["VLLM_VERSION"]) == (gpu["torch"], gpu["vllm"])


# ---- each rule catches its break --------------------------------------------------------------

DIGEST = "@sha256:1e8ac7a54c184a1af8ef2167f28fa98281892a835c981ebcddb1fad04bdd452d"

MUTATIONS = [
    # (rule, file, old, new, a phrase the problem must contain)
    ("base", "Dockerfile", DIGEST, "", "pin it as name:tag@sha256"),
    ("base", "Dockerfile", "cuda:13.0.0-devel", "cuda:12.8.1-devel", "nvidia/cuda:13.0"),
    ("base", "Dockerfile", "-devel-ubuntu24.04", "-runtime-ubuntu24.04", "devel"),
    ("base", "Dockerfile", "-devel-ubuntu24.04", "-devel-ubuntu22.04", "ubuntu24.04"),
    ("versions", "Dockerfile", "ARG TORCH_VERSION=2.14.0", "ARG TORCH_VERSION=2.13.0", "TORCH_VERSION=2.13.0"),
    ("versions", "Dockerfile", "ARG VLLM_VERSION=0.33.0", "ARG VLLM_VERSION=0.32.0", "VLLM_VERSION=0.32.0"),
    ("versions", "Dockerfile", "ARG VLLM_VERSION=0.33.0\n", "", "no ARG VLLM_VERSION"),
    ("versions", "Dockerfile", "RUN pip install --no-deps /tmp/wheels",
     "RUN pip install mlflow==3.17.1 && pip install --no-deps /tmp/wheels", "mlflow==3.17.1"),
    ("versions", "Dockerfile", "RUN pip install --no-deps /tmp/wheels",
     "RUN pip install einops==0.8.1 && pip install --no-deps /tmp/wheels", "pinned nowhere"),
    ("versions", "requirements/gpu.txt", "torch==2.14.0", "torch==2.14.1", "pins torch==2.14.1"),
    ("versions", "requirements/gpu.txt", "vllm==", "mlflow==3.17.0\nvllm==",
     "common.txt pins 3.17.2"),
    ("versions", "requirements/common.txt", "optuna==5.0.0", "optuna==5.0.0\ntorchvision==0.28.0",
     "common.txt pins torchvision"),
    ("sm120", "Dockerfile", "ARG FLASH_ATTN_CUDA_ARCHS=120", "ARG FLASH_ATTN_CUDA_ARCHS=90", "lacks 120"),
    ("sm120", "Dockerfile", 'ARG TORCH_CUDA_ARCH_LIST="12.0"', 'ARG TORCH_CUDA_ARCH_LIST="9.0"', "lacks 12.0"),
    ("sm120", "Dockerfile", "ARG FLASH_ATTN_CUDA_ARCHS\nARG MAX_JOBS\n", "ARG MAX_JOBS\n",
     "does not declare FLASH_ATTN_CUDA_ARCHS"),
    ("user", "Dockerfile", "USER ${USER_UID}:${USER_GID}", "USER root", "root"),
    ("user", "Dockerfile", "USER ${USER_UID}:${USER_GID}", "USER 0:0", "root"),
    ("user", "Dockerfile", "USER ${USER_UID}:${USER_GID}\n", "", "sets no USER"),
    ("flash_attn", "Dockerfile", '| sha256sum --check --strict -', "", "sha256 is not verified"),
    ("flash_attn", "Dockerfile", "ARG FLASH_ATTN_SDIST_SHA256=d0f9f0b0", "ARG FLASH_ATTN_SDIST_SHA256=CHANGE-ME",
     "not a sha256"),
    ("flash_attn", "Dockerfile", "sed -i 's/-std=c++17/-std=c++20/g' setup.py", "true", "not patched"),
    ("flash_attn", "Dockerfile", "&& grep -q -- '-std=c++20' setup.py", "", "not asserted"),
    ("flash_attn", "Dockerfile", "--no-binary :all:", "", "pip download --no-binary"),
    ("flash_attn", "Dockerfile", "FLASH_ATTENTION_FORCE_BUILD=TRUE", "FLASH_ATTENTION_FORCE_BUILD=FALSE",
     "FORCE_BUILD"),
    ("flash_attn", "Dockerfile", "pip wheel --no-deps --no-build-isolation", "pip wheel --no-deps",
     "--no-build-isolation"),
    ("flash_attn", "Dockerfile", "COPY --from=flash-attn-build /wheels/ /tmp/wheels/",
     "COPY --from=flash-attn-build /opt/venv /opt/venv", "copy only the wheel"),
    ("images", "Dockerfile", "ARG IMAGE=gpu", "ARG IMAGE=cpu", "default image must be gpu"),
    ("images", "Dockerfile", "FROM ${IMAGE}-env AS final", "FROM gpu-env AS final", "do not share it"),
    ("images", "Dockerfile", "FROM ${CPU_BASE} AS cpu-env", "FROM debian:bookworm-slim AS cpu-env",
     "not a digest-pinned Debian 12"),
    ("images", "Dockerfile", "ARG CPU_BASE=docker.io/library/debian:bookworm-slim@",
     "ARG CPU_BASE=docker.io/library/ubuntu:bookworm-slim@", "not a digest-pinned Debian 12"),
    ("images", "Dockerfile", "pip install --require-hashes --no-deps --requirement /opt/draftlab/requirements/gpu-lock.txt",
     "pip install --no-deps --requirement /opt/draftlab/requirements/gpu.txt", "without --require-hashes"),
    ("images", "Dockerfile", "--requirement /opt/draftlab/requirements/cpu.txt",
     "--requirement /opt/draftlab/requirements/common.txt", "must install requirements/cpu.txt"),
    ("images", "Dockerfile", "RUN pip install --no-deps /tmp/wheels/flash_attn-*.whl",
     "RUN pip install /tmp/wheels/flash_attn-*.whl", "without --require-hashes"),
    ("images", "Dockerfile", "RUN pip install --no-deps --no-build-isolation . ",
     "RUN pip install einops && pip install --no-deps --no-build-isolation . ", "installs without --require-hashes"),
    ("dockerignore", ".dockerignore", "\ndata\n", "\n", "data/"),
    ("dockerignore", ".dockerignore", "\n.dvc\n", "\n", ".dvc/cache"),
    ("dockerignore", ".dockerignore", "**/mlflow.db\nmlruns\nmlartifacts\n*.db\n", "mlruns\nmlartifacts\n",
     "mlflow.db"),
    ("dockerignore", ".dockerignore", "\nmlruns\n", "\n", "mlruns"),
    ("dockerignore", ".dockerignore", "**/.venv\n", "", ".venv"),
    ("dockerignore", ".dockerignore", "\n.env\n", "\n.env\n!data\n", "data/"),
    ("dockerignore", ".dockerignore", "\n.env\n", "\n.env\nsrc\n", "COPY src/"),
    ("compose", "compose.yaml", "MLFLOW_TRACKING_URI: http://mlflow:5000", "MLFLOW_TRACKING_URI: http://localhost:5000",
     "does not point at the mlflow service"),
    ("compose", "compose.yaml", "--port=5000", "--port=5001", "does not point at the mlflow service"),
    ("compose", "compose.yaml", "      MLFLOW_TRACKING_URI: http://mlflow:5000\n", "      TZ: UTC\n",
     "no MLFLOW_TRACKING_URI"),
    ("compose", "compose.yaml", "mlflow,mlflow:5000,", "mlflow,", "rejects the trainer's Host"),
    ("compose", "compose.yaml", "capabilities: [gpu]", "capabilities: [utility]", "reserves no GPU"),
    ("compose", "compose.yaml", "    ipc: host\n", "", "ipc: host"),
    ("compose", "compose.yaml", "@postgres:5432/mlflow", "@localhost:5432/mlflow", "not the postgres service"),
    ("compose", "compose.yaml", "services:\n", "services:\n  - [unbalanced\n", "does not parse"),
    ("compose", "compose.yaml", "      - --app-name=basic-auth\n", "", "without authentication"),
    ("compose", "compose.yaml", "POSTGRES_PASSWORD: ${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD in .env}",
     "POSTGRES_PASSWORD: ${POSTGRES_PASSWORD:-mlflow}", "has a default value 'mlflow'"),
    ("compose", "compose.yaml", "postgresql://mlflow@postgres", "postgresql://mlflow:mlflow@postgres",
     "a password written into a URL"),
    ("compose", "compose.yaml", '"${MLFLOW_BIND:-127.0.0.1}:5000:5000"', '"5000:5000"', "every interface"),
]


@pytest.mark.parametrize(
    ("rule", "relative", "old", "new", "expected"), MUTATIONS,
    ids=[f"{m[0]}-{i}" for i, m in enumerate(MUTATIONS)],
)
def test_rule_reports_its_break(copies: Path, rule: str, relative: str, old: str, new: str, expected: str) -> None:
    assert checked(copies, rule) == [], "the unmutated copy must pass this rule"
    mutate(copies / relative, old, new)
    problems = checked(copies, rule)
    assert any(expected in problem for problem in problems), problems


def test_dockerignore_matching_follows_docker_rules() -> None:
    patterns = rules.parse_dockerignore("data\n**/.venv\n*.db\n!keep.db\nbuild/\n")
    assert rules.is_ignored("data/hidden_states/hs_1.safetensors", patterns)
    assert rules.is_ignored("tools/sub/.venv/bin/python", patterns)
    assert rules.is_ignored("mlflow.db", patterns) and not rules.is_ignored("keep.db", patterns)
    assert not rules.is_ignored("src/draftlab/data.py", patterns)  # `data` anchors at the root
    assert not rules.is_ignored("sub/mlflow.db", patterns)  # `*.db` does not cross directories
    assert rules.is_ignored("build/lib/x.py", patterns)
