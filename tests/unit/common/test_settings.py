"""One settings module: the environment is read by dflash_train/common/settings.py and nowhere else."""
from __future__ import annotations

import ast
import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from dflash_train.common.settings import Settings, parse_roots

REPO = Path(__file__).resolve().parents[3]
# Reads that are not settings of ours: torchrun's process-group protocol, the W&B sink handing W&B
# its own variables for the length of one publication, and `dflash-eval dashboard` handing
# rq-dashboard the variables its create_app() reads its configuration from.
ALLOWED = {"dflash_train/common/settings.py", "dflash_train/training/distributed.py",
           "eval_worker/results/sinks/wandb_sink.py", "eval_worker/commands/dashboard.py"}


def _environment_reads(path: Path) -> list[int]:
    """Lines that read os.environ / os.getenv (passing the whole environment on to a child is not a read)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "getenv":
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in ("get", "setdefault", "pop", "update", "__getitem__") \
                and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            lines.append(node.lineno)
    return lines


def test_only_the_settings_module_reads_the_environment():
    found = {}
    for package in ("dflash_train", "eval_worker", "hooks"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel not in ALLOWED and (lines := _environment_reads(path)):
                found[rel] = lines
    assert found == {}, f"environment read outside dflash_train/common/settings.py: {found}"


def test_defaults_follow_dflash_home(tmp_path):
    s = Settings.from_env({"DFLASH_HOME": str(tmp_path)})
    assert (s.results_dir, s.cache_dir, s.spool_dir, s.redis_dir, s.digests_dir) == (
        tmp_path / "results", tmp_path / "cache", tmp_path / "spool", tmp_path / "redis", tmp_path / "file-digests")
    xdg = Settings.from_env({"XDG_CACHE_HOME": str(tmp_path / "x")})
    assert xdg.home == tmp_path / "x" / "dflash-eval" and xdg.checkpoint_roots is None and xdg.sinks == ("wandb",)


def test_each_variable_lands_in_its_setting(tmp_path):
    env = {"DFLASH_HOME": str(tmp_path), "DFLASH_RESULTS_DIR": str(tmp_path / "r"),
           "DFLASH_CACHE_DIR": str(tmp_path / "c"),
           "DFLASH_SPOOL_DIR": str(tmp_path / "s"), "DFLASH_CHECKPOINT_ROOTS": f"{tmp_path}/a{os.pathsep}{tmp_path}/b",
           "DFLASH_TARGET": "/models/t", "DFLASH_DEVICE": "cuda:1", "REDIS_URL": "redis://h:1/0",
           "DFLASH_REDIS_PASSWORD": "pw", "DFLASH_SINKS": "wandb, bogus", "WANDB_DIR": str(tmp_path / "w"),
           "WANDB_MODE": "online", "DFLASH_WANDB_TIMEOUT_S": "7", "RQ_WORKER_ID": "w1"}
    s = Settings.from_env(env)
    assert (s.results_dir, s.cache_dir, s.spool_dir) == (tmp_path / "r", tmp_path / "c", tmp_path / "s")
    assert s.checkpoint_roots == (tmp_path / "a", tmp_path / "b") and s.target_roots is None
    assert (s.target, s.device, s.redis_url, s.redis_password) == ("/models/t", "cuda:1", "redis://h:1/0", "pw")
    assert s.sinks == ("wandb",) and s.unknown_sinks == ("bogus",)
    assert (s.wandb_dir, s.wandb_mode, s.wandb_timeout_s, s.worker_id) == (tmp_path / "w", "online", 7.0, "w1")
    assert Settings.from_env({**env, "DFLASH_WANDB_DIR": str(tmp_path / "d")}).wandb_dir == tmp_path / "d"
    assert Settings.from_env({**env, "DFLASH_SINKS": "none"}).sinks == ()


@given(st.lists(st.text(alphabet="abc/. ", min_size=1, max_size=8), max_size=4))
def test_roots_are_resolved_and_blank_ones_dropped(names):
    roots = parse_roots(names)
    kept = [n for n in names if n.strip()]
    assert roots == (tuple(Path(os.path.realpath(os.path.expanduser(n))) for n in kept) or None)
    assert parse_roots(os.pathsep.join(names)) == parse_roots([p for n in names for p in n.split(os.pathsep)])
