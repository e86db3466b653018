"""W&B sink: one eval run per training run, rebuilt from the results ledger.

Run identity: id ``<run_id>-eval``, ``group=<run_id>``, ``job_type="eval"``. Every point is
logged with ``train/step`` in the same dict and ``define_metric("eval/*",
step_metric="train/step")``; ``step=`` is never passed, so a re-evaluated old checkpoint
lands at its own x. ``eval/tau`` keeps ``summary="max"``.

Offline (the default) — why a full rebuild each time: ``wandb sync`` of several offline
segments with one run id makes them overwrite each other (wandb/wandb#3841, #5865), and
``--append`` only works for disjoint steps. So a publication never writes a partial
segment: it rebuilds the *complete* eval run from the ledger into a fresh build directory
``<root>/builds/<id>/<build>/`` and then switches the pointer ``<root>/<id>.json`` and the
symlink ``<root>/<id>`` to it and deletes older builds. The current build is always one
complete run that syncs cleanly (``wandb sync <root>/<id>``); syncing a newer build later
simply replaces the run's history with a superset. Cost is O(evaluations) per publish,
which is small next to an evaluation. Each build has its own ``WANDB_DATA_DIR`` (artifact
staging) so deleting a superseded build deletes all of its files.

Online: each new ledger record is appended to the live run (``resume="allow"``); which
records were logged is kept in ``<root>/<id>.online.json``, so ``publish`` after an outage
logs exactly the missing ones. ``publish --mode offline`` rebuilds everything locally.

Every writer holds :func:`wandb_lock.writer_lock` (Redis + local file), never shared mode.
Checkpoints are logged as reference artifacts (``file://`` URI, no checksum pass over
the weights, no upload) with aliases ``step-<n>`` and ``best-tau`` on the best one; one named by a
store URL (``s3://``, ``hf://``) as an artifact holding a small ``checkpoint.json`` with the URL, plus
native ``s3://`` references to its files (usable away from the worker box). A local checkpoint is
uploaded instead of referenced when ``$DFLASH_WANDB_UPLOAD_CHECKPOINTS=1`` (opt-in: weights are large).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash_train.checkpoints.location import CheckpointRef
from dflash_train.common.fsutil import atomic_write_text
from dflash_train.common.settings import Settings
from eval_worker.results.run_results import RunResult, lag_scalars, load_run, series_of
from eval_worker.results.sinks.base import Sink, SinkError, register
from eval_worker.results.sinks.common import eval_run_id, read_json, safe_name
from eval_worker.results.sinks.names import suite_prefix
from eval_worker.results.sinks.wandb_lock import writer_lock
from eval_worker.results.sinks.wandb_payload import HF_STEP_KEY, STEP_KEY, run_log

log = logging.getLogger(__name__)

Mode = Literal["offline", "online", "disabled"]
MODES: tuple[Mode, ...] = ("offline", "online", "disabled")


@dataclass
class WandbTarget:
    """Where and how one eval run is published (everything a publication needs, so the sink's
    child process gets it whole as JSON and reads no settings of its own)."""

    project: str = "dflash-eval"
    entity: str | None = None
    group: str | None = None
    mode: Mode = "offline"
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    root: Path = field(default_factory=lambda: Path("wandb-eval").resolve())
    init_timeout_s: float = 60.0        # the wandb.init handshake
    primary_suite: str | None = None   # logged under plain eval/... (default: the first suite evaluated)
    upload_checkpoints: bool = False   # local checkpoints: upload the files instead of file:// references

    def identity(self) -> dict:
        """What names the run on the server; kept in the pointer so `publish` reuses it."""
        return {"project": self.project, "entity": self.entity, "group": self.group, "name": self.name,
                "tags": list(self.tags)}

    def to_json(self) -> dict:
        return {"project": self.project, "entity": self.entity, "group": self.group, "mode": self.mode,
                "name": self.name, "tags": list(self.tags), "root": str(self.root),
                "init_timeout_s": self.init_timeout_s, "primary_suite": self.primary_suite,
                "upload_checkpoints": self.upload_checkpoints}

    @classmethod
    def from_json(cls, data: dict) -> WandbTarget:
        return cls(**{**data, "root": Path(data["root"])})


def target_from(cfg: dict | None, settings: Settings, *, mode: str | None = None,
                root: str | os.PathLike | None = None) -> WandbTarget:
    """Job ``wandb`` block + settings -> target. The worker's ``WANDB_MODE`` overrides the job's mode."""
    cfg = dict(cfg or {})
    chosen = mode or settings.wandb_mode or cfg.get("mode") or "offline"
    if chosen == "dryrun":
        chosen = "offline"
    if chosen not in MODES:
        raise SinkError(f"unknown W&B mode {chosen!r}; expected one of {', '.join(MODES)}")
    return WandbTarget(project=cfg.get("project") or settings.wandb_project or "dflash-eval",
                       entity=cfg.get("entity") or settings.wandb_entity or None,
                       group=cfg.get("group"), mode=chosen, name=cfg.get("name"), tags=list(cfg.get("tags") or []),
                       root=Path(root or cfg.get("root") or settings.wandb_dir).expanduser().resolve(),
                       init_timeout_s=settings.wandb_init_timeout_s, primary_suite=settings.wandb_primary_suite,
                       upload_checkpoints=settings.wandb_upload_checkpoints)


def _settings(target: WandbTarget):
    import wandb

    init_timeout = target.init_timeout_s
    kwargs: dict[str, Any] = dict(
        silent=True, console="off", x_disable_stats=True, x_disable_meta=True, disable_git=True, save_code=False,
        disable_code=True, disable_job_creation=True, x_save_requirements=False, init_timeout=init_timeout)
    if target.mode == "online":  # fail fast when the server is down; the ledger keeps the result
        kwargs.update(x_graphql_timeout_seconds=init_timeout, x_file_stream_timeout_seconds=init_timeout,
                      x_graphql_retry_max=2)
    return wandb.Settings(**kwargs)


def _init(target: WandbTarget, run_id: str, run_dir: Path, results: list[RunResult], **extra):
    import wandb

    eid = eval_run_id(run_id)
    series = series_of(results, target.primary_suite)
    # what each series' key stands for (suite, target, options), shown in the run's config
    legend = {s.label: {"suite": s.suite, "target": s.target, "options": s.options or "default"}
              for s in series.values()}
    run = wandb.init(project=target.project, entity=target.entity, group=target.group or run_id, job_type="eval",
                     id=eid, name=target.name or eid, tags=target.tags or None, mode=target.mode, dir=str(run_dir),
                     config={"train_run": run_id, "source": "dflash-eval results ledger",
                             "suites": sorted({r.result["suite"]["name"] for r in results}), "series": legend},
                     settings=_settings(target), **extra)
    # The full schema on every writer: a later writer's definitions replace earlier ones.
    run.define_metric(STEP_KEY)
    run.define_metric(HF_STEP_KEY)  # an x-axis choice for panels shared with an HF run
    run.define_metric("eval/*", step_metric=STEP_KEY)
    prefixes = {"eval/"} | {suite_prefix(s.label) for s in series.values()}
    for r_prefix in sorted(prefixes):
        run.define_metric(r_prefix + "tau", step_metric=STEP_KEY, summary="max")
    return run


def _best(results: list[RunResult], series: dict) -> RunResult | None:
    """The best checkpoint of the primary series (τ of other suites, targets or counting rules is another scale)."""
    pool = [r for r in results if series[r.key].primary] or results
    return max(pool, key=lambda r: (r.result["tau"]["macro"], -r.step), default=None)


CHECKPOINT_FILES = ("config.json", "model.safetensors", "COMPLETE.json")  # not .pins/: those come and go


def _log_checkpoint(run, run_id: str, res: RunResult, best: RunResult | None, upload: bool = False) -> bool:
    """Log the checkpoint as a reference artifact; False when its files are gone (retention)."""
    import wandb

    ck = res.result["checkpoint"]
    if ck.get("path") and not CheckpointRef.parse(ck["path"]).on_this_machine:  # a store or the Hub: no file://
        return _log_store_checkpoint(run, run_id, res, best)
    ck_dir = Path(ck.get("source") or ck["path"]).resolve()  # an import record's files are at its source
    files = [ck_dir / f for f in CHECKPOINT_FILES if (ck_dir / f).is_file()]
    if not files:
        log.warning("checkpoint %s is gone; logging step %d without its artifact", ck_dir, res.step)
        return False
    art = wandb.Artifact(f"{safe_name(run_id)}-drafter", type="model",
                         metadata={"train_step": res.step, "digest": ck.get("digest"), "path": str(ck_dir),
                                   "tau": res.result["tau"]["macro"], "suite": res.result["suite"]["name"]})
    for f in files:
        if upload:  # opt-in: the files themselves, so the artifact is usable away from the worker box
            art.add_file(str(f), name=f.name)
        else:  # checksum=False: URIs only, nothing reads (or uploads) the weights
            art.add_reference(f.as_uri(), name=f.name, checksum=False)
    aliases = [f"step-{res.step}"] + (["best-tau"] if best is not None and best.key == res.key else [])
    run.log_artifact(art, aliases=aliases)
    return True


def _log_store_checkpoint(run, run_id: str, res: RunResult, best: RunResult | None) -> bool:
    """A checkpoint named by a store URL: an artifact holding one small `checkpoint.json` (the URL,
    digest, run and step) and, for `s3://`, W&B's own references to the checkpoint's files, so
    `artifact.download()` works on any box with credentials for the bucket. `checksum=False`: W&B
    neither lists nor reads the objects (no credentials in the sink; the manifest digest is ours)."""
    import wandb

    ck = res.result["checkpoint"]
    info = {"uri": ck["path"], "digest": ck.get("digest"), "run_id": ck.get("run_id"), "step": res.step}
    art = wandb.Artifact(f"{safe_name(run_id)}-drafter", type="model",
                         metadata={"train_step": res.step, "digest": ck.get("digest"), "uri": ck["path"],
                                   "tau": res.result["tau"]["macro"], "suite": res.result["suite"]["name"]})
    with art.new_file("checkpoint.json") as fh:
        json.dump(info, fh, sort_keys=True)
    ref = CheckpointRef.parse(ck["path"])
    if ref.kind == "s3" and importlib.util.find_spec("boto3") is not None:
        base = ref.text
        for f in CHECKPOINT_FILES:
            art.add_reference(f"{base}/{f}", name=f, checksum=False)
    aliases = [f"step-{res.step}"] + (["best-tau"] if best is not None and best.key == res.key else [])
    run.log_artifact(art, aliases=aliases)
    return True


def _log_results(run, run_id: str, todo: list[RunResult], all_results: list[RunResult], target: WandbTarget) -> None:
    series = series_of(all_results, target.primary_suite)
    best = _best(all_results, series)
    logged_ckpts: set[str] = set()
    for res in sorted(todo, key=lambda r: (r.step, r.record_key)):
        run.log({**run_log(res.result, None, series=series[res.key]), **lag_scalars(res)})
        digest = res.result["checkpoint"].get("digest") or res.result["checkpoint"]["path"]
        if digest not in logged_ckpts:
            logged_ckpts.add(digest)
            _log_checkpoint(run, run_id, res, best, upload=target.upload_checkpoints)


def _finish(run) -> None:
    import wandb

    run.finish()
    # finish() can return before wandb-core has flushed the last block of the .wandb log
    # (seen with 0.31: a torn final record); teardown waits for the service to exit.
    wandb.teardown()


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=1), durable=False)


def rebuild_offline(run_id: str, results: list[RunResult], target: WandbTarget) -> dict:
    """Write one complete offline run for ``run_id`` and make it the current build. Caller holds the lock."""
    import wandb  # noqa: F401  (a missing wandb fails here, before a build directory is made)

    eid = eval_run_id(run_id)
    builds = target.root / "builds" / eid
    build = builds / f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    (build / "data").mkdir(parents=True)
    try:
        with _env(WANDB_DATA_DIR=str(build / "data")):
            run = _init(target, run_id, build, results)
            try:
                _log_results(run, run_id, results, results, target)
            finally:
                _finish(run)
        run_dirs = sorted((build / "wandb").glob(f"offline-run-*-{eid}"))
        if len(run_dirs) != 1:
            raise SinkError(f"expected one offline run in {build / 'wandb'}, found {len(run_dirs)}")
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    run_dir = run_dirs[0]
    pointer = {"eval_run_id": eid, "train_run": run_id, "mode": "offline", "run_dir": str(run_dir),
               "wandb_file": str(run_dir / f"run-{eid}.wandb"), "records": [r.key for r in results],
               "steps": sorted({r.step for r in results}), "published_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "sync": f"wandb sync {target.root / eid}", "target": target.identity()}
    _write_json(target.root / f"{eid}.json", pointer)
    link, tmp_link = target.root / eid, target.root / f".{eid}.link-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp_link.unlink()
    tmp_link.symlink_to(run_dir)
    os.replace(tmp_link, link)  # atomic switch: the link always names a complete run
    for old in builds.iterdir():
        if old != build:
            shutil.rmtree(old, ignore_errors=True)
    return pointer


def append_online(run_id: str, results: list[RunResult], target: WandbTarget) -> dict:
    """Log the records not yet sent to the live run. Caller holds the lock."""
    eid = eval_run_id(run_id)
    state_path = target.root / f"{eid}.online.json"
    state = read_json(state_path) or {"eval_run_id": eid, "records": []}
    done = set(state["records"])
    todo = [r for r in results if r.key not in done]
    if todo:
        run = _init(target, run_id, target.root, results, resume="allow")
        try:
            _log_results(run, run_id, todo, results, target)
        finally:
            _finish(run)
        state["records"] = sorted(done | {r.key for r in todo})
        state["published_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        state["target"] = target.identity()
        _write_json(state_path, state)
    return {"eval_run_id": eid, "mode": "online", "logged": [r.key for r in todo], "records": state["records"]}


def publish_run(run_id: str, target: WandbTarget, *, results_dir: str | os.PathLike, redis_url: str | None = None,
                force: bool = False, lock_wait_s: float = 600.0) -> dict:
    """Bring the eval run of ``run_id`` up to date with the ledger (the whole publication)."""
    if target.mode == "disabled":
        return {"mode": "disabled", "eval_run_id": eval_run_id(run_id)}
    target.root.mkdir(parents=True, exist_ok=True)
    eid = eval_run_id(run_id)
    with writer_lock(eid, redis_url=redis_url, lock_dir=target.root, wait_s=lock_wait_s) as kinds:
        held = {"lock": kinds, "locked_at": time.time()}  # the tests check that holders never overlap
        # Read the ledger only once we hold the lock: a writer that waited sees every
        # record written meanwhile, so concurrent publications coalesce instead of racing.
        results = load_run(run_id, results_dir)
        if target.mode == "online":
            info = append_online(run_id, results, target)
        else:
            current = read_json(target.root / f"{eid}.json")
            if (not force and current and set(current.get("records", [])) == {r.key for r in results}
                    and Path(current.get("wandb_file", "")).is_file()):
                info = {**current, "skipped": "up to date"}
            else:
                info = rebuild_offline(run_id, results, target)
        held["unlocked_at"] = time.time()
        _append_log(target.root / f"{eid}.publications.jsonl", {
            **held, "pid": os.getpid(), "mode": target.mode, "skipped": bool(info.get("skipped")),
            "records": info.get("records", [])})
        return {**info, **held}


def _append_log(path: Path, entry: dict) -> None:
    """One line per publication (an audit trail; written while the lock is held)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


