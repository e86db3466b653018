"""The job service: the job schema, the Redis queue, the RQ worker, the outbox, the local Redis."""
