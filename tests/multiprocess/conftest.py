"""The suite's shared runs: each made once per session, on first use or ahead of it in the background (the end of
this file says which), and read by every test that needs it.

A torchrun job costs seconds before its first step (the launcher, every rank importing torch, the mesh), and a step's
cost grows with the model's blocks (tiny.toml's model has 2), so a shared run is made with every shared run of its
size in one job (several_runs.py), and one run answers the layout parity, resume, resharding and validation tests.
Tests read these folders and never write into them: a test that resumes a run copies the checkpoint it needs.
"""

import contextlib
import json
import shutil
import threading
from pathlib import Path

import pytest

# pytest.ini puts tests/multiprocess on the path: the tests here import the shared launcher as a plain module.
from grad_dump import load_grads, recording
import probes
from launch import (CHECKPOINTED, COMMON, CP2, DEBUGMODEL, FLOAT8, HSDP, MASKED, PP2, PROFILED, STEPS, TP2,
                    TP2_FSDP2, ckpt, finish_job, in_background, kill_tree, snapshot, start_job, start_several,
                    stopped_after, torchrun_cmd, train_job)
from pairs import REFERENCES, generate

SHORT = ("--training.steps", "4")  # after STEPS on the command line, so it wins
# name -> (processes, overrides), all with global batch 8. One process and DDP accumulate; the 4-process layouts take
# one micro-batch per rank, since under TP each costs ~8 collectives per block (test_checkpoint.py accumulates on
# TP 2 x FSDP 2 too).
SHARED_RUNS = {
    "single": (1, ()),  # 4 micro-batches of 2
    # 1 of 2 per rank; traced at steps 4 and 8 (test_profiling.py: profiling changes no number the others read).
    "fsdp4": (4, (*CHECKPOINTED, *PROFILED)),
    # 1 of 4 per rank, each block recomputed in backward: AC leaves the numerics alone (the TP 2 x FSDP 2 reshard leg
    # of test_checkpoint.py runs without it).
    "tp2_fsdp2": (4, TP2_FSDP2),
    # Read by the layout test alone, which compares the steps both runs have: 4 show parity as well as 8.
    "tp4": (4, ("--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size", "8", *SHORT)),  # 1 of 8
    "hsdp2x2": (4, (*HSDP, *SHORT)),  # 1 of 2 per rank
    # DDP is FSDP2 on a (replicate, shard = 1) mesh; 2 replicas show it as well as 4. 2 micro-batches of 2 per rank.
    "ddp2": (2, ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                 *SHORT)),
    # Pipeline layouts, one per schedule, recording every parameter's gradient at step 1 (grad_dump.py). GPipe: 2
    # local batches of 4 accumulated, 2 micro-batches each; 1F1B beside FSDP, validating and saving every 2 steps.
    # FSDP2's options (test_fsdp_options.py). hpZ over pairs of the 4 shards, two blocks prefetched each way, and 2
    # micro-batches of 1 per rank reduced once after the last; the output and input casts are fp32 here, so they are
    # only shown to run. Then parameters, gradients and AdamW's state in host memory (the device is the host here).
    "fsdp4_hpz_prefetch_deferred_reduce": (4, (
        "--parallelism.fsdp_reshard_after_forward", "2", "--parallelism.fsdp_prefetch", "2",
        "--training.local_batch_size", "1", "--parallelism.fsdp_defer_grad_reduce",
        "--training.mixed_precision_output", "float32", "--no-training.mixed_precision_cast_forward_inputs", *SHORT)),
    "fsdp4_offload_reshard_always": (4, (
        "--parallelism.fsdp_cpu_offload", "--no-parallelism.fsdp_offload_pin_memory",
        "--parallelism.fsdp_reshard_after_forward", "always", *SHORT)),
    # TP 2 compiled (aot_eager), validating and saving every 2 steps: test_compile.py resumes it.
    "tp2_compiled": (2, (*TP2, "--training.local_batch_size", "4", "--compile.enable", "--compile.backend", "aot_eager",
                         *CHECKPOINTED, "--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
                         "--training.steps", "6")),
    "pp2_gpipe": (2, (*PP2, "--parallelism.pipeline_parallel_schedule", "GPipe", "--training.local_batch_size", "4",
                      *CHECKPOINTED)),
    "pp2_fsdp2": (4, (*PP2, "--training.local_batch_size", "4", *CHECKPOINTED, "--validation.enable",
                      "--validation.freq", "2", "--validation.steps", "2")),
    # 4 stages of the debug model's 6 blocks (1, 2, 2, 1: the end ones hold the embedding and the output), 2 per rank,
    # 4 micro-batches of 2, every block recomputed in backward; interleaved with blocks compiled (aot_eager).
    "pp2_tp2_looped_bfs": (4, (*PP2, *TP2, "--parallelism.pipeline_parallel_schedule", "LoopedBFS",
                               "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_microbatches", "4",
                               "--activation_checkpoint.mode", "full", *DEBUGMODEL, *SHORT)),
    "pp2_interleaved_compiled": (2, (*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                     "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_microbatches",
                                     "4", "--compile.enable", "--compile.backend", "aot_eager", *DEBUGMODEL, *SHORT)),
    # Context-parallel layouts (each sequence split over the cp ranks), recording every parameter's gradient at step
    # 1. CP 2: 2 micro-batches of 4 accumulated, validating and saving every 2 steps (resumed below). CP 2 x FSDP 2 with
    # contiguous chunks, saving (test_context_parallel.py reshards it). CP 4 recomputing every block; CP 2 x TP 2
    # compiled (aot_eager); HSDP over cp with op-level selective AC; CP inside pipeline stages.
    "cp2": (2, (*CP2, "--training.local_batch_size", "4", *CHECKPOINTED, "--validation.enable", "--validation.freq",
                "2", "--validation.steps", "2")),
    "cp2_fsdp2": (4, (*CP2, "--training.local_batch_size", "4", "--parallelism.context_parallel_load_balancer", "none",
                      *CHECKPOINTED)),
    "cp4": (4, ("--parallelism.context_parallel_degree", "4", "--training.local_batch_size", "8",
                "--activation_checkpoint.mode", "full", *SHORT)),
    "cp2_tp2_compiled": (4, (*CP2, *TP2, "--training.local_batch_size", "8", "--compile.enable", "--compile.backend",
                             "aot_eager", *SHORT)),
    "hsdp2_cp2": (4, (*HSDP, *CP2, "--training.local_batch_size", "4", "--activation_checkpoint.mode", "selective",
                      "--activation_checkpoint.selective_ac_option", "op", *SHORT)),
    "pp2_cp2": (4, (*PP2, *CP2, "--training.local_batch_size", "8", *SHORT)),
}
# The rows that run every pair of options the runs above miss (pairs.py, test_pairs.py), and the single-process
# runs of each half precision they are compared with; made in the same jobs as the shared runs of their size.
PAIR_RUNS = generate(SHARED_RUNS)
# Document masking (block_causal) on every kind of layout, against its own single-process run (test_documents.py),
# 4 steps each, recording every parameter's gradient at step 1; in the jobs of the shared runs of their size.
MASKED_RUNS = {
    "masked_single": (1, (*MASKED, *SHORT)),  # 4 micro-batches of 2
    # TP 2 x FSDP 2, blocks compiled (aot_eager): 1 micro-batch of 4 per rank.
    "masked_tp2_fsdp2_compiled": (4, (*MASKED, *TP2, "--training.local_batch_size", "4", "--compile.enable",
                                      "--compile.backend", "aot_eager", *SHORT)),
    # PP 2 (1F1B, 2 micro-batches of 4: the documents reach the second stage beside its hidden states) x CP 2
    # (head-tail chunks under the mask).
    "masked_pp2_cp2": (4, (*MASKED, *PP2, *CP2, "--training.local_batch_size", "8", *SHORT)),
}
# test_compile.py's 4-process layouts, each block compiled, in the job of the shared runs of their size: TP 2 x FSDP 2
# (the shared run's settings) by inductor, 4 steps validating every 2 (step 4 repeats step 2's work, which must build
# no graph); FSDP 4 with every other block recomputed and HSDP 2 x 2 with op-level selective AC and bf16, by
# aot_eager, one step each (their gradients are the point).
AOT, ONE_STEP = ("--compile.enable", "--compile.backend", "aot_eager"), ("--training.steps", "1")
COMPILED_RUNS = {
    "tp2_fsdp2_inductor": (4, (*TP2_FSDP2, "--compile.enable", "--compile.backend", "inductor", "--validation.enable",
                               "--validation.freq", "2", "--validation.steps", "1", *SHORT)),
    "fsdp4_ac_every_2_compiled": (4, ("--activation_checkpoint.mode", "selective",
                                      "--activation_checkpoint.selective_ac_option", "2", *AOT, *ONE_STEP)),
    "hsdp_op_sac_bf16_compiled": (4, (*HSDP, "--activation_checkpoint.mode", "selective",
                                      "--activation_checkpoint.selective_ac_option", "op",
                                      "--training.mixed_precision_param", "bfloat16", *AOT, *ONE_STEP)),
}
# Float8 (test_float8.py): each layout against the single-process float8 run of its recipe, every micro-batch 2
# sequences as there (a tensorwise scale is the max of a whole micro-batch's activations), recording every parameter's
# gradient and every float8 scale at step 1. The references train 4 steps, as many as the longest layout, and are
# compared with the first 4 of "single"'s fp32 curve too; the all-gather run trains 4 (it is resumed), the other
# layouts 2: step 2 is the first whose weights and precomputed scales came out of an update, and emulated float8 under
# TP is the suite's slowest step.
ALL_GATHER, PRECOMPUTE = "--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"
ROWWISE, TWO = ("--float8.recipe_name", "rowwise"), ("--training.steps", "2")
FLOAT8_RUNS = {
    "float8_single": (1, (*FLOAT8, *SHORT)),
    "float8_rowwise_single": (1, (*FLOAT8, *ROWWISE, *SHORT)),
    # Weights gathered in float8, each weight's max all-reduced before its gather; saving every 2 steps (resumed).
    "float8_fsdp4_ag": (4, (*FLOAT8, ALL_GATHER, *CHECKPOINTED, *SHORT)),
    "float8_fsdp4": (4, (*FLOAT8, *TWO)),  # weights gathered in fp32 and cast after: the same numbers, bitwise
    "float8_pp2_fsdp2": (4, (*FLOAT8, *PP2, "--training.local_batch_size", "4", *TWO)),  # 1F1B, 2 micro-batches
    # torchao's float8 TP styles, which gather activations in float8; every weight's scale from one all-reduce after
    # each optimizer step. 2 micro-batches a rank.
    "float8_tp2_fsdp2_ag_pre": (4, (*FLOAT8, *TP2, "--training.local_batch_size", "2", ALL_GATHER, PRECOMPUTE,
                                    *TWO)),
    "float8_rowwise_tp2_fsdp2": (4, (*FLOAT8, *ROWWISE, *TP2, "--training.local_batch_size", "2", *TWO)),
}
# The single-process run of the layouts of 4 pipeline stages, which train the debug model's 6 blocks, 4 steps as they.
SINGLES = {"single_debugmodel": (1, (*DEBUGMODEL, *SHORT))}
ALL_RUNS = {**SHARED_RUNS, **PAIR_RUNS, **REFERENCES, **MASKED_RUNS, **COMPILED_RUNS, **FLOAT8_RUNS, **SINGLES}
RECORDED = [*SHARED_RUNS, *SINGLES, "tp2_compiled_resumed", *MASKED_RUNS, *COMPILED_RUNS,
            *(n for n in FLOAT8_RUNS if n != "float8_fsdp4")]
