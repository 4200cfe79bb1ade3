"""Reading an offline W&B run back as ``wandb sync`` does, for the tests of the wandb logger."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any


def wandb_records(run_dir: Path, timeout_s: float = 30.0) -> list[tuple[str, Any]]:
    """The records of an offline W&B run, once its service has written the last one (its
    ``exit``): ``run.finish()`` can return before it has (wandb 0.31), and a process that
    ends waits for it, but a test reads the file right after ``finish``."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _read_records(run_dir)
        if (records and records[-1][0] == "exit") or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _read_records(run_dir: Path) -> list[tuple[str, Any]]:
    """The records of an offline W&B run, read from its ``run-<id>.wandb`` file as ``wandb
    sync`` reads it: a 7-byte header, then 32 KiB blocks of chunks (crc32, length, type:
    1 whole, 2 first, 3 middle, 4 last) that join into protobuf ``Record`` messages; a
    record still being written is left out."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data, pos, chunks, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # the end, or a chunk being written
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            kind_name = record.WhichOneof("record_type")
            records.append((kind_name, getattr(record, kind_name)))
    return records


def wandb_steps(run_dir: Path) -> list[dict[str, float]]:
    """The metrics each ``log`` call recorded, W&B's own ``_`` keys left out."""
    steps = []
    for kind, history in wandb_records(run_dir):
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in history.item
            }
            steps.append({k: v for k, v in items.items() if not k.startswith("_")})
    return steps
