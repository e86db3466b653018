"""Confinement: what a job names (checkpoint, target, suite file) must lie inside the roots the worker serves.

A job comes from whoever can reach the queue, and the worker reads what it names, so every
path is resolved (symlinks included) and checked against the configured roots; a store URL
against the store prefixes among them. Failures raise JobError with the reason.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from dflash_train.checkpoints.location import CheckpointRef, Roots
from dflash_train.checkpoints.publication import within
from dflash_train.common.errors import StoreError
from eval_worker.engine.options import shorten
from eval_worker.engine.suite import HF_PREFIX, SuiteError, parse_hf_spec
from eval_worker.service.jobs.schema import MAX_PATH, JobError


def confine(path: str | os.PathLike, roots: Roots, what: str = "checkpoint",
            how: str = "--checkpoint-root or $DFLASH_CHECKPOINT_ROOTS") -> Path | str:
    """The real path of `path` if it lies inside one of `roots` (symlinks resolved), else JobError.
    A store URL must lie under one of the URL prefixes among `roots` (then the canonical URL is returned)."""
    ref = confine_ref(path, roots, what, how)
    return ref.path if ref.on_this_machine else ref.text


def confine_ref(path: str | os.PathLike | CheckpointRef, roots: Roots, what: str = "checkpoint",
                how: str = "--checkpoint-root or $DFLASH_CHECKPOINT_ROOTS") -> CheckpointRef:
    """`path` parsed and confined to `roots` (CheckpointRef.within), else JobError saying which roots it missed."""
    try:
        ref = path if isinstance(path, CheckpointRef) else CheckpointRef.parse(path)
    except StoreError as e:
        raise JobError(f"{what}: {e}") from None
    inside = ref.within(roots)
    if inside is not None:
        return inside
    mine = ", ".join(r.shown for r in ref.same_kind(roots))
    if not ref.on_this_machine:
        raise JobError(f"{ref.shown} is outside the {what} prefixes this worker serves "
                       f"({mine or 'none: only local roots are configured'}); add its prefix with "
                       f"{how} (e.g. s3://bucket/runs)")
    real = Path(os.path.realpath(ref.text))
    shown = os.pathsep.join(str(r) for r in ref.same_kind(roots))
    if str(real) != ref.canonical:
        raise JobError(f"{path} resolves to {real}, outside the {what} roots ({shown}); "
                       "a symlink may not lead out of the roots")
    raise JobError(f"{path} is outside the {what} roots ({shown}); add its root with {how}")


def import_roots_problem(into: str | os.PathLike, roots: Sequence[Path | str]) -> str | None:
    """The one roots rule of `import`, `watch` and `enqueue --external` (docs/adoption.md): only the record
    root (`--into`, where converted checkpoints and import records go, read by the worker) must lie in a
    checkpoint root. A trainer's checkpoint is only read here: one outside the roots is converted into the
    record root (`converts_outside_roots`), never recorded in place. None when the rule holds, else the
    sentence to print."""
    if within(into, roots) is None:
        return (f"record root --into {into} is outside the checkpoint roots ({os.pathsep.join(map(str, roots))}); "
                "the worker reads records there and would refuse them: add it with --checkpoint-root / "
                "$DFLASH_CHECKPOINT_ROOTS")
    return None


def converts_outside_roots(source: str | os.PathLike, roots: Sequence[Path | str] | None) -> bool:
    """Whether a drafter directory that could be recorded in place is converted instead: it lies outside the
    roots the worker reads (with no roots known here, it is recorded in place and the roots it needs are named)."""
    return roots is not None and within(source, roots) is None


def check_target(target: str, default_target: str | None, target_roots: Sequence[Path | str] | None,
                 checkpoint_roots: Sequence[Path | str]) -> None:
    """A job may name the worker's own target, or one inside the target roots.

    Loading a target reads gigabytes and runs its tokenizer/config code paths, so a job may
    not point the worker at any directory it likes. Without target roots configured, the
    checkpoint roots stand in for them.
    """
    if default_target and os.path.realpath(target) == os.path.realpath(default_target):
        return
    if target_roots is not None:
        confine(target, target_roots, "target", "--target-root or $DFLASH_TARGET_ROOTS")
    else:
        confine(target, checkpoint_roots, "checkpoint",
                "--target-root or $DFLASH_TARGET_ROOTS (targets other than the worker's own --target must lie "
                "in a target root, or in a checkpoint root when no target root is set)")


def check_suite(suite: str, suite_roots: Sequence[Path | str] | None,
                checkpoint_roots: Sequence[Path | str] | None) -> str:
    """The suite a worker may load for a job: `builtin:NAME` (or a bare built-in name), a
    standard benchmark `hf:NAME[:...]` (read from the worker's dataset copies or the datasets
    cache, never from a path the job names), or a file whose real path lies in the suite roots
    (default: the checkpoint roots). Returns the spec to load (a bare name gets its `builtin:`
    prefix; a file its real path).

    A job comes from whoever can reach the queue, and a suite is read and parsed on the
    worker, so its path is confined like checkpoints and targets. Anything else fails with
    one message, whatever the path is (missing, unreadable, a directory, outside the roots,
    a symlink out): the reply tells nothing about the worker's files.
    """
    if isinstance(suite, str) and suite.startswith("builtin:"):
        return suite
    if isinstance(suite, str) and suite.startswith(HF_PREFIX):  # a standard benchmark: no path of the worker's
        try:
            return parse_hf_spec(suite).canonical
        except SuiteError as e:
            raise JobError(str(e)) from None
    if isinstance(suite, str) and suite and "/" not in suite and "\x00" not in suite and not suite.endswith(".jsonl"):
        return "builtin:" + suite  # a bare name: never looked up relative to the worker's working directory
    roots = suite_roots if suite_roots is not None else checkpoint_roots
    refused = JobError(f"suite {shorten(suite)} is not available on this worker: name a built-in suite "
                       "(builtin:NAME) or a suite file under the worker's suite roots "
                       "(--suite-root / $DFLASH_SUITE_ROOTS; default: the checkpoint roots)")
    if (not roots or not isinstance(suite, str) or len(suite) > MAX_PATH or "\x00" in suite
            or not os.path.isabs(suite)):
        raise refused
    real = within(suite, roots)
    if real is None or not real.is_file():
        raise refused
    return str(real)
