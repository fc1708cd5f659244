"""Profiling on one process, in this process: the trace's files and phases, the CPU memory timeline's categories
against the bytes the trainer holds, and --check's refusal of a cycle too short for its warmup and traced steps.
The multi-process traces (their collectives, a resumed run's numbering) are tests/multiprocess/test_profiling.py's."""

import gzip
import importlib.util
import json
from collections import Counter

import torch.profiler._memory_profiler as memory_profiler

import train
from launch import ROOT, TINY, read_metrics, train_in_process

_spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "scripts" / "trace_summary.py")
trace_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_summary)
PHASES = {"data", "forward_backward", "optimizer", "checkpoint"}


def test_check_refuses_a_cycle_shorter_than_warmup_and_active(capsys):
    code = train.run(["--job.config_file", str(TINY), "--profiling.enable_profiling", "--profiling.profile_freq", "3",
                      "--profiling.profiler_warmup", "3"], check=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "profiling.profile_freq = 3 is shorter than profiler_warmup + profiler_active = 4" in err[0]


def test_cpu_memory_timeline_holds_exactly_the_parameters_gradients_and_optimizer_state(tmp_path):
    train_in_process(tmp_path, "--training.steps", "2", "--profiling.enable_profiling", "--profiling.profile_freq",
                     "2", "--profiling.profiler_warmup", "0", "--profiling.enable_memory_snapshot")
    traces = tmp_path / "profile_traces"
    assert sorted(str(p.relative_to(traces)) for p in traces.rglob("*") if p.is_file()) == [
        "iteration_2/rank0_memory_timeline.json.gz", "iteration_2/rank0_trace.json.gz"]
    events = json.load(gzip.open(traces / "iteration_2" / "rank0_trace.json.gz"))["traceEvents"]
    assert PHASES <= {e.get("name") for e in events if e.get("cat") == "user_annotation"}
    text = trace_summary.summary(str(traces / "iteration_2" / "rank0_trace.json.gz"), top=3)  # scripts/trace_summary.py
    assert "forward_backward" in text and "c10d::allreduce_" in text and "aten::" in text
    _, sizes = json.load(gzip.open(traces / "iteration_2" / "rank0_memory_timeline.json.gz"))
    held = read_metrics(tmp_path)[0]  # measured at step 1, after backward: the state step 2 starts with
    index = memory_profiler._CATEGORY_TO_INDEX
    for category, key in (("PARAMETER", "param_bytes"), ("GRADIENT", "grad_bytes"),
                          ("OPTIMIZER_STATE", "optimizer_bytes")):
        series = Counter(s[index[memory_profiler.Category[category]] + 1] for s in sizes)
        if category == "PARAMETER":  # held all along: the whole step
            assert min(series) == series.most_common(1)[0][0] == held[key]
        else:  # gradients come and go (zero_grad frees them); the optimizer's moments are held all along
            assert max(series) == held[key], category
