"""The eval worker process: an RQ worker that keeps the target loaded and rides out Redis outages.

The job it runs is eval_worker.service.worker.eval_job.run_eval_job (settings and the evaluator
cache: eval_worker.service.worker.evaluators; the allow-list check: eval_worker.service.worker.job_guard).

Why jobs run in the worker process (EvalWorker, a SimpleWorker with a heartbeat thread)
rather than in RQ's forked work-horse:
- the target may be tens of GB on a GPU. CUDA cannot be used in a child forked after the
  parent initialised it, so a model preloaded before fork is unusable on GPU, and loading
  it inside each work-horse would reload it per job;
- in-memory caches (tokenizer, reference/feature caches, compiled kernels) stay warm.
RQ's SimpleWorker sends no heartbeats while a job runs, so another worker's maintenance
would take a long job for abandoned; the heartbeat thread here renews the worker,
job and execution keys every `job_monitoring_interval` seconds, and the heartbeat TTL is
`interval + heartbeat_grace` (RQ hard-codes +60 s) so a crashed worker's job is
recovered quickly. A job is abandoned when its execution key's TTL ran out on the Redis
server (HeartbeatStartedJobRegistry), never by comparing two boxes' wall clocks, so a
worker whose clock runs minutes ahead does not retry other workers' running jobs. Timeouts
still work (SIGALRM death penalty in the main thread). A crash of the process takes its job
with it: StartedJobRegistry cleanup in a surviving worker's maintenance then retries it (Retry),
and the ledger keeps it recorded once.
SIGTERM: finish the current job, then exit (warm); with `stop_timeout`, or on a second
SIGTERM/SIGINT, the current job is put back at the front of its queue and the worker exits.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from datetime import timedelta

import redis
from rq import worker_registration
from rq.job import JobStatus
from rq.utils import now
from rq.worker import SimpleWorker, WorkerStatus

from dflash_train.common.redaction import install_log_redaction, redact
from eval_worker.redis_client import ride_out, server_unavailable
from eval_worker.results.ledger import RUNS_KEY, Ledger
from eval_worker.service.queueing import routing
from eval_worker.service.queueing.queue import JOBS_PREFIX, TARGET_FIELD, get_queue, server_risks
from eval_worker.service.worker import evaluators
from eval_worker.service.worker.evaluators import Evaluators, WorkerSettings
from eval_worker.service.worker.job_guard import EvalJob
from eval_worker.service.worker.rq_compat import (
    EvalScheduler,
    clean_queue_registries,
)

log = logging.getLogger(__name__)

QUARANTINE_PREFIX = "dflash:quarantine:"  # job hashes a worker could not load, set aside
REINDEX_LOCK = "dflash:ledger-reindex"  # held by the one worker rebuilding the results index
PROBE_PREFIX = "dflash:probe:"  # a write that tells whether Redis takes writes again (per worker, 60 s)


class JobInterrupted(Exception):
    """Raised inside a running job when it is stopped (cancel) or handed back (shutdown)."""



# --------------------------------------------------------------------------- the worker

class EvalWorker(SimpleWorker):
    """SimpleWorker + heartbeat thread + in-process stop/requeue (see the module docstring)."""

    def __init__(self, *args, heartbeat_grace: int = 60, stop_timeout: float | None = None,
                 route_base: str | None = None, serve_targets: list[str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # routing (service/queueing/routing.py): the targets served, by real path -> routing key
        self._route_base = route_base
        self._served = {os.path.realpath(t): routing.target_key(t) for t in serve_targets or []}
        self.heartbeat_grace = int(heartbeat_grace)
        self.stop_timeout = stop_timeout
        self._current = None            # the rq Job running in this process
        self._requeue_job_id = None     # job to hand back to the queue instead of failing it
        self._stop_timer: threading.Timer | None = None
        self.default_target: str | None = None  # recorded in its registration: a job naming no target means it

    def register_birth(self, *args, **kwargs):
        super().register_birth(*args, **kwargs)
        if self.default_target:  # lives and dies with the worker's registration hash
            self.connection.hset(self.key, TARGET_FIELD, self.default_target)

    # ---- registration that lapsed ------------------------------------------------------
    # RQ registers a worker once, at birth. Its registration can lapse while the process lives on:
    # a failover to a replica that never saw it (or a restart without persistence), a partition or
    # a SIGSTOP longer than the heartbeat TTL (another worker's maintenance then drops it from
    # rq:workers). RQ's heartbeat only re-creates a bare hash, so `status` said `workers (0):` while
    # the worker kept recording jobs. Each heartbeat checks first, and registers it again.
    def _registration_lapsed(self) -> bool:
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.sismember(self.redis_workers_keys, self.key)
            pipe.hexists(self.key, "birth")
            listed, born = pipe.execute()
        return not (listed and born)

    def _register_again(self, ttl: int) -> None:
        self.last_heartbeat = now()
        with self.connection.pipeline() as pipe:
            pipe.hset(self.key, mapping=self.serialize())
            pipe.hdel(self.key, "death")
            pipe.hset(self.key, "state", str(getattr(self._state, "value", self._state)))
            if self._current is not None:
                pipe.hset(self.key, "current_job", self._current.id)
            if self.default_target:
                pipe.hset(self.key, TARGET_FIELD, self.default_target)
            worker_registration.register(self, pipe)
            pipe.expire(self.key, ttl)
            pipe.execute()
        self.log.warning("Worker %s: its registration had lapsed (Redis failed over or lost its data, or the worker "
                         "was cut off or paused past its heartbeat TTL); registered again", self.name)

    def _keep_registered(self, ttl: int) -> None:
        if self.birth_date is not None and self._registration_lapsed():
            self._register_again(ttl)

    # ---- the scheduler -----------------------------------------------------------------
    def _start_scheduler(self, burst=False, logging_level="INFO", date_format=None, log_format=None):
        # RQ's Worker._start_scheduler with EvalScheduler in place of RQScheduler
        kwargs = {k: v for k, v in (("date_format", date_format), ("log_format", log_format)) if v is not None}
        self.scheduler = EvalScheduler(self.queues, connection=self.connection, serializer=self.serializer,
                                       logging_level=logging_level if logging_level is not None else self.log.level,
                                       **kwargs)
        self.scheduler.acquire_locks()
        if self.scheduler.acquired_locks:
            if burst:
                try:
                    self.scheduler.register_birth()
                    self.scheduler.enqueue_scheduled_jobs()
                finally:
                    self.scheduler.release_locks()
                    self.scheduler.register_death()
            else:
                self.scheduler.start()

    # ---- heartbeats ------------------------------------------------------------------
    def get_heartbeat_ttl(self, job, working_time: float = 0.0) -> int:
        if job.timeout and job.timeout > 0:
            remaining = max(job.timeout - working_time, 1)
            return int(min(remaining, self.job_monitoring_interval)) + self.heartbeat_grace
        return int(self.job_monitoring_interval) + self.heartbeat_grace

    def maintain_heartbeats(self, job, execution):
        # like RQ's, with our grace instead of its fixed +60 s for the worker key
        self._keep_registered(int(self.job_monitoring_interval) + self.heartbeat_grace)
        with self.connection.pipeline() as pipe:
            self.heartbeat(int(self.job_monitoring_interval) + self.heartbeat_grace, pipeline=pipe)
            working = (now() - job.started_at).total_seconds() if job.started_at else 0.0
            ttl = self.get_heartbeat_ttl(job, working_time=working)
            execution.heartbeat(job.started_job_registry, ttl, pipeline=pipe)
            job.heartbeat(now(), ttl, pipeline=pipe, xx=True)
            pipe.execute()

    @property
    def dequeue_timeout(self) -> int:
        # wake up for maintenance (abandoned-job recovery) even when idle
        return max(1, min(self.worker_ttl - 15, int(self.maintenance_interval)))

    def _beat(self, job, execution, stop: threading.Event) -> None:
        while not stop.wait(self.job_monitoring_interval):
            try:
                self.maintain_heartbeats(job, execution)
            except Exception as e:  # noqa: BLE001 - Redis hiccup: try again next interval
                self.log.warning("Worker %s: heartbeat for %s failed: %s", self.name, job.id, e)

    def execute_job(self, job, queue):
        execution = None
        try:
            execution = self.prepare_execution(job)
            stop = threading.Event()
            beat = threading.Thread(target=self._beat, args=(job, execution, stop), name="rq-heartbeat", daemon=True)
            self._current = job
            old = signal.signal(signal.SIGUSR1, self._interrupt_handler)
            beat.start()
            try:
                self.perform_job(job, queue, execution)
            finally:
                self._current = None
                stop.set()
                beat.join()
                signal.signal(signal.SIGUSR1, old)
                if self._stop_timer is not None:
                    self._stop_timer.cancel()
                    self._stop_timer = None
            self.set_state(WorkerStatus.IDLE)
        except redis.exceptions.RedisError as e:
            if not server_unavailable(e):
                raise
            self._after_redis_outage(job, queue, execution, e)

    # ---- routing: the loaded target's queues first ----------------------------------------
    def _order_by_affinity(self) -> None:
        if not self._served or self._route_base is None:
            return
        loaded = {self._served[t] for t in evaluators.current().loaded_targets() if t in self._served}
        self._ordered_queues = routing.affinity_order(self._ordered_queues, self._route_base, loaded)

    def reorder_queues(self, reference_queue):
        self._order_by_affinity()

    # ---- unreadable jobs -----------------------------------------------------------------
    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        self._order_by_affinity()  # the target loaded by the last job may have changed
        # RQ's work loop quits when a dequeued job hash cannot even be loaded (a bad status or
        # date field): set such a job aside under dflash:quarantine:<id> and take the next one.
        # Likewise a server that is there but refuses writes (out of memory, MISCONF, BUSY: RQ
        # retries only unreachable ones): wait until it takes writes again.
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as e:  # noqa: BLE001 - re-raised unless it is one dequeued job's fault
                if isinstance(e, redis.exceptions.RedisError) and server_unavailable(e):
                    self.log.warning("Worker %s: Redis refuses writes (%s); waiting", self.name, e)
                    if not self._wait_for_redis():
                        raise
                    continue
                job_id = getattr(e, "job_id", None)
                if job_id is None:
                    raise
                self._quarantine(job_id, f"{type(e).__name__}: {e}")

    def _quarantine(self, job_id: str, reason: str) -> None:
        key, dest = self.job_class.key_for(job_id), QUARANTINE_PREFIX + job_id
        try:
            with self.connection.pipeline() as pipe:
                pipe.hset(key, "dflash_quarantined", reason)
                pipe.rename(key, dest)
                pipe.execute()
        except redis.exceptions.ResponseError:
            pass  # the hash is gone already
        self.log.error("Worker %s: job %s is unreadable (%s); set aside as %s, not run", self.name, job_id,
                       reason, dest)

    # ---- Redis outages -------------------------------------------------------------------
    # RQ's work loop quits on any Redis error outside its dequeue call. An eval worker keeps
    # an expensive target loaded, so it rides the outage out instead: the bookkeeping calls
    # below skip a beat, and a job caught by the outage is put back once Redis answers (its
    # result, if already recorded, stays in the ledger and is not evaluated again). An outage
    # is anything `redis_client.server_unavailable` names: unreachable, or there but refusing
    # writes (out of memory at maxmemory, MISCONF, BUSY, LOADING, a read-only replica).
    def _wait_for_redis(self) -> bool:
        delay, last_log = 0.5, 0.0
        while not self._stop_requested:
            try:  # a write, not a PING: a server out of memory or unable to persist answers PING
                self.connection.set(PROBE_PREFIX + self.name, 1, ex=60)
                return True
            except redis.exceptions.RedisError as e:
                if not server_unavailable(e):
                    raise
                if time.monotonic() - last_log > 30:
                    self.log.warning("Worker %s: Redis unavailable (%s); waiting for it", self.name, e)
                    last_log = time.monotonic()
            time.sleep(delay)
            delay = min(delay * 2, 5.0)  # try every 5 s at most: back soon after Redis returns
        return False

    def _after_redis_outage(self, job, queue, execution, error) -> None:
        self.log.warning("Worker %s: Redis unreachable while running job %s (%s)", self.name, job.id, error)
        if not self._wait_for_redis():
            return  # stopping: the job's heartbeat lapses and another worker's maintenance retries it
        try:
            job.refresh()
            state = job.get_status(refresh=False)
            ours = state == JobStatus.STARTED and job.worker_name in (None, self.name)
            popped = state == JobStatus.QUEUED and self.connection.lpos(queue.key, job.id) is None
            if ours or popped:
                with self.connection.pipeline() as pipe:
                    self.cleanup_execution(job, pipeline=pipe, execution=execution)
                    job.set_status(JobStatus.QUEUED, pipeline=pipe)
                    queue._enqueue_job(job, pipeline=pipe, at_front=True)
                    pipe.execute()
                self.log.warning("Worker %s: Redis is back; job %s put back at the front of %s",
                                 self.name, job.id, queue.name)
            else:
                self.log.info("Worker %s: Redis is back; job %s is %s, left as it is", self.name, job.id,
                              state.value if state else "gone")
            self.set_state(WorkerStatus.IDLE)
        except redis.exceptions.RedisError as e:
            if not server_unavailable(e):
                raise
            # down again: the heartbeat-lapse recovery covers the job
            self.log.warning("Worker %s: Redis lost again while handing back %s: %s", self.name, job.id, e)
        except Exception as e:  # noqa: BLE001 - the job hash is gone (Redis lost its data): nothing to hand back
            self.log.warning("Worker %s: could not hand back job %s after the outage: %s", self.name, job.id, e)

    def heartbeat(self, timeout=None, pipeline=None):
        if pipeline is not None:
            return super().heartbeat(timeout, pipeline=pipeline)
        with ride_out(self.log, f"Worker {self.name}: heartbeat"):
            self._keep_registered(timeout or self.worker_ttl + 60)
            super().heartbeat(timeout)

    def set_state(self, state, pipeline=None):
        if pipeline is not None:
            return super().set_state(state, pipeline=pipeline)
        self._state = state  # kept here even when Redis cannot hear of it
        with ride_out(self.log, f"Worker {self.name}: saving state {state}"):
            super().set_state(state)

    def check_for_suspension(self, burst: bool):
        with ride_out(self.log, f"Worker {self.name}: suspension check"):
            super().check_for_suspension(burst)

    def run_maintenance_tasks(self):
        with ride_out(self.log, f"Worker {self.name}: maintenance"):
            super().run_maintenance_tasks()

    def clean_registries(self):
        # RQ's Worker.clean_registries with clean_queue_registries: abandoned jobs by the heartbeat
        # keys' Redis-side TTL, not by comparing this box's clock with the running worker's
        for queue in self.queues:
            if queue.acquire_maintenance_lock():  # one worker at a time cleans a queue
                self.log.info("Worker %s: cleaning registries for queue: %s", self.name, queue.name)
                try:
                    clean_queue_registries(queue, self._exc_handlers)
                    worker_registration.clean_worker_registry(queue)
                    queue.intermediate_queue.cleanup(self, queue)
                finally:
                    queue.release_maintenance_lock()
        self._restore_results_index()
        self.last_cleaned_at = now()

    def _restore_results_index(self) -> None:
        """Redis lost its data (a restart without persistence, a flush, eviction) while the ledger kept
        the records: rebuild the index that `status` and enqueue's dedupe read (one worker at a time;
        the index is a cache of the files). Without it `status` showed no results at all."""
        conn = self.connection
        if conn.exists(RUNS_KEY):
            return
        ledger = Ledger(evaluators.current().settings.results_dir, connection=conn)
        runs = ledger.runs()
        if not runs or not conn.set(REINDEX_LOCK, self.name, nx=True, ex=600):
            return
        try:
            n = ledger.reindex()
        finally:
            conn.delete(REINDEX_LOCK)
        # Not every missing index is lost data: Redis still holding a run's enqueue memory (written at
        # enqueue, before any record) means it kept its data, and the records were written by a worker
        # that could not reach it (a partition) and has not come back to index them yet.
        with conn.pipeline(transaction=False) as pipe:
            for run in runs:
                pipe.exists(JOBS_PREFIX + run)
            kept = [run for run, known in zip(runs, pipe.execute(), strict=True) if known]
        if kept:
            log.info("the results index lacked record(s) of run(s) %s, whose jobs Redis still holds (written "
                     "while their worker could not reach Redis); index rebuilt from %d record(s)",
                     ", ".join(kept[:5]) + (" ..." if len(kept) > 5 else ""), n)
            return
        log.warning("Redis had no results index while the ledger %s holds records: it lost its data (restarted "
                    "without persistence, flushed, or evicting keys); index rebuilt from %d record(s)",
                    ledger.root, n)

    # ---- stopping ----------------------------------------------------------------------
    def _interrupt_handler(self, signum, frame):
        if self._current is not None:
            reason = ("handed back to the queue (worker shutting down)" if self._requeue_job_id == self._current.id
                      else "stopped by user (dflash-eval cancel)")
            raise JobInterrupted(f"job {self._current.id} {reason}")

    def _interrupt_main(self) -> None:
        ident = threading.main_thread().ident
        assert ident is not None, "the main thread has started"
        signal.pthread_kill(ident, signal.SIGUSR1)

    def kill_horse(self, sig=None):
        """`stop-job` command (from the pubsub thread): interrupt the in-process job."""
        if self._current is not None:
            self.log.info("Worker %s: stopping job %s on request", self.name, self._current.id)
            self._interrupt_main()

    def request_stop(self, signum, frame):
        super().request_stop(signum, frame)  # warm: finish the job (raises StopRequested when idle)
        if self._current is not None and self.stop_timeout is not None:
            self._stop_timer = threading.Timer(self.stop_timeout, self._hand_back_current)
            self._stop_timer.daemon = True
            self._stop_timer.start()
            self.log.info("Worker %s: job %s has %.0fs to finish before it is handed back",
                          self.name, self._current.id, self.stop_timeout)

    def _hand_back_current(self) -> None:
        job = self._current
        if job is not None:
            self._requeue_job_id = job.id
            self._interrupt_main()

    def request_force_stop(self, signum, frame):
        if self._shutdown_requested_date and (now() - self._shutdown_requested_date) < timedelta(seconds=1):
            return
        if self._current is not None:
            self._requeue_job_id = self._current.id
            self._stop_requested = True
            raise JobInterrupted(f"job {self._current.id} handed back to the queue (worker cold shutdown)")
        raise SystemExit()

    def handle_job_failure(self, job, queue, started_job_registry=None, exc_string="", execution=None):
        exc_string = redact(exc_string)  # the failure text RQ keeps and `status` shows: no URL's secret
        if self._requeue_job_id is not None and self._requeue_job_id == job.id:
            self._requeue_job_id = None
            with self.connection.pipeline() as pipe:
                self.cleanup_execution(job, pipeline=pipe, execution=execution)
                job.set_status(JobStatus.QUEUED, pipeline=pipe)
                queue._enqueue_job(job, pipeline=pipe, at_front=True)
                pipe.execute()
            self.log.warning("Worker %s: job %s put back at the front of %s", self.name, job.id, queue.name)
            return
        super().handle_job_failure(job, queue, started_job_registry=started_job_registry,
                                   exc_string=exc_string, execution=execution)


def worker_name() -> str:
    return f"dflash-{socket.gethostname().split('.')[0]}-{os.getpid()}"


def serve(connection, queue_names: list[str], settings_: WorkerSettings, *, burst: bool = False,
          preload: bool = True, name: str | None = None, maintenance_interval: int = 60,
          job_monitoring_interval: int = 10, heartbeat_grace: int = 60, worker_ttl: int = 420,
          stop_timeout: float | None = None, with_scheduler: bool = True, max_jobs: int | None = None,
          logging_level: str = "INFO", route_base: str | None = None, serve_targets: list[str] | None = None) -> bool:
    """Run a worker until stopped (or, with `burst`, until the queues are empty)."""
    from rq.serializers import JSONSerializer

    install_log_redaction()  # the worker log: no secret of a URL a job names
    try:
        for risk in server_risks(connection):
            log.warning("Redis: " + risk.replace("%", "%%"))  # its own template: the RepeatLimiter keys on it
    except redis.exceptions.RedisError:  # unreachable now: the worker waits for it as always
        pass
    loaded = Evaluators(settings_)
    evaluators.install(loaded)  # the job function, called by RQ by name, finds them there
    if preload and settings_.default_target:
        loaded.get(settings_.default_target)  # before serving: the first job finds it warm
    worker = EvalWorker([get_queue(connection, n) for n in queue_names], connection=connection,
                        serializer=JSONSerializer, job_class=EvalJob, name=name or worker_name(),
                        maintenance_interval=maintenance_interval, job_monitoring_interval=job_monitoring_interval,
                        worker_ttl=worker_ttl, heartbeat_grace=heartbeat_grace, stop_timeout=stop_timeout,
                        route_base=route_base, serve_targets=serve_targets)
    if settings_.default_target:
        from eval_worker.service.jobs.ids import canonical_target

        worker.default_target = canonical_target(settings_.default_target)
    return worker.work(burst=burst, with_scheduler=with_scheduler, logging_level=logging_level, max_jobs=max_jobs)