# The single-process run each run of SHARED_RUNS and COMPILED_RUNS is compared with.
SINGLE_OF = {name: "single_debugmodel" if "debugmodel" in overrides else "single"
             for name, (_, overrides) in {**SHARED_RUNS, **COMPILED_RUNS}.items()}

PIPELINED = [name for name in SHARED_RUNS if name.startswith("pp")]
CONTEXT_PARALLEL = [name for name in SHARED_RUNS if "cp" in name]
# name -> (run, step it resumes after, processes, overrides): a run stopped after that step and resumed to STEPS.
# The resumed runs of one size are made in one job of their own, after the shared runs': none shares a process with
# the run it resumes, so a resume proves what the checkpoint holds, not what a process still held.
RESUMED_RUNS = {
    # Saving asynchronously, with a half-written-looking step-99 in the way (HALF_WRITTEN; test_checkpoint.py).
    "fsdp4_resumed": ("fsdp4", 4, 4, (*CHECKPOINTED, "--checkpoint.async_mode", "async")),
    # Validating at steps 6 and 8 and keeping only the newest 2 checkpoints: steps 7 and 8 must still equal the
    # straight run's, bitwise.
    "tp2_fsdp2_resumed": ("tp2_fsdp2", 4, 4, (*TP2_FSDP2, "--checkpoint.keep_latest_k", "2", "--validation.enable",
                                              "--validation.freq", "2", "--validation.steps", "2")),
    # Saving asynchronously and keeping the newest 2 (test_pipeline.py).
    "pp2_gpipe_resumed": ("pp2_gpipe", 4, 2, (*SHARED_RUNS["pp2_gpipe"][1], "--checkpoint.async_mode", "async",
                                              "--checkpoint.keep_latest_k", "2")),
    "cp2_resumed": ("cp2", 6, 2, SHARED_RUNS["cp2"][1]),
    "tp2_compiled_resumed": ("tp2_compiled", 2, 2, SHARED_RUNS["tp2_compiled"][1]),  # recording its graph counts
    # Float8 weights in FSDP's state: a DTensor of torchao's float8-casting subclass, saved and loaded by DCP.
    "float8_fsdp4_ag_resumed": ("float8_fsdp4_ag", 2, 4, FLOAT8_RUNS["float8_fsdp4_ag"][1]),
}
HALF_WRITTEN = {"fsdp4_resumed": 99}  # resumed run -> the step of a checkpoint folder without .metadata put there
# The resharding legs (test_checkpoint.py, test_pipeline.py, test_context_parallel.py), in the job of the 4-process
# resumed runs. Each resumes a shared run's step 4 on another layout and trains to step 6, saving every 2 steps:
# name -> (the run whose step-4 checkpoint is copied in, overrides). "hsdp2x2" finds its own folder empty and starts
# from FSDP 4's step 4 through checkpoint.initial_load_path (full state).
RESHARD_LEGS = {"tp2_fsdp2": ("fsdp4", TP2), "hsdp2x2": (None, HSDP), "pp_to_fsdp4": ("pp2_fsdp2", ()),
                "cp_to_fsdp4": ("cp2_fsdp2", ())}
