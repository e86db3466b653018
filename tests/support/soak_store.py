"""Fault scenarios for checkpoints in an object store (rows of docs/reliability.md, run by
tests/support/soak.py and `bench/soak.py`): the worker's checkpoint cache tampered with, a corrupt
entry, a full cache disk, an object missing after COMPLETE.json, connections cut or answered
5xx. Real parts: moto's S3 server (tests/support/s3_server.py) behind the loopback fault proxy
(tests/support/fault_proxy.py), `dflash-eval worker` processes with `--checkpoint-root s3://...`, the
real Evaluator on the micro target.

Beyond lost and duplicated, each row counts **mis-attributed** records: a record whose
checkpoint digest is not the digest of the weights the evaluator actually read (the soak
evaluator hashes them at each call, `SOAK_HASH_WEIGHTS`).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from tests.support.soak_stack import OPTIONS, RUN, Row, Stack, Zygote, retry_now

WEIGHTS = "model.safetensors"


def _problem_list(**checks: bool) -> list[str]:
    return [name for name, ok in checks.items() if not ok]


class StoreStack:
    """A Stack whose checkpoints live in a bucket of a moto S3 server, reached by the workers
    through a FaultProxy; each worker's checkpoint cache is `cache_dir`."""

    def __init__(self, s: Stack, s3, proxy, bucket: str, cache_dir: Path):
        self.s, self.s3, self.proxy, self.cache_dir = s, s3, proxy, cache_dir
        self.prefix = f"s3://{bucket}/runs"

    def publish(self, step: int) -> str:
        from dflash_train.checkpoints.publication import upload_checkpoint

        return upload_checkpoint(self.s.publish(step), f"{self.prefix}/{RUN}")

    def local(self, url: str) -> Path:
        return self.s.root / RUN / url.rsplit("/", 1)[1]

    def start_worker(self, name: str | None = None):
        from tests.support.s3_server import CREDENTIALS

        env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.proxy.endpoint, "SOAK_HASH_WEIGHTS": "1",
               "AWS_MAX_ATTEMPTS": "2", "AWS_RETRY_MODE": "standard"}  # botocore's own settings: few retries
        return self.s.start_worker(name, env=env, args=["--checkpoint-root", self.prefix, "--checkpoint-cache-dir",
                                                        str(self.cache_dir), "--checkpoint-cache-gb", "1000"])

    def enqueue(self, url: str, *, retries: int = 0, force: bool = False) -> str:
        from eval_worker.service.jobs.builder import make_job
        from eval_worker.service.queueing.client import enqueue

        job = make_job(url, suite=str(self.s.suite), target=str(self.s.target), options=dict(OPTIONS),
                       roots=[self.prefix])
        out = enqueue(self.s.conn, job, config=retry_now(retries), roots=[self.prefix], force=force)
        if out.status != "enqueued":
            raise AssertionError(f"not enqueued: {out.message}")
        self.s.accepted.append(out.job_id)
        return out.job_id

    def run(self, url: str, timeout: float, **kw) -> str:
        jid = self.enqueue(url, **kw)
        self.s.wait_settled([jid], timeout)
        return jid

    def entry(self, url: str) -> Path:
        from dflash_train.checkpoints.publication import read_marker
        from eval_worker.service.worker.checkpoint_cache import CheckpointCache

        return self.cache_dir / CheckpointCache.key(read_marker(url))

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.cache_dir.iterdir() if ".tmp-" in p.name) if self.cache_dir.is_dir() else []

    def misattributed(self) -> tuple[int, int]:
        """(records whose digest is not that of the weights evaluated, records checked)."""
        import json

        evaluated: dict[str, str] = {}
        for call in self.s.calls_made():
            if call.get("job"):
                evaluated[call["job"]] = call.get("weights")  # the last evaluation of the job
        bad = checked = 0
        for jid, paths in self.s.ledger_by_job().items():
            for p in paths:
                rec = json.loads(p.read_text())
                if jid in evaluated:
                    checked += 1
                    bad += (rec.get("result") or {}).get("checkpoint", {}).get("digest") != evaluated[jid]
        return bad, checked


def _mount_tmpfs(size_bytes: int) -> Path:
    d = Path(tempfile.mkdtemp(prefix="soak-ckcache-"))
    size_k = -(-size_bytes // 4096) * 4
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs", str(d)], check=True,
                   capture_output=True, timeout=30)
    return d


