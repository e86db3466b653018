"""MLflow sink: one MLflow run per training run (or nested under the trainer's run), from the ledger.

Run identity: tag ``dflash.train_run=<run_id>`` in the experiment (``dflash-eval``, or the parent
run's experiment when the job's ``mlflow.parent_run_id`` names the trainer's run, which then also
becomes the tag ``mlflow.parentRunId``: the eval run shows nested under the training run). Metrics
are logged with ``step=`` the training step (MLflow plots by step, so late and out-of-order results
land at their own x): our keys and the field's aliases (``sinks/names.py``; ``@`` spelled ``_at_``,
which MLflow names cannot hold); params are the eval
settings per suite (``<suite>.block_size``, ...); each ledger record is an artifact
(``results/step-<step>-<record hash>/attempt-<n>.json``) and the HTML report (``report/``) is
replaced at each publication.

Idempotent re-publication: every record's metrics go in one ``log_batch`` together with the tag
``dflash.record.<hash>``, so a publication logs exactly the records the run lacks and a repeated one
logs nothing (a newer attempt of a step adds its points at that step: MLflow keeps a metric's
history). Offline-first: the default tracking store is a local sqlite file under ``$DFLASH_HOME``;
one writer per run (`wandb_lock.writer_lock`).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from dflash_train.common.settings import Settings
from eval_worker.results.run_results import RunResult, Series, lag_scalars, load_run, series_of
from eval_worker.results.sinks.base import Sink, SinkError, register
from eval_worker.results.sinks.common import eval_run_id
from eval_worker.results.sinks.names import points
from eval_worker.results.sinks.wandb_lock import writer_lock

log = logging.getLogger(__name__)

TRAIN_RUN_TAG = "dflash.train_run"
RECORD_TAG = "dflash.record."
_BATCH = 900  # MLflow's log_batch takes at most 1000 metrics and 100 params per call


@dataclass
class MlflowTarget:
    tracking_uri: str
    experiment: str = "dflash-eval"
    parent_run_id: str | None = None
    primary_suite: str | None = None
    lock_dir: str | None = None  # where the file lock lies (default: beside a local store, else the temp dir)
    report: bool = True  # the HTML report as an artifact (needs the worker extra)

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict) -> MlflowTarget:
        return cls(**data)


def target_from(cfg: dict | None, settings: Settings, **over) -> MlflowTarget:
    cfg = dict(cfg or {})
    return MlflowTarget(tracking_uri=over.get("tracking_uri") or settings.mlflow_uri,
                        experiment=over.get("experiment") or cfg.get("experiment") or settings.mlflow_experiment,
                        parent_run_id=over.get("parent_run_id") or cfg.get("parent_run_id"),
                        primary_suite=settings.wandb_primary_suite, lock_dir=str(settings.home / "mlflow"))


def _local_path(uri: str) -> Path | None:
    """The directory a local store lives in (sqlite file or file store), None for a server."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).parent
    if uri.startswith("file:"):
        return Path(urlparse(uri).path)
    if "://" not in uri:
        return Path(uri)
    return None


_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]+")  # what MLflow allows in metric and param names


def metric_key(key: str) -> str:
    """A name MLflow takes, for metrics and params alike: ``accept_rate@0`` is logged as ``accept_rate_at_0``,
    any other character MLflow refuses (a suite named ``code review (v2) τ ✓``) becomes ``_``."""
    return _MLFLOW_UNSAFE.sub("_", key.replace("@", "_at_"))[:250]


def ensure_store(uri: str, lock_dir: Path) -> None:
    """A local sqlite store, created atomically: built under a temporary name and linked into place, so a
    kill while MLflow creates its tables never leaves a half-made store at the real name. One left by an
    earlier version (MLflow then fails for good: "table ... already exists") is set aside and rebuilt when
    it holds no run; one that holds runs is left to MLflow's own error (`mlflow db upgrade`)."""
    if not uri.startswith("sqlite:///"):
        return
    from mlflow.tracking import MlflowClient

    from eval_worker.results.sinks.wandb_lock import file_lock

    db = Path(uri[len("sqlite:///"):])
    with file_lock(lock_dir / ".mlflow-store.lock", wait_s=600.0):
        if db.is_file():
            try:
                MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
                return
            except Exception as e:  # noqa: BLE001 - judged below: a half-made store, or a real one to keep
                if _holds_runs(db):
                    raise
                _forget_engine(uri)  # its pooled connection still reads the half-made file
                aside = db.with_name(f"{db.name}.half-made-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}")
                os.replace(db, aside)
                log.warning("MLflow store %s was half-made (%s: %s; a kill while it was created?); set aside as %s "
                            "and created again", db, type(e).__name__, str(e).splitlines()[0][:200], aside.name)
        tmp = db.with_name(f".{db.name}.creating-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            store = SqlAlchemyStore(f"sqlite:///{tmp}", (db.parent / "artifacts").resolve().as_uri())
            store.engine.dispose()
            os.link(tmp, db)  # never replaces a store another process made meanwhile
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)


