"""The running stack the reliability scenarios drive (tests/support/soak.py, docs/reliability.md).

Real parts on loopback: a private `redis-server` (AOF, `appendfsync always`), `dflash-eval
worker` processes (the real CLI entry point, the real RQ worker, the real Evaluator on a
micro target), the trainer's real checkpoint publication. `Stack` starts and audits them;
`Counts` and `Row` are the audit (accepted, recorded, failed visibly, lost, duplicated).

Worker processes are forked from a warm "zygote" (a process that has imported torch,
transformers and the engine once), each child calling the same `dflash-eval worker`
entry point a fresh `python -m eval_worker worker` would; that makes a restart cost a
fraction of a second instead of ~15 s of imports, so kills can be frequent.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

VOCAB = 96
MASK_ID = VOCAB - 1
EOS_ID = VOCAB - 3
HIDDEN = 128
RUN = "soak"
OPTIONS = {"measure_speed": False, "bootstrap": 100}  # cheap: no timing runs, a small bootstrap

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# =========================================================================== cheap real inputs

def build_micro_target(directory: Path) -> Path:
    """A real (random) Qwen3 LM with a real tokenizer, ~5 MB: loads in < 1 s, evaluates in ~0.1 s.

    6 layers of width 128 (a 1-layer drafter with 2 feature layers fits; it weighs 0.7 MB, so
    a worker leaking one per job shows in its RSS), vocabulary of 96 word-level tokens
    `t0..t92` plus `<|endoftext|>`, `<unk>` and the DFlash `<|MASK|>`.
    """
    directory = Path(directory)
    if (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tmp = directory.with_name(directory.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    vocab = {f"t{i}": i for i in range(VOCAB - 3)}
    vocab.update({"<|endoftext|>": EOS_ID, "<unk>": VOCAB - 2, "<|MASK|>": MASK_ID})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="<unk>",
                                  pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|MASK|>"]})
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=512)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if directory.exists():
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, directory)
    return directory


def drafter_config(target: Path, block_size: int = 4):
    from transformers import AutoConfig

    from dflash_train.core.config import DrafterConfig

    cfg = AutoConfig.from_pretrained(target, local_files_only=True)
    return DrafterConfig.for_target(cfg, mask_token_id=MASK_ID, num_hidden_layers=1, num_features=2,
                                    block_size=block_size)


def publish(root: Path, target: Path, step: int, *, run: str = RUN, seed: int | None = None, cfg=None) -> Path:
    """Publish a random drafter for the micro target with the trainer's real `publish_checkpoint`."""
    import torch

    from dflash_train.checkpoints.checkpoint import publish_checkpoint
    from dflash_train.core.model import DFlashDrafter

    torch.manual_seed(step if seed is None else seed)
    drafter = DFlashDrafter(cfg or drafter_config(target)).eval()
    return publish_checkpoint(drafter, root, run, step, train_metrics={"loss": 1.0, "accuracy": 0.1})