@contextlib.contextmanager
def store_stack(base: Path, zygote: Zygote, target: Path, *, cache_dir: Path | None = None):
    from dflash_train.checkpoints import storage
    from tests.support.fault_proxy import FaultProxy
    from tests.support.s3_server import S3Server

    base.mkdir(parents=True, exist_ok=True)
    s3 = S3Server(base / "moto.log")
    saved = {k: os.environ.get(k) for k in s3.env()}
    os.environ.update(s3.env())  # this process (uploads, enqueue's marker check) talks to moto directly
    storage._filesystem.cache_clear()
    proxy = FaultProxy(s3.port)
    try:
        bucket = f"soak-{uuid.uuid4().hex[:10]}"
        s3.make_bucket(bucket)
        with Stack(base, zygote=zygote, target=target) as s:
            yield StoreStack(s, s3, proxy, bucket, cache_dir or base / "ckcache")
    finally:
        proxy.stop()
        s3.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        storage._filesystem.cache_clear()


def _short(reason: str) -> str:
    """A failure reason without the bucket's random name and the long URL, for the table."""
    reason = re.sub(r"s3://[^\s:]+/(step-\d+)", r"s3://.../\1", reason)
    return reason if len(reason) <= 200 else reason[:200] + "..."


def _swap(path: Path, donor: Path, how: str) -> None:
    if how == "in place":
        shutil.copyfile(donor, path)
    else:  # "renamed over"
        tmp = path.with_name(".swap")
        shutil.copyfile(donor, tmp)
        os.replace(tmp, path)


def scenario_store_tamper(base: Path, zygote: Zygote, target: Path, *, rounds: int = 2, timeout: float = 120) -> Row:
    """A cached checkpoint's weights replaced by another checkpoint's valid file of the same
    size, then the job forced again: before, the second record carried the first digest with the
    other weights' numbers; now the entry is dropped and fetched again."""
    t0 = time.monotonic()
    with store_stack(base, zygote, target) as st:
        w = st.start_worker()
        urls = [st.publish(step) for step in range(1, rounds + 2)]
        ids = []
        for i in range(rounds):
            url, donor = urls[i], st.local(urls[i + 1]) / WEIGHTS
            ids.append(st.run(url, timeout))
            _swap(st.entry(url) / WEIGHTS, donor, ("in place", "renamed over")[i % 2])
            ids.append(st.run(url, timeout, force=True))
        c = st.s.audit(ids)
        mis, checked = st.misattributed()
        dropped = w.log().count("does not hold the published bytes")
        problems = _problem_list(all_recorded=c.recorded == c.accepted, none_misattributed=mis == 0,
                                 every_tampered_entry_dropped=dropped == rounds, all_checked=checked == c.recorded)
        observed = (f"{rounds} cache entries had their weights replaced by another checkpoint's same-size file "
                    f"(in place or renamed over), each job forced again: {dropped} entries dropped and fetched again "
                    f"by the stat check and re-hash; {c.recorded} records, {mis} mis-attributed (of {checked} "
                    f"checked against the weights the evaluator read)")
        return Row.of("Checkpoint cache entry tampered with (same-size weights of another step)",
                      "a hit hands out the manifest's bytes or nothing: no record with the wrong weights", observed,
                      c, t0, misattributed=mis, problems=problems)


