"""Published checkpoints: the one contract between the trainer (and its hooks) and the eval worker.

Torch-free on purpose: `dflash-eval enqueue`, the job schema, pin/unpin and the worker's
checks read a JSON marker and hash files, and must not pay for importing torch. Writing
and reading the weights themselves is `dflash_train.checkpoints.checkpoint` (safetensors, torch).

Layout (docs/design.md, "Published eval checkpoint")::

    <checkpoint_root>/<run_id>/step-<step:08d>/
        config.json, model.safetensors     the drafter (published DFlash layout)
        COMPLETE.json                      the manifest, written last
        .pins/<token>                      retention pins (one per eval job that may read it)

An *import record* is a published checkpoint whose files live elsewhere: a drafter trained
by another tool (a z-lab release, a SpecForge output directory, a Hugging Face cache
snapshot) gets `<checkpoint_root>/<run_id>/step-<step:08d>/COMPLETE.json` alone, with
`"source": "<real path of the drafter directory>"` and the digests of the source's files;
nothing is written into the source (it may be read-only). Every reader resolves the files
through `files_dir(directory, manifest)`, so verification, confinement (the source's files
must lie inside the roots too), pins and retention treat both kinds alike.

A checkpoint is published by writing a hidden temporary directory
`.step-<step:08d>.tmp-<pid>-<random>`, fsyncing it, renaming it into place and only then writing
COMPLETE.json (a fsynced temporary file and a rename). A directory without the marker is
never a checkpoint: never enqueued, never evaluated, removed by the next run's cleanup.
Two publishers of one (run, step) (two trainers on one run, a watcher and an `import`): the
rename and the marker are placed under an exclusive lock on the run directory (`_placing`), so
exactly one wins; the other is told who published it (`published_by` in the manifest), and a
marker never stands over another publisher's files.

Run ids name directories, Redis keys and job ids: `RUN_ID_PATTERN`, checked by the
trainer's config, the job schema and the ledger alike.

The same layout lives in an object store under a URL prefix (`s3://bucket/runs/<run_id>/
step-<step:08d>/...`, see `storage.py`). A store has no atomic directory rename, so the
marker is the commit point: `upload_checkpoint` takes the step's upload lease (an object created
only if absent: S3 `If-None-Match: *`), uploads every file of a published local checkpoint, then
COMPLETE.json last, again created only if absent; a second uploader of the step is refused with
who holds it, never overwrites. A prefix without the marker is never a checkpoint
(an interrupted upload is ignored by readers and removed by `cleanup_incomplete`). Reading
the manifest, listing, pins, retention and cleanup take a URL wherever they take a directory:
they are written once against `storage.Store`, whose kind (local directory, object store,
read-only Hub) `storage.store_for` picks once per location.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from dflash_train.common import jsonutil, urls
from dflash_train.common.errors import CheckpointError, StoreError
from dflash_train.common.fsutil import atomic_write_json, fsync_path, pid_alive

from . import storage
from .location import CheckpointRef, Roots, real_paths_within

# Published checkpoints are read by eval workers that may run as another user: every file is
# 0644 and every directory we create 0755, whatever the umask (safetensors alone writes 0600).
FILE_MODE, DIR_MODE = 0o644, 0o755
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"  # older transformers' save_pretrained: converted by import, never evaluated as is
CONFIG_NAME = "config.json"
MARKER_NAME = "COMPLETE.json"
MANIFEST_FORMAT = "dflash-checkpoint/1"
PINS_DIR = ".pins"

RUN_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
RUN_ID_RULE = "1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit, no '..'"
_RUN_ID = re.compile(rf"^{RUN_ID_PATTERN}$")
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
TMP_DIR = re.compile(r"^\.step-(\d{8,})\.tmp-(\d+)(?:-[0-9a-f]+)?$")
UPLOAD_LEASE = ".upload-lease"  # inside a step prefix of a store: who is uploading it (removed once marked)

class MissingBucket(CheckpointError):
    """A store location whose bucket does not exist (not merely an unpublished step): the message names it."""


# CheckpointError is defined in the kernel (common/errors.py: the Hub raises it too), named here
__all__ = ["CheckpointError", "MissingBucket"]


# --------------------------------------------------------------------------- names

def valid_run_id(run_id: object) -> bool:
    """Whether `run_id` may name a run (a directory, a Redis key part, a job id part)."""
    return isinstance(run_id, str) and bool(_RUN_ID.match(run_id)) and ".." not in run_id


def check_run_id(run_id: object) -> str:
    if not valid_run_id(run_id):
        raise CheckpointError(f"invalid run id {run_id!r}: {RUN_ID_RULE}")
    return run_id  # type: ignore[return-value]


def run_id_from(text: str, default: str = "run") -> str:
    """A valid run id made from free text (an HF run name, a directory name)."""
    rid = re.sub(r"[^A-Za-z0-9._-]", "_", str(text)).lstrip("._-")
    rid = re.sub(r"\.{2,}", ".", rid)[:128]
    return rid if valid_run_id(rid) else default


def step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


def checkpoint_step(directory: str | Path) -> int | None:
    """The step a `step-NNNNNNNN` directory name stands for, else None."""
    m = _STEP_DIR.match(urls.name(os.fspath(directory)))
    return int(m.group(1)) if m else None


def _step_of(directory: str | Path) -> int:
    """The step of a location already known to be a step directory (a sort key)."""
    step = checkpoint_step(directory)
    assert step is not None, directory
    return step


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weights_digest(files: dict[str, str]) -> str:
    """The checkpoint's digest from its files' digests: that of `model.safetensors`, or for a
    sharded drafter (an index and shards) a sha256 over `name:digest` lines of the shards in
    name order. One definition, for the manifest, `run` on a plain directory and the worker."""
    if WEIGHTS_NAME in files:
        return files[WEIGHTS_NAME]
    h = hashlib.sha256()
    for name in sorted(n for n in files if n.endswith(".safetensors")):
        h.update(f"{name}:{files[name]}\n".encode())
    return h.hexdigest()


def drafter_files(directory: str | Path) -> list[str]:
    """The files that make a drafter directory (config.json and its weights: one
    `model.safetensors`, or an index and the shards it names); CheckpointError naming what is missing."""
    directory = Path(directory)
    if not (directory / CONFIG_NAME).is_file():
        raise CheckpointError(f"{directory} is not a drafter directory: missing {CONFIG_NAME}")
    if (directory / WEIGHTS_NAME).is_file():
        return [CONFIG_NAME, WEIGHTS_NAME]
    index = directory / INDEX_NAME
    if not index.is_file():
        if (directory / BIN_NAME).is_file() or (directory / f"{BIN_NAME}.index.json").is_file():
            raise CheckpointError(f"{directory} holds {BIN_NAME} weights, not {WEIGHTS_NAME}: drafters are evaluated "
                                  f"from safetensors; `dflash-eval import {directory}` converts a single {BIN_NAME} "
                                  "(read with torch.load(weights_only=True), no code run)")
        raise CheckpointError(f"{directory} is not a drafter directory: missing {WEIGHTS_NAME} (or {INDEX_NAME})")
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: unreadable ({e})") from None
    bad = [s for s in shards if not isinstance(s, str) or os.sep in s or s.startswith(".")]
    if bad:
        raise CheckpointError(f"{index}: shard names {bad[:3]} leave the directory")
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        raise CheckpointError(f"{directory}: shards {missing[:3]} listed in {INDEX_NAME} are missing")
    return [CONFIG_NAME, INDEX_NAME, *shards]


# --------------------------------------------------------------------------- publishing

def _run_dir(checkpoint_root: str | Path, run_id: str) -> Path:
    check_run_id(run_id)
    run_dir = Path(checkpoint_root) / run_id
    if not run_dir.is_dir():
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir, DIR_MODE)
    return run_dir


def publisher() -> str:
    """Who publishes, as the manifest (`published_by`) and a losing publisher's error name it."""
    return f"{socket.gethostname()} pid {os.getpid()}"


