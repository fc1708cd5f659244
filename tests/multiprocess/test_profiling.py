"""What a run shows of itself, on real torchrun jobs: traces per rank and window with the step's phases and FSDP's
collectives, a resumed run's trace numbering, the slowest rank named, and W&B's records equal to metrics.jsonl's.

The 4-process traces are the shared run "fsdp4"'s (conftest.py: profiling changes none of its numbers). The
2-process job runs twice in one folder (4 steps, then resumed to 6), tracing every 2nd step, logging to W&B offline,
with rank 1's data loading slowed by 0.2 s a batch (slow_data.py).
"""

import gzip
import json
import re
import struct
from collections import Counter
from pathlib import Path

import pytest

from launch import CHECKPOINTED, COMMON, ROOT, read_metrics, tiny_model, torchrun_several

PHASES = {"data", "forward_backward", "optimizer", "checkpoint"}
SLOW = ROOT / "tests" / "multiprocess" / "slow_data.py"
FSDP_OPS = {"all-gather": "c10d::_allgather_base_", "reduce-scatter": "c10d::_reduce_scatter_base_"}


def trace_files(folder: Path) -> list[str]:
    traces = folder / "profile_traces"
    return sorted(str(p.relative_to(traces)) for p in traces.rglob("*") if p.is_file())


def events(path: Path) -> list[dict]:
    return json.loads(gzip.open(path).read())["traceEvents"]


def documented_fsdp4_counts() -> dict[str, int]:
    """docs/performance.md's collectives table, row FSDP 4 (benchmarks/comm_count.py's figures)."""
    row = next(line for line in (ROOT / "docs" / "performance.md").read_text().splitlines()
               if line.startswith("| FSDP 4 |"))
    return {kind: int(n) for n, kind in re.findall(r"(\d+) ([a-z-]+) \(world\)", row) if kind in FSDP_OPS}


def test_fsdp4_traces_each_rank_at_steps_4_and_8_with_the_documented_collectives(runs):
    folder = runs["fsdp4"]
    assert trace_files(folder) == [f"iteration_{s}/rank{r}_trace.json.gz" for s in (4, 8) for r in range(4)]
    expected = documented_fsdp4_counts()
    blocks = tiny_model().n_layers  # FSDP groups: the blocks and the root (test_collectives.py's rules)
    assert expected == {"all-gather": 2 * blocks, "reduce-scatter": blocks + 1}
    for rank in range(4):
        trace = events(folder / "profile_traces" / "iteration_4" / f"rank{rank}_trace.json.gz")
        assert PHASES <= {e["name"] for e in trace if e.get("cat") == "user_annotation"}
        ops = Counter(e["name"] for e in trace if e.get("cat") == "cpu_op")
        assert {kind: ops[op] for kind, op in FSDP_OPS.items()} == expected, f"rank {rank}"


def wandb_records(path: Path) -> list:
    """The records of a .wandb file (a LevelDB-style log of protobuf records, 32 KiB blocks) as wandb.proto reads."""
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415 - the optional package, for this test only

    data, pos, chunks, records = path.read_bytes(), 7, b"", []  # after the ":W&B" header
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (n == 0 and kind == 0):  # a block's zero padding
            pos += left
            continue
        chunks, pos = chunks + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("observed")
    folder = root / "run"
    args = (*COMMON, *CHECKPOINTED, "--profiling.enable_profiling", "--profiling.profile_freq", "2",
            # Any lag at all warns: rank 1's 0.1 s above the mean data wait must not depend on how long a step takes
            # on a loaded machine (a 10 s step put it under 1% of one: no warning).
            "--profiling.profiler_warmup", "0", "--metrics.enable_wandb", "--metrics.straggler_factor", "1.000001")
    with pytest.MonkeyPatch.context() as env:
        for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env.setenv(name, str(root / "wandb_home"))
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.setenv("WANDB_RUN_TAGS", "lite, test")
        proc = torchrun_several(2, [(folder, False, (*args, "--training.steps", "4")),
                                    (folder, False, (*args, "--training.steps", "6"))], script=SLOW,
                                script_args=("0.2",))
    return folder, proc.stdout + proc.stderr


def test_a_resumed_run_continues_the_trace_numbering(observed):
    folder, _ = observed
    assert trace_files(folder) == [f"iteration_{s}/rank{r}_trace.json.gz" for s in (2, 4, 6) for r in range(2)]
    for step in (2, 4, 6):
        assert PHASES <= {e["name"] for e in events(folder / "profile_traces" / f"iteration_{step}" /
                                                    "rank1_trace.json.gz") if e.get("cat") == "user_annotation"}


def test_the_rank_slow_to_load_data_is_named(observed):
    folder, output = observed
    for record in read_metrics(folder):
        assert record["slowest_rank"] == 1 and record["slowest_data_loading_s"] >= 0.2, record
        assert record["data_loading_s"] < 0.2 and 0 <= record["data_loading_pct"] < 100  # rank 0's own
    warnings = [line for line in output.splitlines() if "rank 1 is a straggler" in line]
    assert len(warnings) == 2, output[-3000:]  # once in each of the two runs, at its 3rd logging step


def test_wandb_logs_metrics_jsonl_into_one_run(observed):
    folder, _ = observed
    files = sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # the first run and its resumption
    logged, runs = {}, set()
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                runs.add(record.run.run_id)
                assert list(record.run.tags) == ["lite", "test"]
                config = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.run.config.update}
                assert config["training"]["steps"] in (4, 6) and config["metrics"]["enable_wandb"] is True
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                logged[row["step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    assert runs == {(folder / "wandb_run_id").read_text().strip()}
    assert logged == {m["step"]: m for m in read_metrics(folder)}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