def saved_identity(run_id: str, root: Path) -> dict:
    """The project/entity/group/name/tags the last publication of ``run_id`` used (or {})."""
    eid = eval_run_id(run_id)
    for name in (f"{eid}.json", f"{eid}.online.json"):
        data = read_json(root / name)
        if data and isinstance(data.get("target"), dict):
            return data["target"]
    return {}


@register
class WandbSink(Sink[WandbTarget]):
    """W&B: the job's ``wandb`` block; the worker's ``$DFLASH_WANDB_TIMEOUT_S``."""

    name = "wandb"
    label = "W&B"

    def target(self, cfg: dict | None, settings: Settings, **over: Any) -> WandbTarget:
        """`over`: `mode` (over the settings' and the job's), `root` (the local W&B directory), `identity_of`: a
        run whose last publication's project/entity/name/tags are the base under `cfg` (`dflash-eval publish`
        keeps a run where it was)."""
        o = self._options(over, "mode", "root", "identity_of")
        if o["identity_of"] is not None:
            root = Path(o["root"]).expanduser().resolve() if o["root"] else settings.wandb_dir
            cfg = {**saved_identity(o["identity_of"], root), **(cfg or {})}
        return target_from(cfg, settings, mode=o["mode"], root=o["root"])

    def target_from_json(self, data: dict) -> WandbTarget:
        return WandbTarget.from_json(data)

    def publish_run(self, run_id: str, target: WandbTarget, *, results_dir: str | os.PathLike,
                    redis_url: str | None = None, force: bool = False, lock_wait_s: float = 600.0) -> dict:
        return publish_run(run_id, target, results_dir=results_dir, redis_url=redis_url, force=force,
                           lock_wait_s=lock_wait_s)

    def summary(self, info: dict, target: WandbTarget) -> list[str]:
        if info.get("mode") == "disabled":
            return ["W&B is disabled (WANDB_MODE=disabled); nothing published"]
        if target.mode == "online":
            return [f"eval run {info['eval_run_id']}: logged {len(info['logged'])} missing record(s), "
                    f"{len(info['records'])} in total (project {target.project})"]
        what = "already up to date" if info.get("skipped") else "rebuilt"
        return [f"eval run {info['eval_run_id']} {what}: steps {', '.join(map(str, info['steps']))}",
                f"  offline run: {info['run_dir']}",
                f"  to upload:   {info['sync']}"]

    def timeout_s(self, settings: Settings) -> float:
        return settings.wandb_timeout_s

    def skipped(self, target: WandbTarget) -> dict | None:
        return {"mode": "disabled"} if target.mode == "disabled" else None
