"""`dflash-eval enqueue CHECKPOINT_DIR...`: queue acceptance evals of published checkpoints."""
from __future__ import annotations

import argparse
import json

from dflash_train.core.tau import COUNTING_RULES

from ._common import add_redis_args, add_sampling_args, connect_from_args, fail, print_json, sampling_options
from .import_drafter import add_import_arguments, import_drafters

HELP = "queue evaluations of published checkpoints (deduplicated; --force evaluates again)"


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="*", metavar="CHECKPOINT_DIR",
                        help="published checkpoint directories (with COMPLETE.json) or store URLs "
                             "(s3://bucket/runs/RUN/step-...), or a run directory or run URL "
                             "(all its published checkpoints)")
    parser.add_argument("--suite", action="append", default=None, metavar="SUITE",
                        help="builtin:NAME, a .jsonl file (under the worker's suite roots), or a standard benchmark "
                             "hf:NAME[:n=N][:seed=S][:thinking=on] (gsm8k, math500, humaneval, mbpp, mt-bench, "
                             "alpaca); "
                             "repeatable: one job per suite, each logged as eval/<suite>/... "
                             "(default builtin:coding-v1)")
    parser.add_argument("--target", default=None,
                        help="target model directory as the worker sees it, or a Hub model id ORG/NAME[@REV] (its "
                             "snapshot "
                             "in the Hugging Face cache) (default $DFLASH_TARGET, "
                             "else the worker's own --target)")
    parser.add_argument("--baseline", default=None,
                        help="a published checkpoint (or import record) to compare against; with --external also a "
                             "drafter directory trained elsewhere")
    parser.add_argument("--external", action="store_true",
                        help="CHECKPOINT_DIRs (and --baseline) without COMPLETE.json are drafters trained elsewhere "
                             "(z-lab release, SpecForge output, HF snapshot): record each with `dflash-eval import`'s "
                             "default names (nothing is written into them), then queue the record")
    parser.add_argument("--force", action="store_true", help="evaluate again under a new attempt id")
    parser.add_argument("--priority", choices=["high", "default", "low"], default="default",
                        help="queue: workers take high before default before low (default: %(default)s)")
    parser.add_argument("--route-by-target", action="store_true",
                        help="queue each job on its target's queues, taken only by workers started with "
                             "`--serve-target` for that target (default: the plain queues, any worker)")
    parser.add_argument("--backlog", default="all", metavar="POLICY",
                        help="the run's backlog policy: all (every checkpoint, in order), newest-first (the "
                             "newest next, older ones when idle), thin:K (every K-th and the newest; the rest "
                             "skipped, re-queueable); the last checkpoint is always evaluated (default: %(default)s)")
    parser.add_argument("--checkpoint-root", action="append", default=None, metavar="DIR",
                        help="refuse checkpoints outside these roots: directories or store prefixes such as "
                             "s3://bucket/runs (repeatable; default $DFLASH_CHECKPOINT_ROOTS)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens of each greedy reference completion (default: the suite's)")
    parser.add_argument("--tree-budget", type=int, default=None,
                        help="drafted nodes of the best-first tree behind tree τ (default: the engine's, 8)")
    parser.add_argument("--sliding-rule", choices=["serving", "reference"], default=None,
                        help="sliding-window layers a drafter config leaves without a causal flag: serving "
                             "(vLLM/SGLang: "
                        "causal within the block; default) or reference (z-lab loop: non-causal, windowed)")
    parser.add_argument("--counting", choices=COUNTING_RULES, default=None,
                        help="step-counting rule of the online walk (default: the engine's, response; "
                             "docs/design.md, Counting rules)")
    parser.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                        help="extra evaluator option (JSON value), repeatable")
    add_sampling_args(parser)
    parser.add_argument("--wandb-project", default=None,
                        help="W&B project of the eval run (default: the worker's)")
    parser.add_argument("--wandb-entity", default=None, help="W&B entity (team or user) of the eval run")
    parser.add_argument("--wandb-mode", choices=["online", "offline", "disabled"], default=None,
                        help="W&B mode asked of the worker (default with --wandb-project/--wandb-entity: "
                             "online); the worker's $WANDB_MODE, when set, wins")
    parser.add_argument("--sink", default=None, help="comma-separated sinks this job publishes to: wandb, tensorboard, "
                                                     "mlflow, or none (default: the worker's)")
    parser.add_argument("--mlflow-experiment", default=None, help="MLflow experiment of the eval run")
    parser.add_argument("--mlflow-parent-run", default=None,
                        help="nest the MLflow eval run under this run (the trainer's)")
    parser.add_argument("--job-timeout", type=int, default=None, help="seconds one evaluation may take")
    parser.add_argument("--retries", type=int, default=None, help="retries after a failure or a crashed worker")
    parser.add_argument("--outbox", action="append", default=[], metavar="DIR",
                        help="also deliver the jobs waiting in a hook outbox directory (repeatable)")
    parser.add_argument("--retry-rejected", action="store_true",
                        help="with --outbox: also deliver the jobs set aside in DIR/rejected (after fixing "
                             "what made the queue refuse them)")
    parser.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    add_import_arguments(parser, roots=False)
    add_redis_args(parser)


