"""RQ's queues and jobs as the service reads them: JSON serializer only, jobs fetched in batches.

Below both the queue operations (queue.py) and the routing policies (routing.py), which read jobs alike.
"""
from __future__ import annotations

from collections.abc import Iterable

from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from eval_worker.service.jobs.schema import JobError


def get_queue(connection, name: str) -> Queue:
    return Queue(name, connection=connection, serializer=JSONSerializer)


def fetch_job(connection, job_id: str) -> Job:
    try:
        return Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        raise JobError(f"no job {job_id!r} (never enqueued, or its result/failure TTL expired)") from None


def fetch_jobs(connection, ids: Iterable[str]) -> list[Job]:
    """The jobs of `ids` that still exist, in order."""
    ids, out = list(ids), []
    for lo in range(0, len(ids), 1000):  # one pipeline per 1000 jobs: bounded reply buffers on long queues
        out += [j for j in Job.fetch_many(ids[lo:lo + 1000], connection=connection, serializer=JSONSerializer)
                if j is not None]
    return out