def scenario_store_sticky(base: Path, zygote: Zygote, target: Path, *, rounds: int = 2, timeout: float = 120) -> Row:
    """The cached weights truncated: before, every job of that checkpoint failed ("weights file
    is corrupt or truncated", not retried; `requeue --failed` the same); now the entry is
    dropped and the intact copy fetched again."""
    t0 = time.monotonic()
    with store_stack(base, zygote, target) as st:
        w = st.start_worker()
        urls = [st.publish(step) for step in range(1, rounds + 1)]
        ids = []
        for url in urls:
            ids.append(st.run(url, timeout))
            with open(st.entry(url) / WEIGHTS, "r+b") as f:
                f.truncate(f.seek(0, os.SEEK_END) // 2)
            ids.append(st.run(url, timeout, force=True))
        c = st.s.audit(ids)
        mis, _ = st.misattributed()
        dropped = w.log().count("does not hold the published bytes")
        problems = _problem_list(all_recorded=c.recorded == c.accepted, none_failed=c.failed == 0,
                                 none_misattributed=mis == 0, dropped=dropped == rounds)
        observed = (f"{rounds} cached weights files truncated to half: the next job of each dropped the entry and "
                    f"fetched the store's copy ({dropped} re-fetches), {c.recorded}/{c.accepted} recorded, "
                    f"{c.failed} failed, {mis} mis-attributed")
        return Row.of("Checkpoint cache entry corrupt (truncated weights)",
                      "dropped and fetched again once, never a sticky failure", observed, c, t0,
                      misattributed=mis, problems=problems)


def scenario_store_disk(base: Path, zygote: Zygote, target: Path, *, jobs: int = 5, timeout: float = 120) -> Row:
    """The checkpoint cache on a real tmpfs with room for 3.5 checkpoints, `--checkpoint-cache-gb`
    far away: before, the 4th download failed with ENOSPC three times and then the job; now idle
    entries are evicted, least recently used first, and every job is recorded."""
    from tests.support.soak import can_mount

    t0 = time.monotonic()
    why = can_mount()
    if why:
        return Row("Checkpoint cache disk full (ENOSPC)", "idle entries evicted", f"skipped: {why}",
                   0, 0, 0, 0, 0, 0.0, {"skipped": why})
    mnt: Path | None = None
    try:
        with store_stack(base, zygote, target, cache_dir=base / "pending") as st:
            urls = [st.publish(step) for step in range(1, jobs + 1)]
            one = sum(f.stat().st_size for f in st.local(urls[0]).iterdir() if f.is_file())
            mnt = _mount_tmpfs(int(one * 3.5))
            st.cache_dir = mnt / "ckcache"
            w = st.start_worker()
            ids = [st.run(url, timeout) for url in urls]
            c = st.s.audit(ids)
            mis, _ = st.misattributed()
            evicted = w.log().count("disk full while downloading")
            cached = len([p for p in st.cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")])
            problems = _problem_list(all_recorded=c.recorded == c.accepted, evicted=evicted >= jobs - 3,
                                     no_leftovers=not st.leftovers(), none_misattributed=mis == 0)
            observed = (f"cache on a {int(one * 3.5) // 1024} kB tmpfs ({one // 1024} kB per checkpoint), "
                        f"--checkpoint-cache-gb 1000: {jobs} checkpoints evaluated one after another, "
                        f"{evicted} downloads met ENOSPC and evicted the least recently used idle entry; "
                        f"{c.recorded}/{c.accepted} recorded, {cached} entries left, "
                        f"{len(st.leftovers()) or 'no'} partial download(s) left, "
                        f"{mis} mis-attributed")
            return Row.of("Checkpoint cache disk full (ENOSPC)", "idle entries evicted (LRU) and the download "
                          "retried; a clear retryable error only when none is idle", observed, c, t0,
                          evicted=evicted, problems=problems)
    finally:
        if mnt is not None:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
            with contextlib.suppress(OSError):
                mnt.rmdir()


def scenario_store_missing(base: Path, zygote: Zygote, target: Path, *, timeout: float = 120) -> Row:
    """A file listed by COMPLETE.json deleted from the store: before, 3 RQ tries x 3 downloads
    (about 5.5 min) ending with "The specified key does not exist." without the file's name;
    now one failure, not retried, naming the file. A good job next to them is recorded."""
    from dflash_train.checkpoints import storage
    from eval_worker.service.queueing.queue import failure_reason, fetch_job

    t0 = time.monotonic()
    with store_stack(base, zygote, target) as st:
        w = st.start_worker()
        good, *broken = [st.publish(step) for step in (1, 2, 3)]
        names = ["config.json", WEIGHTS]
        for url, name in zip(broken, names, strict=True):
            storage.store_for(url).remove(f"{url}/{name}")
        bad_ids = [st.enqueue(url, retries=2) for url in broken]
        good_id = st.enqueue(good)
        st.s.wait_settled(bad_ids + [good_id], timeout)
        c = st.s.audit()
        reasons = {name: failure_reason(fetch_job(st.s.conn, jid)) for jid, name in zip(bad_ids, names, strict=False)}
        log = w.log()  # one traceback's last line per failed execution: "<exception class>: <reason>"
        runs = {name: len(re.findall(rf"(?m)^[A-Za-z_][\w.]*: .*{re.escape(url)}\b", log))
                for url, name in zip(broken, names, strict=True)}
        evaluated = {call.get("job") for call in st.s.calls_made()}
        problems = _problem_list(
            failed_visibly=c.failed == len(broken), good_recorded=c.recorded == 1,
            reasons_name_the_file=all(f"{n}, listed in its COMPLETE.json, is missing" in r for n, r in reasons.items()),
            not_retried=all(v == 1 for v in runs.values()), not_evaluated=not evaluated & set(bad_ids),
            no_leftovers=not st.leftovers())
        said = "; ".join(sorted({m.group(0) if (m := re.search(r"[\w.]+, listed in its COMPLETE.json, is missing "
                                                                r"from the store", r)) else r[-120:]
                                 for r in reasons.values()}))
        observed = (f"{len(broken)} checkpoints with a listed file deleted from the store (config.json, "
                    f"model.safetensors), enqueued with 2 retries: each ran "
                    f"{'once' if set(runs.values()) == {1} else f'{runs} times'} and failed at download, reason names "
                    f"the file ({said}); nothing evaluated; the good job next to them recorded")
        return Row.of("Object listed by COMPLETE.json missing from the store",
                      "a permanent failure naming the file, not retried", observed, c, t0,
                      reasons=reasons, runs=runs, problems=problems)


def scenario_store_transport(base: Path, zygote: Zygote, target: Path, *, flaky: int = 2, timeout: float = 180) -> Row:
    """Connections to the store through the fault proxy: cut mid-body a few times (the client's
    and the cache's retries ride it out), then cut and answered 503 for good (the job fails
    visibly with the store's error, retryable, no partial download left; `requeue --failed`
    records it once the store answers). Before, aiohttp's ClientPayloadError escaped the
    mapping: no cache retry, the raw error as the reason, a `.tmp-PID` directory left behind."""
    from eval_worker.service.queueing.queue import failure_reason, fetch_job, requeue_failed

    t0 = time.monotonic()
    with store_stack(base, zygote, target) as st:
        st.start_worker()
        urls = [st.publish(step) for step in range(1, flaky + 3)]
        ids = []
        for url in urls[:flaky]:  # a flaky link: the next 2 connections cut mid-body
            st.proxy.set_fault("cut", times=2)
            ids.append(st.run(url, timeout))
        flaky_recorded = st.s.audit(ids).recorded
        failed_now: dict[str, str] = {}
        leftovers = []
        for url, fault in zip(urls[flaky:], ("cut", "5xx"), strict=False):
            st.proxy.set_fault(fault, only=b"/model.safetensors")  # the marker is read; the weights are not
            jid = st.run(url, timeout)
            ids.append(jid)
            failed_now[fault] = failure_reason(fetch_job(st.s.conn, jid))
            leftovers += st.leftovers()
        st.proxy.fault = "pass"
        mine = ids[flaky:]
        requeue_failed(st.s.conn, job_ids=mine)
        st.s.wait_settled(mine, timeout, also=lambda: all(v == "finished" for v in st.s.statuses(mine).values()))
        c = st.s.audit(ids)
        mis, _ = st.misattributed()
        problems = _problem_list(
            flaky_recorded=flaky_recorded == flaky,
            failed_with_store_reason=all("StoreUnavailable" in r or "download failed" in r
                                         for r in failed_now.values()),
            no_leftovers=not leftovers and not st.leftovers(), all_recorded_after=c.recorded == c.accepted,
            none_misattributed=mis == 0)
        observed = (f"{flaky} jobs over a link cutting 2 responses mid-body each: all recorded; "
                    f"weights downloads cut / answered 503 for good: "
                    + "; ".join(f"{k}: failed ({_short(v)})" for k, v in failed_now.items())
                    + f", {len(leftovers) or 'no'} partial download(s) left; after the store came back `requeue "
                      f"--failed` recorded both; "
                    f"{c.recorded}/{c.accepted} recorded, {mis} mis-attributed; "
                    f"requests through the proxy by fault {dict(st.proxy.counts)}")
        return Row.of("Store connection cut mid-body, or answered 503", "retried inside the cache; a visible "
                      "retryable failure naming the store error; nothing partial left", observed, c, t0,
                      reasons=failed_now, problems=problems)