def main(args: argparse.Namespace) -> int:
    from dflash_train.checkpoints.hub import resolve_target
    from dflash_train.checkpoints.publication import CheckpointError
    from dflash_train.checkpoints.storage import StoreError
    from dflash_train.common.settings import parse_roots
    from eval_worker.service.jobs.schema import JobError
    from eval_worker.service.queueing.client import JobClient
    from eval_worker.service.queueing.submission import Submission, expand_checkpoints, is_published

    if not args.checkpoints and not args.outbox:
        return fail("give at least one CHECKPOINT_DIR (or --outbox DIR)")
    sinks, unknown = _sinks(args)
    if unknown:
        from dflash_train.common.settings import KNOWN_SINKS

        return fail(f"--sink: unknown sink(s) {list(unknown)}; known: {', '.join(KNOWN_SINKS)}")
    try:
        config = _queue_config(args)
    except JobError as e:
        return fail(f"--backlog: {e}")
    try:
        roots = parse_roots(args.checkpoint_root) or args.settings.checkpoint_roots
    except StoreError as e:
        return fail(f"--checkpoint-root: {e}")
    try:  # a Hub model id: the job carries its snapshot directory (one commit) in the Hugging Face cache
        target = resolve_target(args.target or args.settings.target)
    except CheckpointError as e:
        return fail(str(e))

    paths, baseline = expand_checkpoints(args.checkpoints), args.baseline
    records: list = []
    import_errors: list = []
    if args.external:  # drafters trained elsewhere: queue their import records instead
        external = [p for p in paths + ([baseline] if baseline else []) if not is_published(p)]
        records, failed = import_drafters(args, external)
        import_errors = [{"checkpoint": e["given"], "error": e["error"]} for e in failed]
        record_of = {r["given"]: r["record"] for r in records}
        for r in records:
            if not args.json:
                print(f"{'imported' if r['created'] else 'recorded'}  {r['given']} as {r['record']}")
        if baseline in external and baseline not in record_of:
            paths = []  # the comparison was asked for: nothing is queued without its baseline
        paths = [record_of.get(p, p) for p in paths if p not in external or p in record_of]
        baseline = record_of.get(baseline, baseline)
    try:
        request = _request(args, target, baseline, sinks)
    except JobError as e:
        return fail(str(e))
    submission = Submission(request, roots=roots, errors=import_errors)
    submission.make_jobs(paths)
    url, delivered = None, []
    if submission.jobs or args.outbox:  # every checkpoint refused: said without waiting for Redis
        try:
            conn, url = connect_from_args(args)
        except Exception as e:  # noqa: BLE001 - RedisLocalError and friends: say why, nothing was lost
            for err in submission.errors:
                fail(f"{err['checkpoint']}: {err['error']}")
            return fail(str(e))
        client = JobClient(connection=conn, config=config, roots=roots)  # an outbox's jobs face the same roots
        submission.enqueue_all(client, force=args.force)
        delivered = [client.deliver_outbox(directory, retry_rejected=args.retry_rejected)
                     for directory in args.outbox]
    outcomes, errors = submission.outcomes, submission.errors

    if args.json:
        print_json({"redis": url, "outcomes": [o.to_dict() for o in outcomes], "errors": errors,
                    "outboxes": delivered, "imports": records})
    else:
        _print_report(outcomes, delivered, errors)
    return 2 if errors or any(d["remaining"] or d["rejected"] or d["set_aside"] for d in delivered) else 0


