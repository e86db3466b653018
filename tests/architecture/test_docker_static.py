"""Static checks of docker/: compose structure and Dockerfiles (no Docker engine needed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER = REPO_ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, args) pairs, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf:
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _env_text(service: dict) -> dict:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return env


def _cmd_list(value) -> list[str]:
    return value if isinstance(value, list) else str(value).split()


# --------------------------------------------------------------------------- compose


def test_services_present(compose):
    services = compose["services"]
    for name in ("redis", "worker", "trainer", "rq-dashboard"):
        assert name in services, name
    assert "train" in services["trainer"].get("profiles", [])
    assert "profiles" not in services["worker"], "the CPU worker runs by default"


def test_redis_is_durable_and_password_protected(compose):
    redis = compose["services"]["redis"]
    assert redis["image"].startswith("redis:")
    cmd = _cmd_list(redis["command"])
    joined = " ".join(cmd)
    assert re.search(r"--appendonly\s+yes", joined)
    assert re.search(r"--maxmemory-policy\s+noeviction", joined)
    idx = cmd.index("--requirepass")
    assert cmd[idx + 1].startswith("${REDIS_PASSWORD:?"), "password must be required, never defaulted"
    assert any(str(v).endswith(":/data") for v in redis["volumes"])
    assert "healthcheck" in redis and redis["healthcheck"]["test"]
    assert "ports" not in redis, "redis stays on the compose network"


def test_worker_env_volumes_and_scaling(compose):
    worker = compose["services"]["worker"]
    env = _env_text(worker)
    assert re.fullmatch(r"redis://:\$\{REDIS_PASSWORD[^}]*\}@redis:6379/0", env["REDIS_URL"])
    assert env["DFLASH_CHECKPOINT_ROOTS"] == "/checkpoints"
    assert "WANDB_MODE" in env
    assert "WANDB_API_KEY" in env and env["WANDB_API_KEY"] is None, "pass-through, never a literal key"
    assert "checkpoints:/checkpoints:ro" in worker["volumes"]
    assert "replicas" in worker["deploy"]
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"


def test_cuda_worker_reserves_a_gpu(compose):
    cuda = compose["services"]["worker-cuda"]
    assert "cuda" in cuda["profiles"]
    assert cuda["build"]["args"]["VARIANT"] == "cuda"
    devices = cuda["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)
    assert "checkpoints:/checkpoints:ro" in cuda["volumes"]


def test_trainer_writes_checkpoints(compose):
    trainer = compose["services"]["trainer"]
    assert "checkpoints:/checkpoints" in trainer["volumes"]
    assert _env_text(trainer)["REDIS_URL"].startswith("redis://:${REDIS_PASSWORD")


def test_targets_have_one_path_on_both_sides_and_workers_confine_them(compose):
    def models_mount(service):
        return [v for v in compose["services"][service]["volumes"] if v.rsplit(":", 2)[1:2] == ["/models"]]

    for service in ("worker", "worker-cuda", "trainer"):
        (mount,) = models_mount(service)
        assert mount.endswith(":/models:ro") and mount.startswith("${MODELS_DIR"), (service, mount)
    assert models_mount("worker")[0] == models_mount("trainer")[0]  # a job's target path means the same
    assert _env_text(compose["services"]["worker"])["DFLASH_TARGET_ROOTS"] == "/models"


def test_dashboard(compose):
    dash = compose["services"]["rq-dashboard"]
    assert any(str(p).split(":")[-1] == "9181" for p in dash["ports"])
    cmd = _cmd_list(dash["command"])
    assert "--redis-url" in cmd
    assert cmd[cmd.index("--redis-url") + 1].startswith("redis://:${REDIS_PASSWORD")
    # JSON jobs and workers (eval_worker/commands/dashboard.py)
    assert dash["entrypoint"] == ["dflash-eval", "dashboard"]


def test_named_volumes_declared(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for svc in compose["services"].values():
        for vol in svc.get("volumes", []):
            source = str(vol).split(":")[0]
            if not source.startswith((".", "/", "~", "$")):  # "$": a bind path from the environment
                used.add(source)
    assert {"redis-data", "checkpoints"} <= declared
    assert used <= declared, used - declared


def test_build_dockerfiles_exist(compose):
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if not build:
            continue
        context = (COMPOSE.parent / build.get("context", ".")).resolve()
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: {dockerfile}"
        assert context == REPO_ROOT


# --------------------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("name", ["Dockerfile.worker", "Dockerfile.trainer"])
def test_dockerfile_basics(name):
    instr = _instructions(DOCKER / name)
    kinds = [k for k, _ in instr]
    assert kinds and kinds[0] in ("ARG", "FROM")
    assert "FROM" in kinds
    assert "ENTRYPOINT" in kinds or "CMD" in kinds
    user = [a for k, a in instr if k == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0"), "runs as non-root"
    copies = " ".join(a for k, a in instr if k == "COPY")
    assert "constraints.txt" in copies and "requirements.lock" in copies
    installs = [a for k, a in instr if k == "RUN" and "pip install" in a]
    for run in installs:
        for step in run.split("&&"):
            if "pip install" in step and "--upgrade pip" not in step:
                # every install goes through the torch pin and the lock: no package floats in an image
                assert "-c constraints.txt" in step and "-c requirements.lock" in step, step


def test_worker_dockerfile_variants():
    instr = _instructions(DOCKER / "Dockerfile.worker")
    args = [a for k, a in instr if k == "ARG"]
    assert any(a.startswith("VARIANT=cpu") for a in args)
    froms = [a for k, a in instr if k == "FROM"]
    assert any(a.endswith("AS base-cpu") for a in froms) and any(a.endswith("AS base-cuda") for a in froms)
    assert any(a.startswith("base-${VARIANT}") for a in froms)
    assert any("python:3.11-slim" in a for k, a in instr if k == "ARG")
    envs = " ".join(a for k, a in instr if k == "ENV")
    assert "download.pytorch.org/whl/cpu" in envs
    runs = " ".join(a for k, a in instr if k == "RUN")
    assert '--index-url "${TORCH_INDEX_URL}"' in runs
    entry = [a for k, a in instr if k == "ENTRYPOINT"][-1]
    assert entry.replace(" ", "") == '["dflash-eval","worker"]'


def test_trainer_dockerfile():
    instr = _instructions(DOCKER / "Dockerfile.trainer")
    froms = [a for k, a in instr if k == "FROM"]
    base = [a for k, a in instr if k == "ARG" and a.startswith("BASE_IMAGE=")]
    assert "cuda" in (base[0] if base else froms[0]).lower()
    entry = [a for k, a in instr if k == "ENTRYPOINT"][-1]
    assert "torchrun" in entry and "dflash_train" in entry and '"-m"' in entry
    assert ".[train]" in " ".join(a for k, a in instr if k == "RUN")


def test_constraints_pin_torch():
    lines = [line.strip() for line in (REPO_ROOT / "constraints.txt").read_text().splitlines()]
    assert "torch==2.13.0" in lines


def test_dockerignore_keeps_context_small():
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    for entry in (".git", ".venv"):
        assert entry in ignored


# --------------------------------------------------------------------------- docker compose config


def _compose_cmd() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_compose_config_validates():
    cmd = _compose_cmd()
    if cmd is None:
        pytest.skip("docker compose plugin not installed (client-side validation needs no engine)")
    env = {**os.environ, "REDIS_PASSWORD": "test-password-123"}
    out = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "--profile", "train", "--profile", "cuda", "config", "-q"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    # and the required password really is required
    env.pop("REDIS_PASSWORD")
    out = subprocess.run([*cmd, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                         env=env, cwd=REPO_ROOT, timeout=60)
    assert out.returncode != 0 and "REDIS_PASSWORD" in out.stderr


def test_s3_profile_runs_without_a_shared_volume(compose):
    """The `s3` profile: MinIO, a bucket made once, a worker with no checkpoints volume that pulls
    from the store, a trainer that uploads to it; credentials only as the standard AWS variables."""
    services = compose["services"]
    for name in ("minio", "minio-init", "worker-s3", "trainer-s3"):
        assert "s3" in services[name]["profiles"], name
    for name in ("worker", "redis", "rq-dashboard"):
        assert "s3" not in services[name].get("profiles", []), name  # the default stack is unchanged
    worker, trainer = services["worker-s3"], services["trainer-s3"]
    assert not any(v.split(":")[0] == "checkpoints" for v in worker["volumes"])
    assert not any(v.split(":")[0] == "checkpoints" for v in trainer["volumes"])  # nothing shared but the store
    wenv, tenv = _env_text(worker), _env_text(trainer)
    assert wenv["DFLASH_CHECKPOINT_ROOTS"].startswith("s3://") and tenv["DFLASH_PUBLISH_TO"].startswith("s3://")
    assert wenv["DFLASH_CHECKPOINT_ROOTS"] == tenv["DFLASH_PUBLISH_TO"]  # the worker serves what the trainer writes
    for env in (wenv, tenv):
        assert env["AWS_ENDPOINT_URL"].endswith("minio:9000}")
        assert env["AWS_ACCESS_KEY_ID"].startswith("${S3_ACCESS_KEY")
        assert env["AWS_SECRET_ACCESS_KEY"].startswith("${S3_SECRET_KEY")
        assert env["REDIS_URL"].startswith("redis://:${REDIS_PASSWORD")
    assert worker["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    assert "minio-data" in compose["volumes"]
    assert all(p.startswith("127.0.0.1:") for p in services["minio"]["ports"])