def write_suite(path: Path, n_prompts: int = 1, max_new_tokens: int = 4) -> Path:
    lines = [{"suite": "soak", "version": "1", "chat_template": False, "max_new_tokens": max_new_tokens}]
    lines += [{"name": f"p{i}", "ids": [1 + i, 2, 3, 4, 5]} for i in range(n_prompts)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


# =========================================================================== fault-injecting evaluator

_LEAKED: list = []


class _SoakEvaluator:
    """The real Evaluator; each call is logged to $SOAK_CALLS and may first sleep a random
    time up to $SOAK_EVAL_DELAY_S, so kills land at random points of a job."""

    def __init__(self, inner):
        self.inner = inner
        self.rng = random.Random(os.getpid())

    def evaluate(self, checkpoint_dir, suite, **kw):
        calls = os.environ.get("SOAK_CALLS")
        if calls:
            entry = {"pid": os.getpid(), "checkpoint": str(checkpoint_dir), "t": time.time(),
                     "marker": (Path(checkpoint_dir) / "COMPLETE.json").is_file()}
            if os.environ.get("SOAK_HASH_WEIGHTS"):  # what was evaluated, for the mis-attribution count
                entry.update(job=_current_job_id(), weights=_weights_digest(Path(checkpoint_dir)))
            line = json.dumps(entry) + "\n"
            fd = os.open(calls, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        delay = float(os.environ.get("SOAK_EVAL_DELAY_S") or 0)
        if delay:
            time.sleep(self.rng.uniform(0, delay))
        leak = int(os.environ.get("SOAK_LEAK_KB") or 0)  # a deliberate leak: proves the memory check bites
        if leak:
            _LEAKED.append(bytearray(os.urandom(1024)) * leak)
        return self.inner.evaluate(checkpoint_dir, suite, **kw)


def _current_job_id() -> str | None:
    from rq import get_current_job

    job = get_current_job()
    return job.id if job is not None else None


def _weights_digest(directory: Path) -> str | None:
    """The weights digest of the files actually in `directory` (as the manifest defines it)."""
    from dflash_train.checkpoints.publication import drafter_files, sha256_file, weights_digest

    try:
        return weights_digest({n: sha256_file(directory / n) for n in drafter_files(directory)
                               if n.endswith(".safetensors")})
    except Exception as e:  # noqa: BLE001 - unreadable weights: the load fails and says so
        return f"unreadable: {type(e).__name__}"


def _hold_after_record() -> None:
    """$SOAK_RECORD_DELAY_S: sleep a random time right after each ledger write (before RQ hears
    of the result), so a kill can land between "recorded" and "finished"."""
    delay = float(os.environ.get("SOAK_RECORD_DELAY_S") or 0)
    if not delay:
        return
    from eval_worker.results import ledger as ledger_mod

    if getattr(ledger_mod.Ledger.write, "_soak", False):
        return
    original = ledger_mod.Ledger.write
    rng = random.Random(os.getpid() + 1)

    def write(self, **kw):
        out = original(self, **kw)
        time.sleep(rng.uniform(0, delay))
        return out

    write._soak = True
    ledger_mod.Ledger.write = write


def _skew_clock() -> None:
    """$SOAK_CLOCK_SKEW_S: this worker process's maintenance pass reads a clock that much off (the
    time source of RQ's registry cleanup is patched here, in the worker under test; the other
    workers keep the true clock), as on a box whose clock drifted."""
    skew = float(os.environ.get("SOAK_CLOCK_SKEW_S") or 0)
    if not skew:
        return
    import rq.registry

    if getattr(rq.registry.current_timestamp, "_soak", False):
        return
    true_clock = rq.registry.current_timestamp

    def skewed() -> int:
        return int(true_clock() + skew)

    skewed._soak = True
    rq.registry.current_timestamp = skewed


def soak_evaluator(target, **kwargs):
    """`--evaluator-factory tests.support.soak_stack:soak_evaluator`."""
    _skew_clock()
    from eval_worker.engine.acceptance import Evaluator

    _hold_after_record()
    return _SoakEvaluator(Evaluator(target, **kwargs))


# =========================================================================== processes

_ZYGOTE = r"""
import json, os, sys, threading, time, traceback, signal
sys.path.insert(0, sys.argv[1])
import torch, transformers, redis, rq                                   # the expensive imports, once
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
import eval_worker.engine.acceptance, eval_worker.service.worker.worker, eval_worker.cli, eval_worker.commands.worker
import eval_worker.results.sinks, dflash_train.checkpoints.checkpoint, tests.support.soak
children, lock = {}, threading.Lock()

def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(0.05)
            continue
        with lock:
            rc_path = children.pop(pid, None)
        if rc_path:
            code = os.waitstatus_to_exitcode(status)
            with open(rc_path + ".tmp", "w") as fh:
                fh.write(str(code))
            os.replace(rc_path + ".tmp", rc_path)

threading.Thread(target=reap, daemon=True).start()
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    with lock:
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                os.setsid()
                fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1); os.dup2(fd, 2)
                null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0)
                sys.stdout.reconfigure(line_buffering=True); sys.stderr.reconfigure(line_buffering=True)
                os.environ.clear(); os.environ.update(cmd["env"])
                os.chdir(cmd["cwd"])
                if cmd.get("umask") is not None:
                    os.umask(cmd["umask"])
                import importlib
                module, _, fn = cmd.get("call", "eval_worker.cli:main").partition(":")
                rc = getattr(importlib.import_module(module), fn)(cmd["argv"])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush(); sys.stderr.flush()
                finally:
                    os._exit(int(rc or 0))
        children[pid] = cmd["log"] + ".rc"
    print(json.dumps({"pid": pid}), flush=True)
# stdin closed: the parent is gone; take the children with us
with lock:
    pids = list(children)
for pid in pids:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
"""


class Zygote:
    """A warm Python process that forks worker processes on request (see the module docstring)."""

    def __init__(self, start_timeout: float = 240.0):
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, str(REPO)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, text=True, cwd=REPO, env=env,
                                     start_new_session=True)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._pending: list[dict] = []
        ready = self._read_line(start_timeout)
        if "ready" not in ready:
            raise RuntimeError(f"zygote did not start: {ready}")

    def _read_line(self, timeout: float) -> dict:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not box or not box[0]:
            self.close()
            raise RuntimeError(f"zygote did not answer within {timeout}s (exit code {self.proc.poll()})")
        return json.loads(box[0])

    def spawn(self, argv: list[str], env: dict[str, str], log: Path, cwd: Path = REPO,
              call: str = "eval_worker.cli:main", umask: int | None = None) -> int:
        with self._lock:
            if self.proc.poll() is not None:
                raise RuntimeError("zygote is gone")
            self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "log": str(log), "cwd": str(cwd),
                                              "call": call, "umask": umask}) + "\n")
            self.proc.stdin.flush()
            return int(self._read_line(60)["pid"])

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()  # it kills its children and exits
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)


