"""Profiling on one process, in this process: the trace's files and phases, the CPU memory timeline's categories
against the bytes the trainer holds, and --check's refusal of a cycle too short for its warmup and traced steps.
The multi-process traces (their collectives, a resumed run's numbering) are tests/multiprocess/test_profiling.py's."""

import gzip
import importlib.util
import json
import threading
from collections import Counter

import pytest
import torch
import torch.profiler._memory_profiler as memory_profiler
from torch._C._profiler import _EventType, _ExperimentalConfig
from torch.profiler import ProfilerAction

import train
from launch import ROOT, TINY, read_metrics, train_in_process
from torchtitan_lite.config import load_config
from torchtitan_lite.runtime import profiling

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


def profiled(*overrides: str):
    return load_config(["--profiling.enable_profiling", *overrides]).profiling


@pytest.mark.parametrize("freq, warmup, active", [(6, 2, 2), (5, 3, 1), (4, 0, 2), (3, 2, 1)])
def test_every_traced_window_has_its_warmup_whatever_step_a_run_resumes_at(freq, warmup, active):
    """Whatever step of a window a run resumes at, it traces a window (its warm-up steps, then its traced steps, the
    last of which, a multiple of profile_freq, writes it) if and only if the run holds the window's first warm-up
    step: the window it resumes inside after that step is skipped, and every later one is traced whole."""
    cfg = profiled("--profiling.profile_freq", str(freq), "--profiling.profiler_warmup", str(warmup),
                   "--profiling.profiler_active", str(active))
    for start in range(3 * freq, 4 * freq):  # the step a run resumes after: its first is start + 1
        cycle = profiling.cycle(cfg, start)
        for n in range(3 * freq):
            step = start + 1 + n  # the global step the profiler's n-th step runs
            end = -(-step // freq) * freq  # the step its window is written at
            begin = end - warmup - active + 1  # its first warm-up step
            expected = ProfilerAction.NONE
            if begin <= step and begin > start:
                expected = (ProfilerAction.WARMUP if step < begin + warmup else ProfilerAction.RECORD_AND_SAVE
                            if step == end else ProfilerAction.RECORD)
            assert cycle(n) == expected, (start, step)


def run_steps(profiler: profiling.StepProfiler, steps: int, step_fn=lambda: torch.ones(1000).sum()) -> None:
    with profiler:
        for _ in range(steps):
            with profiler.phase("forward_backward"):
                step_fn()
            profiler.step()


def test_a_run_resumed_inside_a_warmup_skips_that_window(tmp_path):
    """Resumed after step 6 with windows of 1 warm-up and 1 traced step every 4: step 7 would be the warm-up of
    step 8's window and is: traced. Resumed after step 7, step 8 would be traced without its warm-up: only step 12's
    window is."""
    cfg = profiled("--profiling.profile_freq", "4", "--profiling.profiler_warmup", "1")
    for start, traced in ((6, [8, 12]), (7, [12])):
        folder = tmp_path / str(start)
        run_steps(profiling.StepProfiler(cfg, str(folder), 0, torch.device("cpu"), start), 12 - start)
        assert sorted(int(p.parent.name.split("_")[1]) for p in folder.rglob("*_trace.json.gz")) == traced, start


@pytest.mark.parametrize("world_size, gpu, refused", [(2, False, True), (1, False, False), (2, True, False)])
def test_check_refuses_the_cpu_memory_timeline_of_several_processes(capsys, monkeypatch, world_size, gpu, refused):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    code = train.run(["--job.config_file", str(TINY), "--profiling.enable_profiling",
                      "--profiling.enable_memory_snapshot"], check=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert (code, len(err)) == ((2, 1) if refused else (0, 0)), err
    if refused:
        assert "profiling.enable_memory_snapshot on the CPU (the profiler's memory timeline) needs one process, " \
               "not 2" in err[0] and "NGPU=1" in err[0]


def freed_on_another_thread():
    """What gloo's threads do to a collective's buffers: the last reference dropped on a thread of theirs, then a new
    tensor allocated (at the freed address, as malloc reuses it)."""
    for _ in range(20):
        held = [torch.ones(1000) * 2]
        freeing = threading.Thread(target=held.clear)
        freeing.start()
        freeing.join()
        torch.ones(1000) * 3


@pytest.mark.parametrize("all_threads", [False, True])
def test_torchs_memory_profiler_cannot_follow_frees_on_other_threads(all_threads):
    """Why check_profiling refuses the CPU's timeline on several processes: torch's memory profiler does not see a
    free on a thread it does not follow, and following every thread records no allocation at all. When a torch
    release changes either, this fails: the refusal can then go. (An unseen free crashes the timeline's export once
    malloc hands its address to a later tensor, "version mismatch" or "duplicate outputs": in a training step always,
    here only when the main thread reuses the address, which malloc does not promise.)"""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True,
                                experimental_config=_ExperimentalConfig(profile_all_threads=all_threads)) as prof:
        freed_on_another_thread()
    events, sizes = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while events:
        event = events.pop()
        if event.typed[0] == _EventType.Allocation:
            sizes.append(event.typed[1].alloc_size)  # negative: a free
        events += event.children
    if all_threads:
        assert sizes == []
    else:  # every tensor allocated and freed in the window: the frees of the 20 on the other thread are missing
        allocations, frees = sum(s > 0 for s in sizes), sum(s < 0 for s in sizes)
        assert allocations >= 80 and allocations - frees == 20, (allocations, frees)
