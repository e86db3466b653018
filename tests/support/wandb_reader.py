"""Read back what a W&B run wrote to its offline transaction log (``run-<id>.wandb``).

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0),
then 32 KiB blocks of chunks ``<crc32:u32><len:u16><type:u8><data>``; a chunk is FULL,
or FIRST/MIDDLE*/LAST pieces of one record; a block tail shorter than a chunk header is
zero padding. Each record is a ``wandb_internal_pb2.Record`` protobuf. The CRC is
zlib's crc32 of the data seeded with crc32 of the type byte, as wandb writes it.

wandb 0.31 no longer ships ``wandb.sdk.internal.datastore``, so this is our own reader;
it checks every CRC so a torn or corrupt file fails loudly instead of reading short.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_TYPE_CRC = {t: zlib.crc32(bytes([t])) for t in (FULL, FIRST, MIDDLE, LAST)}


class WandbFileError(ValueError):
    pass


def read_records(path: str | Path) -> list[pb.Record]:
    data = Path(path).read_bytes()
    if len(data) < HEADER.size:
        raise WandbFileError(f"{path}: shorter than the header")
    ident, magic, version = HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise WandbFileError(f"{path}: not a W&B transaction log ({ident!r}, {magic:#x}, {version})")
    records: list[pb.Record] = []
    pos, pending = HEADER.size, None
    while pos < len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK.size:  # zero padding at the end of a block
            pos += left_in_block
            continue
        if pos + CHUNK.size > len(data):
            raise WandbFileError(f"{path}: truncated chunk header at byte {pos}")
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0 and crc == 0:  # trailing zeroes of an unfinished block
            pos += left_in_block
            continue
        body = data[pos + CHUNK.size: pos + CHUNK.size + length]
        if len(body) != length or kind not in _TYPE_CRC:
            raise WandbFileError(f"{path}: bad chunk at byte {pos} (type {kind}, len {length})")
        if zlib.crc32(body, _TYPE_CRC[kind]) & 0xFFFFFFFF != crc:
            raise WandbFileError(f"{path}: CRC mismatch at byte {pos}")
        pos += CHUNK.size + length
        if kind == FULL:
            pending, whole = None, body
        elif kind == FIRST:
            pending, whole = bytearray(body), None
        else:
            if pending is None:
                raise WandbFileError(f"{path}: continuation chunk without a FIRST at byte {pos}")
            pending += body
            whole = None
            if kind == LAST:
                pending, whole = None, bytes(pending)
        if whole is not None:
            rec = pb.Record()
            rec.ParseFromString(whole)
            records.append(rec)
    if pending is not None:
        raise WandbFileError(f"{path}: file ends inside a record")
    return records


def _item_key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


@dataclass
class RunLog:
    """The parts of a run the tests look at."""

    run_id: str = ""
    group: str = ""
    job_type: str = ""
    history: list[dict] = field(default_factory=list)  # one dict per log() call, JSON-decoded values
    metrics: list[dict] = field(default_factory=list)  # define_metric records
    summary: dict = field(default_factory=dict)  # last value per key
    artifacts: list[dict] = field(default_factory=list)  # {name, type, aliases, manifest}
    exit_code: int | None = None

    def points(self, key: str) -> dict[float, object]:
        """`train/step` -> value for every history row that carries ``key``."""
        out: dict[float, object] = {}
        for row in self.history:
            if key in row:
                step = row["train/step"]
                if step in out:
                    raise AssertionError(f"{key} logged twice at train/step={step}")
                out[step] = row[key]
        return out


def read_run(path: str | Path) -> RunLog:
    log = RunLog()
    for rec in read_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            log.run_id, log.group, log.job_type = rec.run.run_id, rec.run.run_group, rec.run.job_type
        elif kind == "history":
            log.history.append({_item_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "metric":
            m = rec.metric
            log.metrics.append({"name": m.name, "glob_name": m.glob_name, "step_metric": m.step_metric,
                                "summary_max": m.summary.max})
        elif kind == "summary":
            for i in rec.summary.update:
                log.summary[_item_key(i)] = json.loads(i.value_json)
        elif kind == "artifact":
            a = rec.artifact
            log.artifacts.append({"name": a.name, "type": a.type, "aliases": list(a.aliases),
                                  "refs": [e.ref for e in a.manifest.contents],
                                  "digests": [e.digest for e in a.manifest.contents],
                                  "paths": [e.path for e in a.manifest.contents],
                                  "local_paths": [e.local_path for e in a.manifest.contents],
                                  "metadata": json.loads(a.metadata or "{}")})
        elif kind == "exit":
            log.exit_code = rec.exit.exit_code
    return log


def find_run_files(root: str | Path) -> list[Path]:
    return sorted(Path(root).rglob("run-*.wandb"))
