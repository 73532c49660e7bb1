"""The trainer's step records live on disk: the summary computed from the file equals the one
from the records in a list, bit for bit, and the writer's memory does not grow with the run
(measured with tracemalloc over 20,000 steps; the old writer kept every record on every rank)."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

from gradsift.tools.train.loop import RunWriter
from gradsift.tools.train.records import JsonlRecords
from gradsift.tools.train.summary import summarize


def record(step: int, rng: random.Random) -> dict:
    return {
        "step": step, "loss": rng.random() * 3, "lr": 0.1 / (1 + step), "step_s": rng.expovariate(50),
        "compute_s": rng.random() / 30, "compress_s": rng.random() / 1e3, "communicate_s": rng.random() / 7,
        "decompress_s": 1e-300 * rng.random(), "bytes_sent": rng.randrange(10**6), "bytes_padded": 2**40 + step,
        "bytes_received": rng.random() * 1e6, "dense_bytes": 4_000_000, "density": 0.1 + 0.2,
    }  # fmt: skip


def test_the_summary_from_the_file_is_the_summary_from_the_list(tmp_path: Path) -> None:
    rng = random.Random(0)
    steps = [record(step, rng) for step in range(301)]
    on_disk = JsonlRecords(tmp_path / "steps.jsonl")
    for step in steps:
        on_disk.append(step)
    evals = [{"step": 300, "accuracy": 0.5, "loss": 1.25, "train_time_s": 3.0, "wall_time_s": 4.0}]
    options = {"run": {"compressor": "topk"}, "target_accuracy": 0.4, "wall_time_s": 9.0}
    assert summarize(on_disk, evals, **options) == summarize(steps, evals, **options)
    assert len(on_disk) == 301 and list(on_disk) == steps
    assert on_disk[-1] == steps[-1] and on_disk[7] == steps[7] and on_disk[-2] == steps[-2]
    assert on_disk[2:4] == steps[2:4]
    on_disk.close()
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == steps  # the file is the run's steps.jsonl


def _allocated_after(writer: RunWriter, steps: range) -> int:
    rng = random.Random(1)
    for step in steps:
        writer.step(record(step, rng))
    return tracemalloc.get_traced_memory()[0]


def test_the_writer_keeps_no_step_in_memory(tmp_path: Path) -> None:
    for enabled in (True, False):  # rank 0 writes the file, the other ranks keep nothing
        writer = RunWriter(tmp_path / str(enabled), enabled=enabled)
        tracemalloc.start()
        try:
            early = _allocated_after(writer, range(2_000))
            late = _allocated_after(writer, range(2_000, 20_000))
        finally:
            tracemalloc.stop()
            writer.close(None)
        # a record in memory is ~1.5 kB: keeping 18,000 more would add ~27 MB
        assert late - early < 100_000, (enabled, late - early)
    assert len((tmp_path / "True" / "steps.jsonl").read_text().splitlines()) == 20_000
    assert not (tmp_path / "False").exists()