def _forget_engine(uri: str) -> None:
    """MLflow keeps one SQLAlchemy engine per store URI for the process (`SqlAlchemyStore._engine_map`, a
    private map: looked up defensively); a store replaced on disk needs a fresh one."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engines = getattr(SqlAlchemyStore, "_engine_map", None)
    engine = engines.pop(uri, None) if isinstance(engines, dict) else None
    if engine is not None:
        engine.dispose()


def _holds_runs(db: Path) -> bool:
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as c:
            return bool(c.execute("SELECT count(*) FROM runs").fetchone()[0])
    except sqlite3.Error:
        return False


def record_tag(res: RunResult) -> str:
    return RECORD_TAG + hashlib.sha256(res.key.encode()).hexdigest()[:20]


def _experiment_id(client, target: MlflowTarget) -> str:
    if target.parent_run_id:
        return client.get_run(target.parent_run_id).info.experiment_id
    exp = client.get_experiment_by_name(target.experiment)
    if exp is not None:
        return exp.experiment_id
    local = _local_path(target.tracking_uri)
    location = (local / "artifacts").resolve().as_uri() if local is not None else None  # a server picks its own
    try:
        return client.create_experiment(target.experiment, artifact_location=location)
    except Exception:  # created meanwhile by another process
        exp = client.get_experiment_by_name(target.experiment)
        if exp is None:
            raise
        return exp.experiment_id


def _find_or_create_run(client, exp_id: str, run_id: str, target: MlflowTarget):
    quoted = run_id.replace("'", "\\'")
    found = client.search_runs([exp_id], filter_string=f"tags.`{TRAIN_RUN_TAG}` = '{quoted}'", max_results=2)
    if found:
        return found[0]
    tags = {TRAIN_RUN_TAG: run_id, "dflash.source": "dflash-eval results ledger"}
    if target.parent_run_id:
        tags["mlflow.parentRunId"] = target.parent_run_id
    return client.create_run(exp_id, run_name=eval_run_id(run_id), tags=tags)


_PARAM_KEYS = ("block_size", "max_new_tokens", "mode", "counting", "tree_budget", "temperature", "eos_token_id")


def _params(res: RunResult, series: Series) -> dict[str, str]:
    """The eval settings of a series, keyed by its label (two counting rules are two params, not one
    overwritten), with what the label stands for (suite, target, options); keys MLflow takes."""
    name = series.label
    settings = res.result.get("settings") or {}
    out = {f"{name}.{k}": str(settings[k]) for k in _PARAM_KEYS if settings.get(k) is not None}
    out[f"{name}.suite_fingerprint"] = str(res.result["suite"].get("fingerprint"))
    target = res.result.get("target") or {}
    out[f"{name}.target"] = f"{target.get('path')} ({str(target.get('fingerprint') or '')[:16]})"
    if series.options:
        out[f"{name}.options"] = series.options
    return {metric_key(k): v[:6000] for k, v in out.items()}


def publish_run(run_id: str, target: MlflowTarget, *, results_dir, redis_url: str | None = None,
                force: bool = False, lock_wait_s: float = 600.0) -> dict:
    """Log the ledger records the MLflow run lacks (`force`: re-log every record)."""
    from mlflow.tracking import MlflowClient

    from dflash_train.common.redaction import redact_url  # the outcome is logged: no password in it

    lock_dir = Path(target.lock_dir or _local_path(target.tracking_uri) or tempfile.gettempdir())
    lock_dir.mkdir(parents=True, exist_ok=True)
    local = _local_path(target.tracking_uri)
    if local is not None:
        local.mkdir(parents=True, exist_ok=True)
    eid = eval_run_id(run_id)
    if local is not None:
        ensure_store(target.tracking_uri, lock_dir)
    with writer_lock(f"mlflow-{eid}", redis_url=redis_url, lock_dir=lock_dir, wait_s=lock_wait_s):
        results = load_run(run_id, results_dir)  # under the lock: a waiting writer sees every record
        client = MlflowClient(tracking_uri=target.tracking_uri)
        run = _find_or_create_run(client, _experiment_id(client, target), run_id, target)
        mid = run.info.run_id
        tags, params = dict(run.data.tags), dict(run.data.params)
        series = series_of(results, target.primary_suite)
        todo = [r for r in results if force or record_tag(r) not in tags]
        failed: list[str] = []
        new_params = {}
        for res in results:
            for k, v in _params(res, series[res.key]).items():
                if k not in params and k not in new_params:
                    new_params[k] = v
                elif params.get(k, new_params.get(k)) != v:
                    log.warning("MLflow param %s stays %r (a later result has %r)", k, params.get(k, new_params.get(k)),
                                v)
        items = list(new_params.items())
        for i in range(0, len(items), 100):
            _log_params(client, mid, items[i:i + 100], failed)
        logged = []
        for res in sorted(todo, key=lambda r: (r.step, r.record_key)):
            try:  # one record MLflow refuses never keeps the others out
                _log_record(client, mid, res, series[res.key])
                logged.append(res)
            except Exception as e:  # noqa: BLE001 - named in the error raised at the end
                failed.append(f"step {res.step} ({series[res.key].label}): {type(e).__name__}: {str(e)[:300]}")
        if logged and target.report:
            _log_report(client, mid, run_id, results_dir)
        client.set_terminated(mid, "FINISHED")  # an eval run is complete after each publication (reopened by the next)
        if failed:
            raise SinkError(f"MLflow refused {len(failed)} item(s) of run {run_id} (the others are logged): "
                            + "; ".join(failed[:5]))
        return {"eval_run_id": eid, "mlflow_run_id": mid, "experiment_id": run.info.experiment_id,
                "tracking_uri": redact_url(target.tracking_uri), "logged": [r.key for r in logged],
                "records": [r.key for r in results], "steps": sorted({r.step for r in results}),
                "parent_run_id": target.parent_run_id}


def _log_params(client, mid: str, items: list[tuple[str, str]], failed: list[str]) -> None:
    """A batch of params; when MLflow refuses the batch, one by one (a bad one is named, the rest logged)."""
    from mlflow.entities import Param

    try:
        client.log_batch(mid, params=[Param(k, v) for k, v in items])
        return
    except Exception:  # noqa: BLE001 - retried one by one below, each failure named
        pass
    for k, v in items:
        try:
            client.log_batch(mid, params=[Param(k, v)])
        except Exception as e:  # noqa: BLE001 - named in the publication's error
            failed.append(f"param {k!r}: {type(e).__name__}: {str(e)[:200]}")


def _log_record(client, mid: str, res: RunResult, series: Series) -> None:
    """The record itself as an artifact, then every point of it at its training step, its tag with the last
    batch: the tag means complete, so it comes last (a kill before it leaves the record to the next
    publication, which re-logs the artifact in place; issue 34 D1)."""
    from mlflow.entities import Metric, RunTag

    where = f"results/step-{res.step}-{record_tag(res)[len(RECORD_TAG):]}"
    client.log_artifact(mid, str(res.path), artifact_path=where)
    ts = int(time.time() * 1000)
    values = {**points(res.result, None, series), **lag_scalars(res)}
    ms = [Metric(metric_key(k), float(v), ts, res.step) for k, v in sorted(values.items())]
    for i in range(0, max(len(ms), 1), _BATCH):
        last = i + _BATCH >= len(ms)
        client.log_batch(mid, metrics=ms[i:i + _BATCH], tags=[RunTag(record_tag(res), str(res.step))] if last else [])


def _log_report(client, mid: str, run_id: str, results_dir) -> None:
    missing = [m for m in ("jinja2", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:  # the worker extra
        log.warning("no HTML report artifact (not installed: %s)", ", ".join(missing))
        return
    from eval_worker.results.report import build_report

    with tempfile.TemporaryDirectory() as tmp:
        try:
            build_report(run_id, results_dir=results_dir, out_dir=tmp)
        except Exception as e:  # noqa: BLE001 - the metrics are logged; the report is a convenience
            log.warning("no HTML report artifact: %s: %s", type(e).__name__, e)
            return
        client.log_artifacts(mid, tmp, artifact_path="report")



@register
class MlflowSink(Sink[MlflowTarget]):
    """MLflow: the job's ``mlflow`` block (experiment, the trainer's run to nest under); the worker's tracking URI."""

    name = "mlflow"
    label = "MLflow"

    def target(self, cfg: dict | None, settings: Settings, **over: Any) -> MlflowTarget:
        """`over`: `tracking_uri`, `experiment`, `parent_run_id` (over the job's block and the settings)."""
        return target_from(cfg, settings, **self._options(over, "tracking_uri", "experiment", "parent_run_id"))

    def target_from_json(self, data: dict) -> MlflowTarget:
        return MlflowTarget.from_json(data)

    def publish_run(self, run_id: str, target: MlflowTarget, *, results_dir: str | os.PathLike,
                    redis_url: str | None = None, force: bool = False, lock_wait_s: float = 600.0) -> dict:
        return publish_run(run_id, target, results_dir=results_dir, redis_url=redis_url, force=force,
                           lock_wait_s=lock_wait_s)

    def summary(self, info: dict, target: MlflowTarget) -> list[str]:
        from dflash_train.common.redaction import redact_url

        return [f"mlflow run {info['mlflow_run_id']} ({info['eval_run_id']}): logged {len(info['logged'])} missing "
                f"record(s), {len(info['records'])} in total ({redact_url(info['tracking_uri'])})"]
