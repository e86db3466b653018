"""`dflash-eval import DRAFTER_DIR...`: record drafters trained elsewhere so the queue can evaluate them."""
from __future__ import annotations

import argparse

from ._common import fail, print_json

HELP = ("record drafters trained elsewhere (z-lab release, SpecForge/DeepSpec output, Hugging Face snapshot, "
        "HF Trainer checkpoint-N/, a training-state *.pt) as checkpoints the queue can evaluate (and use as "
        "--baseline); nothing is written into them")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafters", nargs="+", metavar="CHECKPOINT",
                        help="drafter directories (config.json + model.safetensors, or an index and shards), a "
                             "trainer's checkpoint directory (HF Trainer checkpoint-N/, SpecForge "
                             "training_state.pt, DeepSpec step_N/) or a training-state file (*.pt with "
                             "model_state_dict; read with torch.load(weights_only=True, mmap=True))")
    parser.add_argument("--config", default=None, metavar="CONFIG_JSON",
                        help="the drafter's config.json (any published layout) for checkpoints that do not hold "
                             "one (HF Trainer checkpoint-N/, *.pt, training_state.pt); the weights are then "
                             "converted into a checkpoint under --into")
    parser.add_argument("--prefix", default=None, metavar="PREFIX",
                        help="keep only the tensors under PREFIX (e.g. draft_model.), for a checkpoint of a wrapper "
                             "that also holds the target or other modules")
    add_import_arguments(parser)
    parser.add_argument("--run", default=None,
                        help="run id of the record (default: read off the path: a HF snapshot's repo name, a "
                             "trainer step directory's parent, else the directory's name)")
    parser.add_argument("--step", type=int, default=None,
                        help="step of the record (default: the number in `..step_N` / `checkpoint-N`, else 0)")
    parser.add_argument("--json", action="store_true", help="print the records as JSON")


def add_import_arguments(parser: argparse.ArgumentParser, *, roots: bool = True) -> None:
    """Where records go and which roots confine them (shared with `enqueue --external`)."""
    parser.add_argument("--into", default=None, metavar="ROOT",
                        help="checkpoint root that holds the import records (default: the first of "
                             "--checkpoint-root / $DFLASH_CHECKPOINT_ROOTS); the worker must have it as a root")
    if roots:
        parser.add_argument("--checkpoint-root", action="append", default=None, metavar="DIR",
                            help="refuse drafters outside these roots, as the worker will (repeatable; default "
                                 "$DFLASH_CHECKPOINT_ROOTS); a drafter's directory must lie in one of them")


def import_drafters(args: argparse.Namespace, sources: list[str], run: str | None = None,
                    step: int | None = None, config: str | None = None,
                    prefix: str | None = None) -> tuple[list[dict], list[dict]]:
    """Import each source; ([{source, record, run_id, step, digest, created, given}], [{source, error, given}]),
    `given` being the path as passed."""
    import os
    from pathlib import Path

    from dflash_train.checkpoints.publication import CheckpointError, import_name, run_id_from, valid_run_id
    from dflash_train.common.settings import parse_roots
    from eval_worker.service.jobs.confinement import converts_outside_roots, import_roots_problem

    roots = parse_roots(args.checkpoint_root) or args.settings.checkpoint_roots
    into = args.into or next((str(r) for r in roots or () if isinstance(r, Path)), None)
    if into is None:
        return [], [{"source": s, "given": s,
                     "error": "no place for the import record: give --into ROOT (a checkpoint root "
                                           "of the worker) or set $DFLASH_CHECKPOINT_ROOTS"} for s in sources]
    problem = import_roots_problem(into, roots) if roots is not None else None
    if problem:
        return [], [{"source": s, "given": s, "error": problem} for s in sources]
    # torch (seconds to import) only once the roots rule held: a refusal comes at once
    from dflash_train.checkpoints.training_state import StepUnknown, describe, import_checkpoint, recorded_in_place

    records, errors = [], []
    for source in sources:
        # a training-state file is named after its step: the run is its directory
        default_run = (run_id_from(Path(source).resolve().parent.name, default="import") if Path(source).is_file()
                       else import_name(source)[0])
        run_id, at = run or default_run, step  # None: the checkpoint's own step (trainer_state.json, its name)
        try:
            if not valid_run_id(run_id):
                raise CheckpointError(f"invalid run id {run_id!r}")
            use = config
            facts = describe(os.path.realpath(source))
            if recorded_in_place(facts, config, prefix) and converts_outside_roots(source, roots):
                use = facts["config"]  # the worker could not read it where it is: converted into the record root
            path, created, _ = import_checkpoint(Path(into), run_id, at, source, config=use, prefix=prefix)
        except StepUnknown as e:
            errors.append({"source": source, "error": f"{e}; give --step", "given": source})
            continue
        except (CheckpointError, OSError) as e:
            errors.append({"source": source, "error": str(e), "given": source})
            continue
        from dflash_train.checkpoints.publication import read_manifest

        m = read_manifest(path)
        records.append({"source": m.get("source") or m["imported_from"]["path"], "record": str(path),
                        "run_id": m["run_id"], "step": m["step"], "in_place": bool(m.get("source")),
                        "digest": m["digest"], "created": created, "given": source})
    if roots is None and records:
        _warn_unconfined(into, records)
    return records, errors


def _warn_unconfined(into: str, records: list[dict]) -> None:
    """No roots configured here, so nothing could be checked: name the roots the worker needs (the record
    root, and the directory of each drafter recorded in place: `import_roots_problem`'s rule)."""
    import os
    import sys

    needed = list(dict.fromkeys([os.path.abspath(into)] + [os.path.dirname(os.path.abspath(r["given"]))
                                                          for r in records if r["in_place"]]))
    flags = " ".join(f"--checkpoint-root {d}" for d in needed)
    print(f"WARNING: no checkpoint roots configured (--checkpoint-root / $DFLASH_CHECKPOINT_ROOTS), so the import "
          f"could not be checked against the worker's: the worker must serve the record root and each drafter "
          f"recorded in place, e.g. `dflash-eval worker ... {flags}`, or every job using these records fails there",
          file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    if args.run is not None and args.step is not None and len(args.drafters) > 1:
        return fail("--run and --step together name one record; import one DRAFTER_DIR at a time with both")
    records, errors = import_drafters(args, args.drafters, args.run, args.step, args.config, args.prefix)
    if args.json:
        print_json({"records": records, "errors": errors})
    else:
        for r in records:
            print(f"{'imported' if r['created'] else 'exists  '} {r['record']}  <- {r['source']} "
                  f"(run {r['run_id']}, step {r['step']}, digest {r['digest'][:12]})")
        if records:
            print("queue it with `dflash-eval enqueue RECORD`, or compare against it with `--baseline RECORD`")
    for e in errors:
        fail(f"{e['source']}: {e['error']}")
    return 2 if errors else 0
