"""The container images (Dockerfile: the services; Dockerfile.operator: the operator), checked without
a Docker daemon, which this machine kind lacks.

What users rely on: a code change rebuilds only the source layer (the dependencies install from
pyproject.toml before any code is copied, and the source installs with --no-deps); the operator image
is a slim CPU one whose install set really runs the operator without torch (every other import refused
while the operator's modules load); flashinfer's kernels come precompiled, pinned
to one version, for the CUDA the image has, and compile into the pods' writable volume otherwise; the
build context holds what the Dockerfiles copy and nothing else (.dockerignore).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from radixserve.operator.volumes import CACHE_DIR

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "image_requirements.py"
SOURCE_PATHS = {"setup.py", "README.md", "proto", "services", "operator"}  # the code, not the deps
NOT_IN_OPERATOR = {"torch", "transformers", "tokenizers", "safetensors", "flashinfer-python", "fastapi"}


# --- reading Dockerfiles and .dockerignore ------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuation lines joined, comments dropped (Docker
    drops comment lines inside a continuation too)."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, f"{path.name} ends inside a continued line"
    return out


def copy_sources(args: str) -> list[str]:
    """The sources of a COPY (without --from: those come from another stage, not the context)."""
    parts = [p for p in args.split() if not p.startswith("--")]
    return [p.rstrip("/").removeprefix("./") for p in parts[:-1]]


def stages(steps: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for keyword, args in steps:
        if keyword == "FROM":
            out.append([])
        if out:
            out[-1].append((keyword, args))
    return out


def arg_defaults(steps: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)


def env_values(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in steps:
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in args.split())
    return env


def first(steps: list[tuple[str, str]], keyword: str, needle: str) -> int:
    hits = [i for i, (k, a) in enumerate(steps) if k == keyword and needle in a]
    assert hits, f"no {keyword} with {needle!r}"
    return hits[0]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


class DockerIgnore:
    """Docker's rules: a pattern matches a path or any folder above it; `!` lets a path back in; the
    last matching line wins."""

    def __init__(self, path: Path) -> None:
        self.rules: list[tuple[bool, re.Pattern[str]]] = []
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if line and not line.startswith("#"):
                keep = line.startswith("!")
                self.rules.append((keep, _glob_regex(line.removeprefix("!").strip("/"))))

    def included(self, rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        verdict = True
        for keep, pattern in self.rules:
            if any(pattern.fullmatch(p) for p in prefixes):
                verdict = keep
        return verdict

    def context(self, root: Path) -> list[str]:
        """The files a build would send. A folder that is left out and that no `!` line reaches into
        is not walked (the venv, .git)."""
        reopened = [p.pattern for keep, p in self.rules if keep]
        files: list[str] = []
        for path in sorted(root.iterdir()):
            rel = path.relative_to(root).as_posix()
            if path.is_dir():
                if self.included(rel) or any(r.startswith(re.escape(rel + "/")) for r in reopened):
                    files += [f.relative_to(root).as_posix() for f in path.rglob("*") if f.is_file()]
            else:
                files.append(rel)
        return [f for f in files if self.included(f)]


SERVICE = instructions(ROOT / "Dockerfile")
OPERATOR = instructions(ROOT / "Dockerfile.operator")
IGNORE = DockerIgnore(ROOT / ".dockerignore")


def image_requirements(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", r).group()).lower() for r in requirements}


# --- the service image -------------------------------------------------------------------------


def test_service_dependencies_install_before_the_source_and_the_source_without_them():
    deps = first(SERVICE, "RUN", "image_requirements.py service")
    copies = [(i, copy_sources(a)) for i, (k, a) in enumerate(SERVICE) if k == "COPY"]
    before = {s for i, sources in copies if i < deps for s in sources}
    assert before == {"pyproject.toml", "scripts/image_requirements.py"}, before
    source = [i for i, sources in copies if SOURCE_PATHS.intersection(sources)]
    assert source and min(source) > deps
    assert {s for i, sources in copies for s in sources} >= SOURCE_PATHS
    install = [a for k, a in SERVICE[max(source) :] if k == "RUN" and "pip install" in a]
    assert install and "--no-deps" in install[0] and "--no-build-isolation" in install[0]


def test_service_torch_comes_from_the_cuda_index_and_stays():
    torch = first(SERVICE, "RUN", '"torch==${TORCH_VERSION}"')
    assert '--index-url "${TORCH_INDEX_URL}"' in SERVICE[torch][1]
    deps = first(SERVICE, "RUN", "image_requirements.py service")
    assert torch < deps
    assert "torch==%s" in SERVICE[deps][1] and "-c /tmp/constraints.txt" in SERVICE[deps][1]


def test_service_cuda_flavour_is_the_same_for_base_torch_and_flashinfer():
    args = arg_defaults(SERVICE)
    cuda = re.search(r":(\d+)\.(\d+)\.\d+-", args["CUDA_IMAGE"])
    assert cuda, args["CUDA_IMAGE"]
    tag = f"cu{cuda.group(1)}{cuda.group(2)}"
    assert args["TORCH_INDEX_URL"].endswith("/" + tag)
    assert args["FLASHINFER_JIT_CACHE_INDEX_URL"] == f"https://flashinfer.ai/whl/{tag}"


def test_flashinfer_kernels_are_prebuilt_at_one_version_and_compile_into_the_pods_volume():
    args = arg_defaults(SERVICE)
    assert args["FLASHINFER_JIT_CACHE"] == "1"
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["FLASHINFER_VERSION"])  # no .postN: jit-cache's must prefix it
    aot = first(SERVICE, "RUN", "flashinfer-jit-cache")
    assert '"flashinfer-jit-cache==${FLASHINFER_VERSION}"' in SERVICE[aot][1]
    assert "--no-deps" in SERVICE[aot][1] and "FLASHINFER_AOT_DIR" in SERVICE[aot][1]
    deps = first(SERVICE, "RUN", "image_requirements.py service")
    assert "flashinfer-python==%s" in SERVICE[deps][1] and '"${FLASHINFER_VERSION}"' in SERVICE[deps][1]
    source = first(SERVICE, "COPY", "services")
    assert deps < aot < source
    env = env_values(SERVICE)
    # The pods mount their writable emptyDir at CACHE_DIR: JIT output must land there.
    assert env["FLASHINFER_WORKSPACE_BASE"] == CACHE_DIR == env["HOME"]


def test_service_runs_as_uid_1000():
    users = [a for k, a in SERVICE if k == "USER"]
    assert users[-1] == "1000:1000"


# --- the requirement lists ---------------------------------------------------------------------


def test_service_requirements_are_every_dependency_the_images_extras_and_the_build_backend():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = arg_defaults(SERVICE)["IMAGE_EXTRAS"]
    assert "gpu" in extras.split(",")  # flashinfer
    wanted = project["project"]["dependencies"] + project["build-system"]["requires"]
    for extra in extras.split(","):
        wanted += project["project"]["optional-dependencies"][extra]
    assert set(image_requirements("service", "--extra", extras)) == set(wanted)


def test_operator_requirements_are_pyprojects_own_lines_without_the_model_stack():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    operator = image_requirements("operator")
    assert set(operator) <= set(project["project"]["dependencies"])
    assert {"kopf", "kubernetes", "redis"} <= requirement_names(operator)
    assert not requirement_names(operator) & NOT_IN_OPERATOR


def test_image_requirements_names_a_bad_extra():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "service", "--extra", "gpus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "gpus" in done.stderr and "gpu" in done.stderr


# --- the operator image ------------------------------------------------------------------------


def test_operator_image_is_a_slim_cpu_one_without_torch():
    args = arg_defaults(OPERATOR)
    bases = [
        a.split()[0].replace("${PYTHON_IMAGE}", args.get("PYTHON_IMAGE", ""))
        for k, a in OPERATOR
        if k == "FROM"
    ]
    assert bases and all(re.fullmatch(r"python:3\.\d+-slim", b) for b in bases), bases
    assert not any(re.search(r"cuda|nvidia", a, re.I) for k, a in OPERATOR if k in {"FROM", "ARG"})
    installs = [c for k, a in OPERATOR if k == "RUN" for c in a.split("&&") if "pip install" in c]
    assert installs and not any(re.search(r"torch|cuda|\.\[", a) for a in installs), installs


def test_operator_image_installs_dependencies_before_the_code_and_runs_the_operator_as_1000():
    final = stages(OPERATOR)[-1]
    deps = first(final, "RUN", "image_requirements.py operator")
    copies = [(i, copy_sources(a)) for i, (k, a) in enumerate(final) if k == "COPY"]
    assert {s for i, sources in copies if i < deps for s in sources} == {
        "pyproject.toml",
        "scripts/image_requirements.py",
    }
    wheel = first(final, "COPY", "--from=wheel")
    assert deps < wheel
    install = [a for k, a in final[wheel:] if k == "RUN" and "pip install" in a]
    assert install and "--no-deps" in install[0]
    assert [a for k, a in final if k == "USER"][-1] == "1000:1000"
    assert [a for k, a in final if k == "ENTRYPOINT"] == ['["python", "-m", "radixserve.operator"]']


# --- the build context -------------------------------------------------------------------------


def test_build_context_is_what_the_dockerfiles_copy_and_nothing_else():
    context = set(IGNORE.context(ROOT))
    for left_out in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/repo/test_images.py",
        "helm/radixserve/values.yaml",
        "benchmarks/results/x.json",
        "services/common/pb/radixserve_pb2.py",
        "services/__pycache__/cli.cpython-311.pyc",
        "radixserve.egg-info/PKG-INFO",
        ".env",
    ):
        assert not IGNORE.included(left_out), left_out
    sources = {s for k, a in SERVICE + OPERATOR if k == "COPY" and "--from" not in a for s in copy_sources(a)}
    for source in sources:
        path = ROOT / source
        wanted = (
            [path]
            if path.is_file()
            else [
                f
                for f in path.rglob("*")
                if f.suffix in {".py", ".proto", ".c", ".md"} and not {"__pycache__", "pb"} & set(f.parts)
            ]
        )
        assert wanted, source
        missing = [
            f.relative_to(ROOT).as_posix() for f in wanted if f.relative_to(ROOT).as_posix() not in context
        ]
        assert not missing, f"COPY {source}: .dockerignore leaves out {missing[:5]}"
    assert all(f.split("/")[0] in {*SOURCE_PATHS, "pyproject.toml", "scripts"} for f in context)


OPERATOR_SMOKE = """
import importlib, pkgutil, sys
assert "torch" not in {m.name for m in pkgutil.iter_modules()}, "torch importable: the check proves nothing"
import radixserve.operator
for module in pkgutil.iter_modules(radixserve.operator.__path__):  # every module, handlers included
    importlib.import_module("radixserve.operator." + module.name)
