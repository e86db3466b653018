"""A job's checkpoints: checked where they are (confined, marked, digest equal to the job's) and,
on the worker, materialized for the engine (local ones verified in place, a store's pulled into the
checkpoint cache and verified file by file).

`checkpoint` and `baseline` may be URLs of an object store (`s3://bucket/runs/<run>/step-…`,
dflash_train/checkpoints/storage.py): confined to the store prefixes among the worker's checkpoint
roots, their marker read from the store, and the worker evaluates a local copy pulled into
its cache and verified file by file (:func:`materialize`).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.location import CheckpointRef, Roots
from dflash_train.checkpoints.publication import (
    MARKER_NAME,
    CheckpointError,
    MissingBucket,
    files_dir,
    parse_manifest,
    read_manifest,
    read_marker,
    verify_checkpoint,
)
from eval_worker.service.jobs.confinement import confine, confine_ref
from eval_worker.service.jobs.schema import JobError, JobPayload


def check_checkpoint(job: JobPayload, roots: Roots | None, *,
                     verify_digest: bool = False) -> dict[str, dict[str, Any]]:
    """Check the job's checkpoint on disk; return the manifests read, keyed by real path.

    - inside `roots` after resolving symlinks (skipped when `roots` is None);
    - a directory with a valid COMPLETE.json whose digest, run and step match the job;
    - with `verify_digest`, every listed file hashed again, each inside the roots (the
      worker does this, once per job: the engine is handed the verified manifests).
    The same is done for `baseline` when the job names one. A store URL is checked by its
    marker only (confined to the store prefixes); `materialize` pulls and verifies its files.
    """
    roots = CheckpointRef.parse_all(roots) if roots is not None else None  # once for both checkpoints
    path, manifest = check_location(job.checkpoint_ref, roots, verify_digest, "checkpoint")
    _match_job(job, manifest)
    manifests = {path: manifest}
    if job.baseline_ref is not None:
        base_path, base = check_location(job.baseline_ref, roots, verify_digest, "baseline")
        manifests[base_path] = base
    return manifests


def check_location(location: str | CheckpointRef, roots: Roots | None,
                   verify_digest: bool, what: str) -> tuple[str, dict[str, Any]]:
    """(real path or canonical URL, manifest) of a published checkpoint: confined to `roots` (unless
    None), its marker read; with `verify_digest` (local only) every file hashed again."""
    ref = location if isinstance(location, CheckpointRef) else _parsed(location, what)
    path = ref.text
    if not ref.on_this_machine:
        url, _, manifest = _check_remote(ref.text, roots, what)
        return url, manifest
    real = str(confine_ref(ref, roots).path) if roots is not None else os.path.realpath(path)
    if not os.path.isdir(real):
        raise JobError(f"{what}: checkpoint {path} does not exist or is not a directory")
    try:
        manifest = read_manifest(Path(real))
    except CheckpointError as e:
        hint = ""
        if not os.path.exists(os.path.join(real, MARKER_NAME)) and os.path.isfile(os.path.join(real, "config.json")):
            hint = ("; a drafter trained elsewhere (a z-lab release, a SpecForge output, a Hugging Face snapshot) "
                    f"is evaluated through an import record: `dflash-eval import {path}` (or `enqueue --external`)")
        raise JobError(f"{what}: checkpoint {path} is not published: {e}{hint}") from None
    if roots is not None and manifest.get("source"):  # an import record: its drafter is confined alike
        try:
            confine(files_dir(real, manifest), roots)
        except JobError as e:
            raise JobError(f"{what}: {path} records the drafter at {manifest['source']}: {e}") from None
    if verify_digest:
        try:
            verify_checkpoint(real, roots, manifest)
        except CheckpointError as e:
            raise JobError(f"{what}: {e}") from None
    return real, manifest


def _parsed(location: str, what: str) -> CheckpointRef:
    try:
        return CheckpointRef.parse(location)
    except storage.StoreError as e:
        raise JobError(f"{what}: {e}") from None


def _check_remote(url: str, roots: Roots | None, what: str) -> tuple[str, bytes, dict[str, Any]]:
    """(canonical url, marker bytes, manifest) of a checkpoint in a store, confined to the store
    prefixes among `roots`. A store that cannot be reached raises StoreUnavailable (retryable)."""
    url = str(confine(url, roots)) if roots is not None else storage.check_url(url)
    try:
        raw = read_marker(url)
        return str(url), raw, parse_manifest(raw, url)
    except MissingBucket as e:
        raise JobError(f"{what}: {e}") from None
    except CheckpointError as e:
        raise JobError(f"{what}: checkpoint {url} is not published: {e}") from None


@contextlib.contextmanager
def materialize(job: JobPayload, roots: Roots | None, cache=None, checked: dict[str, dict[str, Any]] | None = None):
    """What the worker evaluates: `(checkpoint dir, baseline dir or None, verified manifests)`.

    Local checkpoints: `check_checkpoint(..., verify_digest=True)` (the job's one hashing pass), or only
    the hashing pass when `checked` holds what the caller's `check_checkpoint` of this job returned
    (confined, marked, matched: not done twice). Store URLs: confined, the marker read and compared with
    the job, then a local copy from `cache` (a eval_worker.service.worker.checkpoint_cache.CheckpointCache;
    downloaded once per publication, every file's digest verified), held for the block so it is not evicted.
    """
    if all(ref.on_this_machine for ref in (job.checkpoint_ref, job.baseline_ref) if ref is not None):
        if checked is None:
            manifests = check_checkpoint(job, roots, verify_digest=True)
        else:
            manifests = {real: _verified(what, real, roots, manifest)
                         for what, (real, manifest) in zip(("checkpoint", "baseline"), checked.items(), strict=False)}
        yield job.checkpoint, job.baseline, manifests
        return
    if cache is None:
        raise JobError("this worker has no checkpoint cache to pull store checkpoints into")
    with contextlib.ExitStack() as stack:
        local: dict[str, str | None] = {"checkpoint": None, "baseline": None}
        verified: dict[str, dict[str, Any]] = {}
        roots = CheckpointRef.parse_all(roots) if roots is not None else None  # once for both checkpoints
        for key, ref in (("checkpoint", job.checkpoint_ref), ("baseline", job.baseline_ref)):
            if ref is None:
                continue
            where = ref.text
            if ref.on_this_machine:
                real, manifest = check_location(ref, roots, True, key)
                if key == "checkpoint":
                    _match_job(job, manifest)
            else:
                url, raw, manifest = _check_remote(where, roots, key)
                if key == "checkpoint":
                    _match_job(job, manifest)
                try:
                    entry, manifest = stack.enter_context(cache.checkout(url, raw))
                except CheckpointError as e:
                    raise JobError(f"{key}: {e}") from None
                real = os.path.realpath(entry)
            local[key], verified[real] = real, manifest
        yield local["checkpoint"], local["baseline"], verified


def _verified(what: str, real: str, roots: Roots | None, manifest: dict[str, Any]) -> dict[str, Any]:
    try:
        return verify_checkpoint(real, roots, manifest)
    except CheckpointError as e:
        raise JobError(f"{what}: {e}") from None


def _match_job(job: JobPayload, manifest: dict[str, Any]) -> None:
    digest = manifest.get("digest")
    if digest != job.checkpoint_digest:
        raise JobError(f"checkpoint {job.checkpoint}: digest in {MARKER_NAME} ({str(digest)[:12]}...) "
                       f"differs from the job's ({job.checkpoint_digest[:12]}...): "
                       "the checkpoint was replaced after the job was made")
    if int(manifest["step"]) != job.step:
        raise JobError(f"checkpoint {job.checkpoint} is step {manifest['step']}, the job says step {job.step}")
    if manifest["run_id"] != job.run_id:
        raise JobError(f"checkpoint {job.checkpoint} belongs to run {manifest['run_id']!r}, "
                       f"the job says {job.run_id!r}")