@contextlib.contextmanager
def _placing(run_dir: Path) -> Iterator[None]:
    """An exclusive lock on `run_dir` while a step is checked, renamed into place and marked.

    Two publishers of one (run, step), threads or processes, then see each other's marker whole:
    exactly one renames and marks, the other is refused (`_refuse_published`). flock on the directory
    itself leaves nothing behind; where a directory opened read-only cannot be locked (NFS emulates
    flock with write locks), a `.publish.lock` file in it is locked instead."""
    import fcntl

    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.close(fd)
            fd = -1
            fd = os.open(run_dir / ".publish.lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # releases the lock


def _refuse_published(final: Path, accept: Callable[[dict], bool] | None = None) -> bool:
    """False when `final` holds no marker; True when its manifest is one `accept` takes as this very
    publication (the same drafter imported again); else CheckpointError naming who published it."""
    if not (final / MARKER_NAME).exists():
        return False
    try:
        old = read_manifest(final)
    except CheckpointError:
        old = {}
    if accept is not None and old and accept(old):
        return True
    who = old.get("published_by") or "another publisher"
    when = f" at {old['created_at']}" if old.get("created_at") else ""
    what = f" (digest {old['digest'][:12]}...)" if isinstance(old.get("digest"), str) else ""
    raise CheckpointError(f"{final} is already published by {who}{when}{what}; a step is published once: "
                          "publish this one under another run or step")


def _place(run_dir: Path, step: int, write_files: Callable[[Path], object],
           manifest_for: Callable[[Path, dict[str, str]], dict], *,
           accept: Callable[[dict], bool] | None = None) -> tuple[Path, bool]:
    """Write into a fresh temporary directory, fsync, then under `_placing`: rename to `step-<step>`
    and write its marker (`manifest_for(final, digests of its files)`); (its path, written now).

    A step already marked is refused (or returned, not written, when `accept` takes its manifest);
    a `step-<step>` without a marker (a crashed earlier attempt) is replaced. The temporary directory
    never outlives the call."""
    final = run_dir / step_dir_name(step)
    if _refuse_published(final, accept):  # before writing gigabytes for nothing; checked again when placing
        return final, False
    tmp = run_dir / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"  # unique: threads share a pid
    tmp.mkdir()
    try:
        write_files(tmp)
        os.chmod(tmp, DIR_MODE)
        files = {}
        for p in sorted(tmp.iterdir()):
            os.chmod(p, FILE_MODE)
            fsync_path(p)
            files[p.name] = sha256_file(p)
        fsync_path(tmp)
        with _placing(run_dir):
            if _refuse_published(final, accept):
                return final, False
            if final.exists():  # renamed but never marked: a crashed earlier attempt (no one else holds the lock)
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_path(run_dir)
            try:
                atomic_write_json(final / MARKER_NAME, manifest_for(final, files), mode=FILE_MODE)
            except BaseException:
                shutil.rmtree(final, ignore_errors=True)  # never a step directory left for the next one to guess at
                raise
        return final, True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _manifest(run_id: str, step: int, files: dict[str, str], config: dict, train_metrics: dict | None,
              **extra) -> dict:
    return {"format": MANIFEST_FORMAT, "run_id": run_id, "step": int(step), "digest": weights_digest(files),
            "files": files, "config": config, "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "published_by": publisher(), "train_metrics": dict(train_metrics or {}), **extra}


def publish_directory(checkpoint_root: str | Path, run_id: str, step: int, write_files: Callable[[Path], object], *,
                      train_metrics: dict | None = None, extra: dict | None = None,
                      accept: Callable[[dict], bool] | None = None) -> Path:
    """Atomically publish `<root>/<run_id>/step-<step:08d>/`; returns its path.

    `write_files(tmp_dir)` writes the checkpoint's files (config.json, the weights) into a
    fresh temporary directory. Publishing a step that is already complete is an error naming
    its publisher (also when another publisher wins the race for it meanwhile), unless `accept`
    takes the existing manifest as this publication (then its path is returned, nothing written);
    a leftover without a marker is replaced.
    """
    final, _ = _place(_run_dir(checkpoint_root, run_id), step, write_files,
                      lambda final, files: _manifest(run_id, step, files,
                                                     json.loads((final / CONFIG_NAME).read_text()), train_metrics,
                                                     **(extra or {})),
                      accept=accept)
    return final


def import_directory(checkpoint_root: str | Path, run_id: str, step: int, source: str | Path, *,
                     train_metrics: dict | None = None) -> tuple[Path, bool]:
    """Record a drafter directory trained elsewhere as `<root>/<run_id>/step-<step:08d>/`
    (an import record: COMPLETE.json alone, `source` naming the directory, the digests of its
    files); returns (the record's path, whether it was written now).

    Nothing is written into `source` (it may be read-only). Importing the same files again
    returns the existing record; a different drafter at a recorded (run, step) is an error.
    """
    src = Path(os.path.realpath(os.path.expanduser(str(source))))
    if not src.is_dir():
        raise CheckpointError(f"{source} is not a directory")
    if (src / MARKER_NAME).exists():
        raise CheckpointError(f"{source} is already a published checkpoint (it has {MARKER_NAME}); "
                              "enqueue it as it is")
    files = {name: sha256_file(src / name) for name in drafter_files(src)}
    try:
        config = jsonutil.loads((src / CONFIG_NAME).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{src / CONFIG_NAME}: unreadable ({e})") from None
    run_dir = _run_dir(checkpoint_root, run_id)
    existing = run_dir / step_dir_name(step)
    if (existing / MARKER_NAME).exists():
        old = read_manifest(existing)
        if old.get("source") == str(src) and old["files"] == files:
            return existing, False
        raise CheckpointError(f"{existing} already records {old.get('source') or 'a published checkpoint'} "
                              f"(digest {old['digest'][:12]}...); import this drafter under another run or step")
    return _place(run_dir, step, lambda tmp: None,
                  lambda final, _: _manifest(run_id, step, files, config, train_metrics, source=str(src)),
                  accept=lambda m: m.get("source") == str(src) and m.get("files") == files)


_STEP_IN_NAME = re.compile(r"(?:^|[_-])(?:step|checkpoint|ckpt|iter)[_-]?(\d+)$", re.IGNORECASE)


def import_name(source: str | Path) -> tuple[str, int]:
    """The (run id, step) an import record gets by default, read off the source's path: a
    Hugging Face cache snapshot `.../models--ORG--NAME/snapshots/REV` -> (`ORG--NAME-REV[:8]`, 0);
    a step directory of a trainer (`epoch_0_step_1000` (SpecForge), `checkpoint-500` (HF
    Trainer)) -> (its parent's name, that step); anything else -> (its name, 0)."""
    p = Path(os.path.abspath(os.path.expanduser(str(source))))
    parts = p.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return run_id_from(f"{parts[-3][len('models--'):]}-{parts[-1][:8]}", default="import"), 0
    m = _STEP_IN_NAME.search(p.name)
    if m and p.parent.name:
        return run_id_from(p.parent.name, default="import"), int(m.group(1))
    return run_id_from(p.name, default="import"), 0


def files_dir(directory: str | Path, manifest: dict) -> Path:
    """Where a checkpoint's listed files are: the import record's `source`, else the directory itself."""
    return Path(manifest["source"]) if manifest.get("source") else Path(directory)


# --------------------------------------------------------------------------- reading and verifying

def read_manifest(directory: str | Path) -> dict:
    """The manifest of a published checkpoint (a directory or a URL); CheckpointError if it is not one."""
    return parse_manifest(read_marker(directory), directory)


def _located(location: str | Path) -> tuple[storage.Store, str | Path]:
    """The store of a checkpoint location (what it writes on a local disk gets the published modes) and
    the location as it names it (a canonical URL, a Path)."""
    store = storage.store_for(location, file_mode=FILE_MODE, dir_mode=DIR_MODE)
    return store, store.location(location)


def read_marker(directory: str | Path) -> bytes:
    """The bytes of a checkpoint's COMPLETE.json (local or in a store); CheckpointError when there is none.

    A read-only store whose files are fixed at one revision (the Hub) has no marker: it is derived from
    the drafter's files there (`_derived_marker`). A store that cannot be reached raises
    storage.StoreUnavailable (retryable)."""
    store, directory = _located(directory)
    snapshot = store.snapshot(directory)
    if snapshot is not None:
        return _derived_marker(snapshot)
    try:
        return store.read_bytes(store.join(directory, MARKER_NAME))
    except FileNotFoundError:
        problem = storage.missing_bucket(directory)  # not "no marker": no bucket
        if problem:
            raise MissingBucket(problem) from None
        raise CheckpointError(f"{directory}: no {MARKER_NAME}; not a published checkpoint "
                              "(still being written or uploaded, or abandoned)") from None
    except storage.StoreUnavailable:
        raise
    except OSError as e:
        raise CheckpointError(f"{store.join(directory, MARKER_NAME)}: unreadable marker ({e})") from None


def _derived_marker(snapshot: storage.Snapshot) -> bytes:
    """COMPLETE.json bytes for a drafter directory fixed at one revision: its files and their sha256,
    the run id made from `snapshot.name`, step 0, and `snapshot.fields` (the Hub repo and commit).
    Deterministic (no time in it): the bytes are the worker's cache key."""
    files = {name: sha256_file(snapshot.directory / name) for name in drafter_files(snapshot.directory)}
    try:
        config = jsonutil.loads((snapshot.directory / CONFIG_NAME).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{snapshot.directory / CONFIG_NAME}: unreadable ({e})") from None
    manifest = {"format": MANIFEST_FORMAT, "run_id": run_id_from(snapshot.name), "step": 0,
                "digest": weights_digest(files), "files": files, "config": config, "train_metrics": {},
                **snapshot.fields}
    return json.dumps(manifest, sort_keys=True, indent=2).encode()


def parse_manifest(raw: bytes, directory: str | Path = "checkpoint") -> dict:
    """The manifest in marker bytes `raw`, checked; CheckpointError naming `directory` if invalid."""
    marker = urls.join(os.fspath(directory), MARKER_NAME)
    try:
        data = jsonutil.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{marker}: unreadable marker ({e})") from None
    problems = []
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{marker}: format is not {MANIFEST_FORMAT!r}")
    if not isinstance(data.get("step"), int) or data["step"] < 0:
        problems.append("step must be a non-negative integer")
    if not isinstance(data.get("digest"), str) or len(data["digest"]) != 64:
        problems.append("digest must be a sha256 hex string")
    files = data.get("files")
    if (not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values())
            or not (WEIGHTS_NAME in files or INDEX_NAME in files)):
        problems.append(f"files must list {WEIGHTS_NAME} (or {INDEX_NAME} and its shards)")
    elif weights_digest(files) != data.get("digest"):
        problems.append("digest differs from the weights' digest in files")
    elif any(not isinstance(n, str) or not n or "/" in n or os.sep in n or n.startswith(".") or n == MARKER_NAME
             or not isinstance(d, str) or len(d) != 64 for n, d in files.items()):
        problems.append("files must map plain file names to sha256 hex digests")
    source = data.get("source")
    if source is not None and (not isinstance(source, str) or not os.path.isabs(source) or "\x00" in source):
        problems.append("source must be an absolute path")
    if not isinstance(data.get("run_id"), str):
        problems.append("run_id missing")
    if problems:
        raise CheckpointError(f"{marker}: invalid manifest: " + "; ".join(problems))
    return data


def within(path: str | os.PathLike, roots: Iterable[Path | str | CheckpointRef]) -> Path | None:
    """The real path of `path` (symlinks resolved) if it lies inside one of `roots`, else None."""
    inside = CheckpointRef.parse(Path(path)).within(roots)  # a Path: never taken for a URL, never cleaned
    return inside.path if inside is not None else None


def verify_checkpoint(directory: str | Path, roots: Roots | None = None,
                      manifest: dict | None = None) -> dict:
    """`read_manifest` (or the `manifest` the caller just read from it) plus a sha256 check of every listed
    file; returns the manifest.

    With `roots`, every listed file must also lie inside them once symlinks are resolved
    (a checkpoint may not point the worker at files elsewhere; an import record's source
    files are checked the same way).
    """
    directory = Path(directory)
    manifest = read_manifest(directory) if manifest is None else manifest
    where = files_dir(directory, manifest)
    listed = sorted(manifest["files"].items())
    for name, _ in listed:
        if os.sep in name or name.startswith("."):
            raise CheckpointError(f"{directory}: {MARKER_NAME} lists a file outside the directory: {name!r}")
    # every file confined at once (the roots parsed once, not per file)
    inside = real_paths_within([where / n for n, _ in listed], roots) if roots is not None else None
    for i, (name, want) in enumerate(listed):
        path = where / name
        if inside is not None and inside[i] is None:
            raise CheckpointError(f"{directory}: {path} resolves to {os.path.realpath(path)}, outside the "
                                  "checkpoint roots; a symlink may not lead out of the roots (an imported "
                                  "drafter's directory must lie in a checkpoint root too)")
        if not path.is_file():
            raise CheckpointError(f"{directory}: {path} listed in {MARKER_NAME} is missing")
        got = sha256_file(path)
        if got != want:
            raise CheckpointError(f"{directory}: {path if where != directory else name} digest mismatch "
                                  f"(manifest {str(want)[:12]}..., file {got[:12]}...): modified or corrupt")
    return manifest


def list_checkpoints(run_dir: str | Path) -> list:
    """Published (marked) checkpoints of a run directory or run URL, oldest step first
    (Paths for a directory, URLs for a store)."""
    store, run_dir = _located(run_dir)
    steps = [store.join(run_dir, n) for n in store.list_names(run_dir) if _STEP_DIR.match(n)]
    return sorted((s for s in steps if MARKER_NAME in store.list_names(s)), key=_step_of)


# --------------------------------------------------------------------------- object stores

def upload_checkpoint(directory: str | Path, run_url: str, *, verify: bool = True) -> str:
    """Copy a published local checkpoint to `<run_url>/step-<step:08d>/`; returns that URL.

    The step's upload lease is taken first (`UPLOAD_LEASE`, created only if absent), then every
    listed file is uploaded (and its size checked against the store), then COMPLETE.json, byte
    for byte, last and again only if absent: the marker is the commit point, so a reader sees the
    whole checkpoint or none, and two uploaders of one step never both succeed nor mix their files.
    The loser gets CheckpointError naming who holds or published the step. An earlier interrupted
    upload of the same step (objects but no marker, no live lease) is removed first.
    """
    directory = Path(directory)
    raw = read_marker(directory)
    manifest = parse_manifest(raw, directory)
    if verify:
        verify_checkpoint(directory)
    run_url = storage.check_url(run_url)
    check_run_id(urls.name(run_url))
    store, _ = _located(run_url)
    store.check_writable(run_url)
    dest = urls.join(run_url, step_dir_name(manifest["step"]))
    marker = store.join(dest, MARKER_NAME)
    _refuse_uploaded(store, dest)
    lease = _take_lease(store, dest, manifest["digest"])
    try:
        # another uploader may have marked the step and released its lease between our first look and our lease
        _refuse_uploaded(store, dest)
        leftovers = [n for n in store.list_names(dest) if n != UPLOAD_LEASE]  # an interrupted earlier upload
        for name in leftovers:
            store.remove(store.join(dest, name), recursive=True)
        where = files_dir(directory, manifest)
        if manifest.get("source"):  # an import record: in the store its files lie beside the marker
            raw = json.dumps({k: v for k, v in manifest.items() if k != "source"}, indent=2).encode()
        for file_name in sorted(manifest["files"]):
            url = store.join(dest, file_name)
            store.put_file(where / file_name, url)
            want, got = (where / file_name).stat().st_size, store.size(url)
            if got != want:
                raise storage.StoreUnavailable(f"{url}: the store holds {got} bytes after uploading {want}")
        if not store.create_bytes(marker, raw):  # only if the lease was taken over meanwhile
            _refuse_uploaded(store, dest)
            raise CheckpointError(f"{dest} was published by another uploader meanwhile")
    finally:
        _release_lease(store, dest, lease)
    return dest


def _refuse_uploaded(store: storage.Store, dest: str) -> None:
    """CheckpointError naming the publisher when `dest` is already marked in the store."""
    try:
        raw = store.read_bytes(store.join(dest, MARKER_NAME))
    except FileNotFoundError:
        return
    try:
        old = json.loads(raw)
    except ValueError:
        old = {}
    who = old.get("published_by") if isinstance(old, dict) else None
    when = f" at {old['created_at']}" if isinstance(old, dict) and old.get("created_at") else ""
    raise CheckpointError(f"{dest} is already published by {who or 'another uploader'}{when}; a step is uploaded "
                          "once: upload this one under another run or step")


def _take_lease(store: storage.Store, dest: str, digest: str) -> bytes:
    """Create the step's upload lease (who, when, what) or CheckpointError naming its holder.

    A lease left by a dead process of this host is taken over; any other lease stands until its
    upload ends (the trainer's start-up `cleanup_incomplete` removes one whose uploader died)."""
    lease = store.join(dest, UPLOAD_LEASE)
    body = json.dumps({"by": publisher(), "host": socket.gethostname(), "pid": os.getpid(), "digest": digest,
                       "token": secrets.token_hex(8), "at": datetime.now(UTC).isoformat(timespec="seconds")},
                      sort_keys=True).encode()
    for _ in range(3):
        if store.create_bytes(lease, body):
            return body
        _refuse_uploaded(store, dest)
        try:
            held = json.loads(store.read_bytes(lease))
        except FileNotFoundError:
            continue  # released meanwhile: try again
        except ValueError:
            held = {}
        if not isinstance(held, dict):
            held = {}
        if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int) \
                and not pid_alive(held["pid"]):
            store.remove(lease)  # its uploader died on this host
            continue
        raise CheckpointError(f"{dest} is being uploaded by {held.get('by') or 'another uploader'} since "
                              f"{held.get('at') or '?'}; a step is uploaded once (if that upload died, the trainer's "
                              f"next start removes it, or remove {store.join(dest, UPLOAD_LEASE)})")
    raise CheckpointError(f"{dest}: could not take its upload lease (others kept taking it); try again")


def _release_lease(store: storage.Store, dest: str, body: bytes) -> None:
    """Remove the lease if it is still this upload's (never one another uploader took over)."""
    lease = store.join(dest, UPLOAD_LEASE)
    with contextlib.suppress(FileNotFoundError, StoreError, OSError):
        if store.read_bytes(lease) == body:
            store.remove(lease)


# --------------------------------------------------------------------------- pins and retention

def _check_token(token: str) -> None:
    if not token or "/" in token or token.startswith("."):
        raise CheckpointError(f"invalid pin token {token!r}")


def pin_checkpoint(directory: str | Path, token: str) -> bool:
    """Keep `directory` through retention until `unpin_checkpoint(directory, token)`.

    Returns False when the pin cannot be written (no such checkpoint, a read-only mount or
    store): the checkpoint is then only less protected, never refused.
    """
    _check_token(token)
    try:
        store, directory = _located(directory)
        if store.read_only:
            return False  # nothing to protect: the Hub keeps every commit
        if not store.exists(store.join(directory, MARKER_NAME)):
            return False
        store.write_bytes(store.join(directory, PINS_DIR, token), b"")
    except (StoreError, OSError):
        return False
    return True


def unpin_checkpoint(directory: str | Path, token: str) -> bool:
    """Release pin `token` (True if one was removed); a missing pin or checkpoint is not an error."""
    _check_token(token)
    try:
        store, directory = _located(directory)
        pin = store.join(directory, PINS_DIR, token)
        if store.read_only or not store.exists(pin):
            return False
        store.remove(pin)
    except (StoreError, OSError):
        return False
    return True


def has_pin(directory: str | Path, token: str) -> bool:
    """Whether pin `token` is on `directory` (False where pins cannot be kept: the Hub, a gone checkpoint)."""
    _check_token(token)
    try:
        store, directory = _located(directory)
        return not store.read_only and store.exists(store.join(directory, PINS_DIR, token))
    except (StoreError, OSError):
        return False


def is_pinned(directory: str | Path) -> bool:
    store, directory = _located(directory)
    return not store.read_only and bool(store.list_names(store.join(directory, PINS_DIR)))


def remove_checkpoint(directory: str | Path) -> None:
    """Invalidate first (marker gone), then delete: a reader never loads a half-deleted one."""
    store, directory = _located(directory)
    store.remove(store.join(directory, MARKER_NAME))
    store.remove(directory, recursive=True)


def apply_retention(run_dir: str | Path, keep_last: int, protect=None) -> list:
    """Delete published checkpoints (of a run directory or run URL) beyond the newest `keep_last` (0 keeps all).

    Kept regardless: pinned ones and those for which `protect(path)` is True.
    Returns the removed paths (URLs for a store).
    """
    if keep_last <= 0:
        return []
    removed = []
    for path in list_checkpoints(run_dir)[:-keep_last]:
        if is_pinned(path) or (protect is not None and protect(path)):
            continue
        if is_pinned(path):  # re-check just before deleting: a pin may have just landed
            continue
        remove_checkpoint(path)
        removed.append(path)
    return removed


def cleanup_incomplete(run_dir: str | Path) -> list:
    """Remove half-written publications of earlier runs (call before training starts).

    `step-*` directories or prefixes that never got their marker (an interrupted write or upload),
    and `.step-*.tmp-<pid>` directories of dead processes (or of this one: nothing is in flight yet).
    Returns the removed paths (URLs for a store).
    """
    store, run_dir = _located(run_dir)
    removed = []
    for n in store.list_names(run_dir):
        where = store.join(run_dir, n)
        m = TMP_DIR.match(n)
        stale_tmp = m is not None and (int(m.group(2)) == os.getpid() or not pid_alive(int(m.group(2))))
        unmarked = _STEP_DIR.match(n) is not None and MARKER_NAME not in store.list_names(where)
        if stale_tmp or unmarked:
            store.remove(where, recursive=True)
            removed.append(where)
    return removed