# Then these go on in their folder on their first layout to step 8 (their step-6 checkpoints stay).
RESHARD_BACK = {"pp_to_fsdp4": "pp2_fsdp2", "cp_to_fsdp4": "cp2_fsdp2"}


class SharedRuns:
    def __init__(self, root: Path):
        self.root, self.done, self.logs, self.resharded = root, {}, {}, {}
        self.started = {}  # processes -> the job start() left running: (its process, its runs, its log)
        # One job at a time, whether a test or the background thread (make_in_background) asks for it: a test that
        # asks for a run the background is making waits for it. `failure`: what a background job raised (_no_failure).
        self.lock, self.jobs, self.probed, self.stopping, self.failure = threading.RLock(), [], None, False, None

    def start(self, nproc: int) -> None:
        """Starts the job of every shared run of `nproc` processes and returns: it runs while other tests do."""
        self.started[nproc] = self._start(nproc, self._not_made(nproc))

    def finish_started(self) -> None:
        for nproc in list(self.started):
            self._finish(self.started.pop(nproc))

    def __getitem__(self, name: str) -> Path:
        """The dump folder of the shared run `name` (COMMON settings, STEPS steps), launched on first use."""
        if name in self.done or ALL_RUNS.get(name, (0,))[0] == 1:  # made, or made in this process (never by the
            return self._get(name)                                    # background): no job to wait for
        with self.lock:
            return self._get(name)

    def _get(self, name: str) -> Path:
        self.finish_started()
        if name not in self.done:
            if name in RESUMED_RUNS:
                self._resume(RESUMED_RUNS[name][2])
            elif (nproc := ALL_RUNS[name][0]) == 1:
                (self.root / name).mkdir(parents=True, exist_ok=True)
                with recording(self.root / name) if name in RECORDED else contextlib.nullcontext():
                    train_job(nproc, self.root / name, *COMMON, "--training.steps", str(STEPS), *ALL_RUNS[name][1])
                self.done[name] = self.root / name
            else:  # every shared run of this many processes not yet made, in one job (several_runs.py)
                self._no_failure()
                self._make(nproc, self._not_made(nproc))
        return self.done[name]

    def _not_made(self, nproc: int) -> list[tuple[str, tuple[str, ...]]]:
        """(name, overrides) of every shared run of `nproc` processes not yet made."""
        return [(n, overrides) for n, (p, overrides) in ALL_RUNS.items() if p == nproc and n not in self.done]

    def output(self, name: str) -> str:
        """What the job that made `name` printed (every run of that job; each names its own dump folder)."""
        self[name]
        return self.logs[name].read_text()

    def reshard_legs(self) -> dict:
        """The resharding legs' folders by name (RESHARD_LEGS), and "source_snapshot": FSDP 4's step 4 as it was
        before they ran (initial_load_path never writes)."""
        if not self.resharded:
            with self.lock:
                if not self.resharded:
                    self._resume(4)
        return self.resharded

    def probes(self) -> Path:
        """The folder of probes.py's job: OUT/KIND for each part the test modules registered (probes.register)."""
        if self.probed is not None:
            return self.probed
        with self.lock:
            if self.probed is None:
                self._no_failure()
                out = self.root / "probes"
                spec = {kind: [str(out / kind), *args] for kind, args in probes.REGISTERED.items()}
                for kind in spec:
                    (out / kind).mkdir(parents=True, exist_ok=True)
                (out / "spec.json").write_text(json.dumps(spec))
                cmd = torchrun_cmd(4, Path(probes.__file__), str(out / "spec.json"))
                self._finish((self._track(start_job(*cmd, out / "log")), [], out / "log"))
                self.probed = out
            return self.probed

    def make_in_background(self, jobs: list) -> None:
        """Makes `jobs` (LATER_JOBS' makers) one after another in a thread of their own, at the lowest CPU priority.
        When one fails, the thread stops, and every test that needs a job not yet made fails with its log."""
        def make() -> None:
            with in_background():
                try:
                    for job in jobs:
                        if not self.stopping:
                            job(self)
                except Exception as e:  # noqa: BLE001 - kept for the tests that need a job
                    self.failure = e

        threading.Thread(target=make, daemon=True).start()

    def _no_failure(self) -> None:
        assert self.failure is None, f"a shared job made in the background failed: {self.failure}"

    def stop(self) -> None:
        """Kills every job still running (a session interrupted, or ended before reading a background job)."""
        self.stopping = True
        for proc in self.jobs:
            if proc.poll() is None:
                kill_tree(proc)

    def _track(self, proc):
        """`proc`, kept for stop(), or killed at once where the session is stopping (the thread may start it since)."""
        self.jobs.append(proc)
        if self.stopping:
            kill_tree(proc)
        return proc

    def _resume(self, nproc: int) -> None:
        """Every resumed run of this many processes not yet made, in one job; with 4, the resharding legs too."""
        self._no_failure()
        batch = [n for n, (_, _, p, _) in RESUMED_RUNS.items() if p == nproc and n not in self.done]
        runs, legs, resharded = [], [], {}
        for n in batch:
            run, step, _, overrides = RESUMED_RUNS[n]
            stopped_after(self[run], step, self.root / n)
            if n in HALF_WRITTEN:
                ckpt(self.root / n, HALF_WRITTEN[n]).mkdir()
                (ckpt(self.root / n, HALF_WRITTEN[n]) / "__0_0.distcp").write_bytes(b"not a checkpoint")
            runs.append((n, overrides))
        if nproc == 4 and not self.resharded:
            root, source = self.root / "resharded", ckpt(self["fsdp4"], 4)
            initial = ("--checkpoint.initial_load_path", str(source), "--no-checkpoint.initial_load_model_only")
            for name, (run, overrides) in RESHARD_LEGS.items():
                if run is not None:
                    shutil.copytree(ckpt(self[run], 4), ckpt(root / name, 4))
                legs.append((root / name, (*CHECKPOINTED, "--training.steps", "6", *overrides,
                                           *(initial if run is None else ()))))
            legs += [(root / name, SHARED_RUNS[run][1]) for name, run in RESHARD_BACK.items()]
            resharded = {name: root / name for name in RESHARD_LEGS} | {"source_snapshot": snapshot(source)}
        self._make(nproc, runs, legs)
        self.resharded = self.resharded or resharded

    def _make(self, nproc: int, runs: list[tuple[str, tuple[str, ...]]],
              others: list[tuple[Path, tuple[str, ...]]] = ()) -> None:
        """`runs` (name, overrides) in one job of `nproc` processes, then `others` (folder, overrides), with COMMON
        and STEPS before the overrides; the job's output kept beside them."""
        self._finish(self._start(nproc, runs, others))

    def _start(self, nproc: int, runs: list[tuple[str, tuple[str, ...]]],
               others: list[tuple[Path, tuple[str, ...]]] = ()) -> tuple:
        log = self.root / f"job{len(list(self.root.glob('job*.log')))}.log"
        args = (*COMMON, "--training.steps", str(STEPS))
        made = [(self.root / n, n in RECORDED, (*args, *overrides)) for n, overrides in runs]
        proc = start_several(nproc, made + [(f, False, (*args, *overrides)) for f, overrides in others], log)
        return self._track(proc), runs, log

    def _finish(self, started: tuple) -> None:
        proc, runs, log = started
        finish_job(proc, log)
        self.logs.update({n: log for n, _ in runs})
        self.done.update({n: self.root / n for n, _ in runs})  # last: a test that finds a run here reads its log