def _options(args: argparse.Namespace) -> dict:
    """The job's evaluation options: `--option K=V` pairs, then the flags that name one option."""
    options = dict(args.option)
    for flag in ("max_new_tokens", "tree_budget", "counting", "sliding_rule"):
        if getattr(args, flag) is not None:
            options[flag] = getattr(args, flag)
    options.update(sampling_options(args))
    return options


def _request(args: argparse.Namespace, target: str | None, baseline: str | None, sinks):
    """The flags as one EvalRequest, checked once (JobError naming every problem)."""
    from eval_worker.service.jobs.request import EvalRequest

    wandb = None
    if args.wandb_project or args.wandb_entity or args.wandb_mode:
        wandb = {"project": args.wandb_project or "dflash-eval", "entity": args.wandb_entity,
                 "mode": args.wandb_mode or "online"}
    mlflow = {k: v for k, v in (("experiment", args.mlflow_experiment), ("parent_run_id", args.mlflow_parent_run))
              if v} or None
    return EvalRequest.of(suites=args.suite, target=target, baseline=baseline, options=_options(args) or None,
                          wandb=wandb, mlflow=mlflow, sinks=sinks, priority=args.priority, requested_by="user")


def _sinks(args: argparse.Namespace) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """The sinks `--sink` names (None: the worker's settings decide), and the names no sink has."""
    if args.sink is None:
        return None, ()
    from dflash_train.common.settings import parse_sinks

    sinks, unknown = parse_sinks(args.sink)
    return sinks, unknown


def _queue_config(args: argparse.Namespace):
    """The queue's settings from the flags (JobError: the backlog policy is not one we know)."""
    from eval_worker.service.queueing.queue import QueueConfig
    from eval_worker.service.queueing.routing import parse_policy

    parse_policy(args.backlog)
    config = QueueConfig(base=args.queue, route_by_target=args.route_by_target, backlog=args.backlog)
    if args.job_timeout:
        config.job_timeout = args.job_timeout
    if args.retries is not None:
        config.retry_max = args.retries
    return config


def _print_report(outcomes: list, delivered: list[dict], errors: list[dict]) -> None:
    for o in outcomes:  # the status and the job id once each: most messages name the id already
        msg = o.message.removeprefix(f"{o.status} ")  # `enqueued ID on Q`: not `enqueued  enqueued ID ...`
        print(f"{o.status:9s} " + (msg if o.job_id in msg else f"{o.job_id}  {msg}"))
    for d in delivered:
        print(f"outbox {d['dir']}: "
              + (f"{len(d['restored'])} set-aside job(s) put back; " if d["restored"] else "")
              + f"delivered {len(d['delivered'])}, rejected {len(d['rejected'])}, "
              f"remaining {d['remaining']}" + (f" ({d['error']})" if d["error"] else ""))
        for key, reason in d["set_aside"].items():
            print(f"  set aside {key}: {reason}")
        if d["set_aside"]:
            print(f"  (fix the cause, then `dflash-eval enqueue --outbox {d['dir']} --retry-rejected`)")
    for err in errors:
        print(f"error     {err['checkpoint']}: {err['error']}")