_SHARED: dict[str, Any] = {}


def shared_zygote() -> Zygote:
    """One zygote per Python process (tests share it across modules); closed at exit."""
    z = _SHARED.get("z")
    if z is None or z.proc.poll() is not None:
        import atexit

        z = _SHARED["z"] = Zygote()
        atexit.register(z.close)
    return z


def shared_target() -> Path:
    """The micro target, built once per Python process in a temporary directory."""
    t = _SHARED.get("target")
    if t is None:
        import atexit

        d = Path(tempfile.mkdtemp(prefix="dflash-soak-target-"))
        atexit.register(shutil.rmtree, d, True)
        t = _SHARED["target"] = build_micro_target(d / "target")
    return t


class Worker:
    """One `dflash-eval worker` process (forked by the zygote, its own session / process group)."""

    def __init__(self, name: str, pid: int, log: Path):
        self.name, self.pid, self.log_path = name, pid, log
        self.rc_path = Path(str(log) + ".rc")

    def alive(self) -> bool:
        return not self.rc_path.exists()

    @property
    def returncode(self) -> int | None:
        try:
            return int(self.rc_path.read_text())
        except (OSError, ValueError):
            return None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the worker and everything it started (its scheduler): as if the machine died."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self.wait(30)

    def stop(self, timeout: float = 20.0) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            if self.wait(timeout) is None:
                self.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a scheduler child left behind
            os.killpg(self.pid, signal.SIGKILL)

    def rss_kb(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# =========================================================================== the system under test

@dataclass
class Counts:
    accepted: int = 0
    recorded: int = 0
    failed: int = 0
    lost: int = 0
    duplicated: int = 0
    executions: int = 0          # evaluate() calls (re-runs after kills count)
    failures: dict[str, str] = field(default_factory=dict)   # job id -> reason
    lost_ids: list[str] = field(default_factory=list)
    duplicated_ids: list[str] = field(default_factory=list)


class Stack:
    """A private Redis, a micro target, checkpoint root, ledger, cache and worker processes."""

    def __init__(self, base: Path, *, zygote: Zygote | None = None, target: Path | None = None,
                 password: str | None = None, redis_config: dict | None = None, appendfsync: str = "always",
                 redis_binary: str | None = None):
        from eval_worker.redis_client import connect
        from eval_worker.service.local_redis.server import LocalRedis

        self.base = Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self.root = self.base / "ckpts"
        self.results = self.base / "results"
        self.cache = self.base / "cache"
        self.home = self.base / "home"  # $DFLASH_HOME of the workers
        self.spool = self.home / "spool"  # the workers' default spool (dflash_train.common.settings)
        self.calls = self.base / "calls.jsonl"
        self.root.mkdir(exist_ok=True)
        self.target = target or build_micro_target(self.base / "target")
        self.cfg = drafter_config(self.target)
        (self.base / "suites").mkdir(exist_ok=True)
        self.suite = write_suite(self.base / "suites" / "suite.jsonl")  # workers get --suite-root for it
        self.redis = LocalRedis(self.base / "redis", appendfsync=appendfsync, password=password,
                                extra_config=redis_config, binary=redis_binary)
        self.redis.start()
        self.url = self.redis.url
        self.conn = connect(self.url)
        self._own_zygote = zygote is None
        self.zygote = zygote or Zygote()
        self.workers: list[Worker] = []
        self.accepted: list[str] = []
        self._n = 0

    # ---- workers ----------------------------------------------------------------------
    def worker_env(self, extra: dict | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "WANDB_", "SOAK_"))}
        env.pop("REDIS_URL", None)
        env.update({"PYTHONPATH": str(REPO), "DFLASH_HOME": str(self.home), "DFLASH_SINKS": "none",
                    "SOAK_CALLS": str(self.calls), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        env.update(extra or {})
        return env

    def start_worker(self, name: str | None = None, *, args: Iterable[str] = (), env: dict | None = None,
                     url: str | None = None, results: Path | None = None, register: bool = True,
                     timeout: float = 60.0, grace: int = 2, umask: int | None = None) -> Worker:
        self._n += 1
        name = name or f"w{self._n}"
        argv = ["worker", "--redis-url", url or self.url, "--name", name, "--target", str(self.target),
                "--checkpoint-root", str(self.root), "--results-dir", str(results or self.results),
                "--suite-root", str(self.suite.parent),
                "--cache-dir", str(self.cache), "--maintenance-interval", "1", "--job-monitoring-interval", "1",
                "--heartbeat-grace", str(grace), "--worker-ttl", "30", "--log-level", "INFO",
                "--evaluator-factory", "tests.support.soak_stack:soak_evaluator", *args]
        log = self.base / f"{name}.log"
        w = Worker(name, self.zygote.spawn(argv, self.worker_env(env), log, umask=umask), log)
        self.workers.append(w)
        if register:
            self.wait_registered(w, timeout)
        return w

    def spawn(self, name: str, call: str, argv: list[str], env: dict | None = None) -> Worker:
        """Any entry point (`module:function(argv)`) as a process of its own (a trainer, `publish`)."""
        log = self.base / f"{name}.log"
        w = Worker(name, self.zygote.spawn(argv, self.worker_env(env), log, call=call), log)
        self.workers.append(w)
        return w

    def wait_registered(self, w: Worker, timeout: float = 60.0) -> None:
        from rq.worker import Worker as RQWorker

        def up():
            if not w.alive():
                raise RuntimeError(f"worker {w.name} exited with {w.returncode}:\n{w.log()[-3000:]}")
            return any(x.name == w.name for x in RQWorker.all(connection=self.conn))

        wait_for(up, timeout, f"worker {w.name} to register")

    def live_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.alive()]

    # ---- jobs -------------------------------------------------------------------------
    def publish(self, step: int, run: str = RUN) -> Path:
        return publish(self.root, self.target, step, run=run, cfg=self.cfg)

    def job(self, checkpoint: Path, **kw) -> dict:
        """A job payload as RQ carries it (JSON data: the scenarios plant and mutate it)."""
        from eval_worker.service.jobs.builder import make_job

        kw.setdefault("options", dict(OPTIONS))
        return make_job(checkpoint, suite=str(self.suite), target=str(self.target), **kw).to_json()

    def enqueue(self, checkpoint: Path, *, config=None, force: bool = False, **kw) -> str:
        from eval_worker.service.queueing.client import enqueue

        out = enqueue(self.conn, self.job(checkpoint, **kw), config=config, roots=[self.root], force=force)
        if out.status != "enqueued":
            raise AssertionError(f"not enqueued: {out.message}")
        self.accepted.append(out.job_id)
        return out.job_id

    def statuses(self, ids: Iterable[str]) -> dict[str, str | None]:
        from rq.job import Job
        from rq.serializers import JSONSerializer

        ids = list(ids)
        out = {}
        for i in range(0, len(ids), 200):
            chunk = ids[i:i + 200]
            for jid, job in zip(chunk, Job.fetch_many(chunk, connection=self.conn, serializer=JSONSerializer),
                                strict=True):
                out[jid] = job.get_status(refresh=False).value if job is not None else None
        return out

    def wait_settled(self, ids: Iterable[str], timeout: float, *, also: Callable[[], bool] | None = None) -> None:
        """Until every job is finished or failed (and `also()`), or TimeoutError."""
        ids = list(ids)

        def settled():
            st = self.statuses(ids)
            return all(s in ("finished", "failed") for s in st.values()) and (also is None or also())

        try:
            wait_for(settled, timeout, f"{len(ids)} jobs to settle", interval=0.25)
        except TimeoutError as e:
            st = self.statuses(ids)
            open_ = {k: v for k, v in st.items() if v not in ("finished", "failed")}
            raise TimeoutError(f"{e}; unsettled: {dict(list(open_.items())[:10])}\n"
                               + "\n".join(f"--- {w.name}\n{w.log()[-1500:]}" for w in self.workers[-3:])) from None

    def ledger_by_job(self, results: Path | None = None) -> dict[str, list[Path]]:
        """job id -> its record files (every attempt file of every step/suite)."""
        out: dict[str, list[Path]] = {}
        for path in sorted((results or self.results).glob("*/step-*/*/attempt-*.json")):
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                out.setdefault(f"<unreadable {path}>", []).append(path)
                continue
            out.setdefault(rec.get("job_id"), []).append(path)
        return out

    def calls_made(self) -> list[dict]:
        if not self.calls.exists():
            return []
        return [json.loads(x) for x in self.calls.read_text().splitlines() if x.strip()]

    def audit(self, ids: Iterable[str] | None = None, *, results: Path | None = None,
              extra_failed: dict[str, str] | None = None) -> Counts:
        from eval_worker.service.queueing.queue import failure_reason, fetch_job

        ids = list(self.accepted if ids is None else ids)
        records = self.ledger_by_job(results)
        st = self.statuses(ids)
        c = Counts(accepted=len(ids), executions=len(self.calls_made()))
        for jid in ids:
            n = len(records.get(jid, []))
            if n:
                c.recorded += 1
                if n > 1:
                    c.duplicated += n - 1
                    c.duplicated_ids.append(jid)
            elif st.get(jid) == "failed":
                reason = failure_reason(fetch_job(self.conn, jid))
                if reason and reason != "(no reason recorded)":
                    c.failed += 1
                    c.failures[jid] = reason
                else:
                    c.lost_ids.append(jid)
            elif extra_failed and jid in extra_failed:
                c.failed += 1
                c.failures[jid] = extra_failed[jid]
            else:
                c.lost_ids.append(jid)
        c.lost = len(c.lost_ids)
        return c

    def queue_state(self) -> dict[str, int]:
        """Sizes of the queues and registries (consistency after a run)."""
        from rq.registry import FailedJobRegistry, FinishedJobRegistry, ScheduledJobRegistry, StartedJobRegistry
        from rq.serializers import JSONSerializer

        from eval_worker.service.queueing.queue import get_queue, queue_names

        out = {"queued": 0, "started": 0, "scheduled": 0, "finished": 0, "failed": 0}
        for name in queue_names():
            kw = dict(connection=self.conn, serializer=JSONSerializer)
            out["queued"] += get_queue(self.conn, name).count
            out["started"] += len(StartedJobRegistry(name, **kw).get_job_ids(cleanup=False))
            out["scheduled"] += len(ScheduledJobRegistry(name, **kw).get_job_ids())
            out["finished"] += len(FinishedJobRegistry(name, **kw).get_job_ids())
            out["failed"] += len(FailedJobRegistry(name, **kw).get_job_ids())
        return out

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.stop(timeout=10)
        with contextlib.suppress(Exception):
            self.conn.close()
        with contextlib.suppress(Exception):
            self.redis.stop()
        if self._own_zygote:
            self.zygote.close()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Row:
    """One line of the fault matrix."""

    fault: str
    expected: str
    observed: str
    accepted: int
    recorded: int
    failed: int
    lost: int
    duplicated: int
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, fault: str, expected: str, observed: str, c: Counts, t0: float, **details) -> Row:
        return cls(fault, expected, observed, c.accepted, c.recorded, c.failed, c.lost, c.duplicated,
                   round(time.monotonic() - t0, 1), details)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and not self.details.get("problems")


def retry_now(retries: int):
    from eval_worker.service.queueing.queue import QueueConfig

    return QueueConfig(retry_max=retries, retry_intervals=[])