# The 4-process shared job is the suite's largest, and the unit tests run in one process: so when a session holds both
# (the layout parity tests read every 4-process run), the job starts with the session, beside the unit tests. Every
# multi-process test waits for it; the unit tests whose threads answer within fractions of a second run last of all.
# The other shared jobs are made after it, one after another in a background thread at the lowest CPU priority
# (launch.in_background), on the cores that the tests in front leave idle (launchers starting, faults and timeouts
# waited out); the tests that read them run last. Each job (what makes it) with the files that read it, in their order.
LATER_JOBS = [
    (SharedRuns.reshard_legs, {"test_checkpoint.py", "test_collectives.py", "test_context_parallel.py",  # and the
                               "test_float8.py", "test_pipeline.py", "test_validation.py"}),  # 4-process resumes
    (SharedRuns.probes, {"test_collectives.py", "test_init_layouts.py", "test_syncs.py"}),
    (lambda r: r["tp2_compiled"], {"test_compile.py", "test_context_parallel.py", "test_layouts.py",  # 2 processes
                                   "test_pairs.py", "test_pipeline.py"}),
    (lambda r: r["tp2_compiled_resumed"], {"test_compile.py", "test_context_parallel.py", "test_pipeline.py"}),
    (lambda r: r["pairs17_float32_8p"], {"test_pairs.py"}),  # 8 processes
]
_SHARED: list[SharedRuns] = []
_LATER: list = []  # the session's LATER_JOBS, until they start
HERE = Path(__file__).parent
ANSWER_WITHIN_FRACTIONS = {"test_errors.py", "test_flight_recorder.py"}
# Tests that leave a core idle much of the time (signals, timeouts and restarts waited out, one-process scripts): the
# first multi-process tests, beside the background jobs, which take what they leave.
MOSTLY_WAIT = {"test_preemption.py", "test_restart.py", "test_hung_peer.py", "test_profiling.py",
               "test_reference_curve.py", "test_quick_tour.py"}


