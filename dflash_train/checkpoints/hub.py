"""Drafters published on the Hugging Face Hub as read-only checkpoint locations: `hf://ORG/REPO[@REVISION]`.

The Hub side of `storage.HubStore`: names (`parse`), a branch or tag pinned to its commit
(`resolve`), and the drafter's files at one commit fetched through huggingface_hub (`snapshot`:
its cache, `HF_TOKEN` / the stored login, `HF_HUB_OFFLINE`: all its own settings). The URL a job
carries names the commit, so the same job always means the same bytes. A Hub repository has no
COMPLETE.json: `publication.read_marker` derives one from the files of `snapshot` (their sha256,
the run id `ORG--REPO-<commit[:8]>`, step 0), and the worker's cache (checkpoint_cache) then
treats it like a store checkpoint. The Hub is never written to: `HubStore` refuses uploads, pins
and removals. Also here: targets named by a Hub model id (`resolve_target`).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from dflash_train.common.errors import CheckpointError, StoreError, StoreUnavailable
from dflash_train.common.urls import check_url

_REPO = re.compile(r"^hf://(\w[\w.-]*)/(\w[\w.-]*)(?:@([\w.-]+))?(?:/(.*))?$", re.ASCII)  # Hub names, not run ids
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hub cannot be reached now (offline mode, or its endpoint refuses / does not answer a TCP
    connection within `timeout`), else None. One connection, seconds at most: huggingface_hub and
    `datasets` retry for half a minute before they give up. Behind a proxy nothing is probed (None)."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if urllib.request.getproxies():  # the proxy variables, as urllib and requests read them
        return None
    url = urlsplit(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        return f"{constants.ENDPOINT} did not accept a connection within {timeout:.0f}s ({type(e).__name__}: {e})"
    return None


def parse(url: str) -> tuple[str, str | None, str | None]:
    """(repo id, revision or None, file path inside the repo or None) of an `hf://` URL."""
    m = _REPO.match(check_url(url))
    if m is None:
        raise StoreError(f"{url}: a Hub location is hf://ORG/REPO or hf://ORG/REPO@REVISION (a model repository)")
    return f"{m.group(1)}/{m.group(2)}", m.group(3), m.group(4)


def snapshot(repo_id: str, revision: str | None) -> Path:
    """The drafter's files at `revision`, in huggingface_hub's cache (downloaded when missing)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, repo_type="model",
                                      allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json"]))
    except RepositoryNotFoundError as e:
        raise CheckpointError(f"hf://{repo_id}: no such model repository, or no access to it "
                              f"(a gated or private repo needs HF_TOKEN): {e}") from None
    except LocalEntryNotFoundError as e:  # offline, and not in the cache
        raise StoreUnavailable(f"hf://{repo_id}@{revision or 'main'}: not in the Hugging Face cache and the Hub "
                               f"is not reachable (HF_HUB_OFFLINE?): {e}") from None
    except (HfHubHTTPError, OSError) as e:
        raise StoreUnavailable(f"hf://{repo_id}@{revision or 'main'}: {e}") from None


def resolve(url: str) -> str:
    """`hf://ORG/REPO@<commit sha>` for `url` (a branch, a tag or nothing becomes the commit)."""
    repo_id, revision, path = parse(url)
    if path:
        raise StoreError(f"{url}: name the repository (hf://ORG/REPO[@REVISION]), not a file in it")
    if revision and _COMMIT.match(revision):
        return f"hf://{repo_id}@{revision}"
    commit = snapshot(repo_id, revision).name  # snapshots/<commit>
    if not _COMMIT.match(commit):
        raise StoreError(f"{url}: could not resolve the revision to a commit (got {commit!r})")
    return f"hf://{repo_id}@{commit}"


def pinned(url: str) -> tuple[str, str]:
    """(repo id, commit) of a Hub checkpoint location, which must name a commit; CheckpointError otherwise."""
    repo_id, revision, path = parse(url)
    if path or not revision or not _COMMIT.match(revision):
        raise CheckpointError(f"{url}: a Hub checkpoint must name a commit (hf://ORG/REPO@<40-hex sha>); "
                              "`dflash-eval enqueue` resolves a branch or tag")
    return repo_id, revision


# --- targets named as users name them: a Hub model id ------------------------------------------
_MODEL_ID = re.compile(r"^(?:hf://)?([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w.-]+))?$", re.ASCII)
# a target is read from safetensors only; pickled weights and other formats are not fetched
_TARGET_IGNORE = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.msgpack", "*.h5", "original/*"]


def resolve_target(target: str | None) -> str | None:
    """A target as users name it: a local directory (unchanged), or a Hub model id `ORG/NAME[@REV]`
    (also `hf://ORG/NAME[@REV]`) resolved to its snapshot directory in huggingface_hub's cache,
    downloaded when missing unless `HF_HUB_OFFLINE` is set (then it must be cached). The path a job
    carries is that snapshot's (one commit), so the worker reads the same bytes; the worker's
    target roots must hold the cache's hub directory."""
    if target is None or os.path.exists(os.path.expanduser(target)):
        return target
    m = _MODEL_ID.match(target)
    if m is None or target.startswith((".", "/", "~")):
        return target  # a path: whoever loads it says it is missing
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo_id, revision = m.group(1), m.group(2)
    try:
        return str(Path(snapshot_download(repo_id, revision=revision, repo_type="model",
                                          ignore_patterns=_TARGET_IGNORE)).resolve())
    except RepositoryNotFoundError as e:
        raise CheckpointError(f"target {target}: not a local directory, and no such Hub model (or no access: "
                              f"a gated or private repo needs HF_TOKEN): {e}") from None
    except LocalEntryNotFoundError:
        raise CheckpointError(f"target {target}: not a local directory, and not in the Hugging Face cache "
                              "(HF_HUB_OFFLINE is set, or the Hub is unreachable): download it once with "
                              f"`hf download {repo_id}`") from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"target {target}: {e}") from None
