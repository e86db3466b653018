"""A stand-in engine for worker-level tests of the sinks
(`--evaluator-factory tests.support.fake_evaluator:FakeEvaluator`).

It returns a realistic result for the checkpoint it is given (run, step and digest from
its COMPLETE.json) without loading a model, so tests of the queue -> ledger -> W&B path
take seconds. The real engine is exercised by the engine's own tests and by the demo.
"""
from __future__ import annotations

import json
from pathlib import Path

from eval_worker.service.jobs.ids import suite_fingerprint
from tests.support.eval_results import make_result


class FakeResult:
    """What an engine returns: a result with `to_dict()` (here: the dict it was made from)."""

    def __init__(self, data: dict):
        self.data = data

    def to_dict(self) -> dict:
        return self.data


class FakeEvaluator:
    def __init__(self, target, cache_dir=None, device=None):
        self.target = target

    def evaluate(self, checkpoint_dir, suite, baseline=None, train_metrics=None, options=None, verified=None):
        marker = json.loads((Path(checkpoint_dir) / "COMPLETE.json").read_text())
        step = int(marker["step"])
        loaded = hasattr(suite, "fingerprint")  # the worker hands hf: suites over loaded
        return FakeResult(make_result(marker["run_id"], step, p=0.3 + step / 2000, digest=marker["digest"],
                                      checkpoint_root=str(Path(checkpoint_dir).parents[1]),
                                      suite=suite.name if loaded else "coding",
                                      suite_fp=suite.fingerprint() if loaded else suite_fingerprint(suite)))