# What the operator imports lazily: Redis ACLs and autoscaling's load reads, the CRDs' YAML.
from radixserve.common.prefix_index import RedisPrefixIndex
import redis, yaml
from radixserve.operator.__main__ import main
try:
    main(["--help"])
except SystemExit as e:
    assert e.code == 0, e.code
heavy = sorted({"torch", "transformers", "grpc", "fastapi"} & set(sys.modules))
assert not heavy, heavy
print("ok")
"""


def _closure(requirements: list[str]) -> set[str]:
    """The installed distributions ``requirements`` need, their dependencies included (no extras)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [Requirement(r).name for r in requirements]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name not in seen:
            seen.add(name)
            for line in metadata.requires(name) or []:
                req = Requirement(line)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    todo.append(req.name)
    return seen


def _image_site(dest: Path, requirements: list[str]) -> None:
    """``dest``: a site folder holding links to what the operator image installs and nothing else:
    the files of those distributions (dependencies included) and radixserve as its wheel lays it out."""
    from importlib import metadata

    for name in _closure(requirements):
        dist = metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if not (dest / top).exists() and (Path(str(dist.locate_file(top)))).exists():
                (dest / top).symlink_to(dist.locate_file(top))
    package = dest / "radixserve"
    package.mkdir()
    for entry in (ROOT / "services").iterdir():
        (package / entry.name).symlink_to(entry)
    (package / "operator").symlink_to(ROOT / "operator")


def test_operator_install_set_runs_the_operator_without_torch(tmp_path):
    """Dockerfile.operator installs only `image_requirements.py operator` (their dependencies come
    along) and the package: a Python without site-packages (-S) that sees only those (torch, the
    model stack and the rest of this venv left out) imports every operator module, the lazy imports,
    and runs `python -m radixserve.operator --help`."""
    site = tmp_path / "site"
    site.mkdir()
    _image_site(site, image_requirements("operator"))
    done = subprocess.run(
        [sys.executable, "-S", "-c", OPERATOR_SMOKE],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: its operator/ would shadow the standard library's
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        done.stdout[-2000:] + done.stderr[-3000:]
    )


def _docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.mark.skipif(not _docker_daemon(), reason="no Docker daemon here: the image itself is not built")
def test_operator_image_builds_and_imports_the_operator(tmp_path):
    tag = "radixserve-operator:test-images"
    build = subprocess.run(
        ["docker", "build", "-f", "Dockerfile.operator", "-t", tag, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--read-only",
            "--user",
            "1000:1000",
            "--entrypoint",
            "python",
            tag,
            "-c",
            "import radixserve.operator.handlers; print('ok')",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
