"""`CheckpointRef`: a checkpoint location parsed once (dflash_train/checkpoints/location.py)."""
from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.location import CheckpointRef, first_local_root, real_paths_within
from dflash_train.common.errors import StoreError

SEGMENT = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12)


@pytest.mark.parametrize("text, kind, writable", [
    ("s3://bucket/runs/r/step-00000010", "s3", True),
    ("s3a://bucket/runs", "fsspec", True),
    ("gs://bucket/runs", "fsspec", True),
    ("memory://runs/r", "fsspec", True),
    ("hf://org/repo@" + "a" * 40, "hub", False),
])
def test_checkpoint_ref_kind_of_each_store(text, kind, writable):
    ref = CheckpointRef.parse(text + "/")  # the canonical form drops a trailing '/'
    assert (ref.kind, ref.text, ref.writable, ref.on_this_machine, ref.url) == (kind, text, writable, False, text)
    with pytest.raises(ValueError):
        _ = ref.path


def test_checkpoint_ref_local_path_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ref = CheckpointRef.parse("runs/r")
    assert ref.kind == "local" and ref.on_this_machine and ref.writable and ref.url is None
    assert ref.path == tmp_path / "runs" / "r" and isinstance(ref.store(), storage.LocalStore)
    assert CheckpointRef.parse(tmp_path / "x").text == str(tmp_path / "x")  # a Path parses too


@pytest.mark.parametrize("bad", ["s3://user:secret@bucket/x", "s3://bucket/../x", "s3:///x", "s3://b/x?y=1",
                                 "/tmp/a\x00b"])
def test_checkpoint_ref_refuses_what_the_url_rules_refuse(bad):
    with pytest.raises(StoreError) as e:
        CheckpointRef.parse(bad)
    assert "secret" not in str(e.value)  # never echoed back


@given(proto=st.sampled_from(["s3", "gs", "memory"]), parts=st.lists(SEGMENT, min_size=1, max_size=5),
       slash=st.booleans())
def test_checkpoint_ref_parse_is_idempotent_and_round_trips_through_json(proto, parts, slash):
    ref = CheckpointRef.parse(f"{proto}://" + "/".join(parts) + ("/" if slash else ""))
    assert CheckpointRef.parse(ref) is ref and CheckpointRef.parse(str(ref)) == ref


@given(prefix=st.lists(SEGMENT, min_size=1, max_size=3), rest=st.lists(SEGMENT, min_size=0, max_size=3),
       suffix=SEGMENT)
def test_checkpoint_ref_within_prefix_by_whole_segments(prefix, rest, suffix):
    root = "s3://" + "/".join(prefix)
    inside = CheckpointRef.parse("/".join([root, *rest]))
    assert inside.within([root]) == inside
    sibling = CheckpointRef.parse(root + suffix + "/x")  # `s3://b/runs` never admits `s3://b/runs-old/x`
    assert sibling.within([root]) is None
    assert inside.within(["/" + "/".join(prefix)]) is None  # a local root never holds a URL


def test_checkpoint_ref_within_resolves_symlinks(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "run").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, root / "run" / "escape")
    assert CheckpointRef.parse(root / "run").within([root]) == CheckpointRef(str(root / "run"), "local")
    assert CheckpointRef.parse(root / "run" / "escape").within([root]) is None
    # `..` after a symlink is resolved by the file system, not cleaned away: run/escape/.. is tmp_path
    assert CheckpointRef.parse(f"{root}/run/escape/..").within([root]) is None
    assert CheckpointRef.parse(f"{root}/run/escape/..").canonical == str(root / "run")  # lexical: what a job names
    assert CheckpointRef.parse(f"{root}/run/escape/../root/run").within([root]) == CheckpointRef(str(root / "run"),
                                                                                              "local")
    assert CheckpointRef.parse(root / "run").within(["s3://bucket/runs"]) is None  # a prefix never holds a path


def test_checkpoint_ref_first_local_root_skips_store_prefixes(tmp_path):
    assert first_local_root(["s3://bucket/runs", tmp_path, "/elsewhere"]) == tmp_path
    assert first_local_root(["s3://bucket/runs"]) is None and first_local_root(None) is None


def test_checkpoint_ref_of_a_job(tmp_path):
    """A job carries the canonical text; its ref is the value every layer asks."""
    from eval_worker.service.jobs.schema import validate_job

    job = validate_job({"schema": "dflash-eval-job/1", "run_id": "r", "step": 1, "checkpoint": "s3://b/runs/r/step-1",
                        "checkpoint_digest": "0" * 64, "suite": "builtin:coding-v1", "baseline": str(tmp_path)})
    assert job.checkpoint_ref == CheckpointRef("s3://b/runs/r/step-1", "s3")
    assert job.baseline_ref is not None and job.baseline_ref.on_this_machine


@given(names=st.lists(st.sampled_from(["a", "ab", "a/b", "c", "link", "link/x", "out", "ab/../a"]), max_size=8),
       root_names=st.lists(st.sampled_from(["a", "ab", "c", "link", "a/", "s3://b/a"]), max_size=3))
def test_checkpoint_ref_many_files_confined_as_one_by_one(tmp_path_factory, names, root_names):
    """`real_paths_within` (a checkpoint's files, roots parsed once) answers what `within` answers per file."""
    base = tmp_path_factory.mktemp("conf").resolve()
    for d in ("a/b", "ab", "c", "out"):
        (base / d).mkdir(parents=True, exist_ok=True)
    if not (base / "link").exists():
        (base / "link").symlink_to(base / "out")
    roots = [r if r.startswith("s3://") else str(base / r) for r in root_names]
    paths = [base / n for n in names]
    one_by_one = []
    for p in paths:
        inside = CheckpointRef.parse(p).within(roots)
        one_by_one.append(None if inside is None else inside.path)
    assert real_paths_within(paths, roots) == one_by_one
    assert real_paths_within(paths, CheckpointRef.parse_all(roots)) == one_by_one


@pytest.mark.parametrize("text", ["/a/b/../c", "/a//b/", "/a/./b", "/a/b", "s3://bucket/runs/r", "memory://x/y"])
def test_checkpoint_ref_as_canonical_and_parent_as_the_store_says(text):
    ref = CheckpointRef.parse(text)
    canon = ref.as_canonical()
    assert canon == CheckpointRef.parse(ref.canonical) and canon.text == ref.canonical and canon.kind == ref.kind
    assert (canon is ref) == (ref.text == ref.canonical)
    assert ref.parent == CheckpointRef.parse(str(ref.store().parent(ref.text)))