def _reads_later_job(item) -> bool:
    return bool({"runs", "resharded", "probed"} & set(item.fixturenames)) and any(
        Path(str(item.path)).name in readers for _, readers in LATER_JOBS)


def pytest_collection_modifyitems(config, items):
    def place(item) -> int:
        path = Path(str(item.path))
        if path.name in ANSWER_WITHIN_FRACTIONS:
            return 4
        if HERE not in path.parents:
            return 0
        return 3 if _reads_later_job(item) else 1 if path.name in MOSTLY_WAIT else 2

    items.sort(key=place)  # stable: each group keeps pytest's order
    if not any(place(i) in (1, 2, 3) for i in items):
        return
    _SHARED.append(shared := SharedRuns(config._tmp_path_factory.mktemp("shared_runs")))
    if any(place(i) == 0 for i in items) and any(Path(str(i.path)).name == "test_layouts.py" for i in items):
        shared.start(4)
    files = {Path(str(i.path)).name for i in items if place(i) == 3}
    _LATER.extend(job for job, readers in LATER_JOBS if readers & files)


def pytest_runtest_setup(item):  # a hook of this folder's tests only
    _SHARED[0].finish_started()
    if _LATER:  # the first test here: the 4-process job has ended
        _SHARED[0].make_in_background(_LATER.copy())
        _LATER.clear()


def pytest_sessionfinish(session):
    for shared in _SHARED:  # a session that ended before any multi-process test (-x, Ctrl-C) leaves no job
        shared.stop()


@pytest.fixture(scope="session")
def runs() -> SharedRuns:
    return _SHARED[0]


@pytest.fixture(scope="session")
def resharded(runs) -> dict:
    return runs.reshard_legs()


@pytest.fixture(scope="session")
def probed(runs) -> Path:
    return runs.probes()


@pytest.fixture(scope="session")
def eager_grads(runs):
    """eager_grads(name): every parameter's gradient after step 1 of the single-process run that the shared run
    `name` is compared with (SINGLE_OF), on the shared runs' batch."""
    return lambda name: load_grads(runs[SINGLE_OF[name]])
