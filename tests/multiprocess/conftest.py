"""The suite's shared runs (run_table.py): each made once per session, on first use or ahead of it in the
background (the end of this file says which), and read by every test that needs it.

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
import made_later
import probes
from launch import (COMMON, STARTED_IN_BACKGROUND, STEPS, ckpt, finish_job, in_background, kill_tree, snapshot,
                    start_job, start_several, stopped_after, torchrun_cmd, train_job)
from run_table import ALL_RUNS, HALF_WRITTEN, RESHARD_BACK, RESHARD_LEGS, RESUMED_RUNS, SHARED_RUNS, Resumed, Run


class SharedRuns:
    def __init__(self, root: Path):
        self.root, self.done, self.logs, self.resharded = root, {}, {}, {}
        self.results = {}  # made_later's jobs by name: (what make returned, or None, and what it raised, or None)
        self.own_locks = {}  # made_later's jobs by name: the lock held while one is made
        self.started = {}  # processes -> the job start() left running: (its process, its runs, its log)
        # One job at a time, for a test or the background thread; `failure`: what a background job raised.
        self.lock, self.jobs, self.probed, self.stopping, self.failure = threading.RLock(), [], None, False, None
        # Set where the session reads both the 4-process resumed runs and the probes: then one job makes both.
        self.probes_beside_resumes = False

    def start(self, nproc: int) -> None:
        """Starts the job of every shared run of `nproc` processes and returns: it runs while other tests do."""
        self.started[nproc] = self._start(nproc, self._not_made(nproc))

    def finish_started(self) -> None:
        """Waits for what start() began. Under the lock: a caller that finds a job being waited for by another
        thread waits for it too, rather than read runs not yet made. A job leaves `started` once made, so finding it
        empty needs no lock, which a background job holds while it runs."""
        if not self.started:
            return
        with self.lock:
            for nproc in list(self.started):
                self._finish(self.started[nproc])
                del self.started[nproc]

    def __getitem__(self, name: str) -> Path:
        """The dump folder of the shared run `name` (COMMON settings, STEPS steps), launched on first use."""
        if name in self.done:
            return self._get(name)
        with self.lock:  # a single-process run too: the background may be making it (singles)
            return self._get(name)

    def _get(self, name: str) -> Path:
        self.finish_started()
        if name not in self.done:
            if name in RESUMED_RUNS:
                self._resume(RESUMED_RUNS[name].nproc)
            elif (run := ALL_RUNS[name]).nproc == 1:
                (self.root / name).mkdir(parents=True, exist_ok=True)
                with recording(self.root / name) if run.record else contextlib.nullcontext():
                    train_job(1, self.root / name, *COMMON, "--training.steps", str(STEPS), *run.argv)
                self.done[name] = self.root / name
            else:  # every shared run of this many processes not yet made, in one job (several_runs.py)
                self._no_failure()
                self._make(run.nproc, self._not_made(run.nproc))
        return self.done[name]

    def _not_made(self, nproc: int) -> list[tuple[str, Run]]:
        """(name, run) of every shared run of `nproc` processes not yet made."""
        return [(n, run) for n, run in ALL_RUNS.items() if run.nproc == nproc and n not in self.done]

    def output(self, name: str) -> str:
        """What the job that made `name` printed (every run of that job; each names its own dump folder)."""
        self[name]
        return self.logs[name].read_text()

    def singles(self) -> None:
        """Every single-process shared run not yet made, in one job of 1 process: the background's way (a test that
        needs one first makes it in its own process, which the background's thread must not train in)."""
        with self.lock:
            self.finish_started()
            if batch := self._not_made(1):
                self._no_failure()
                self._make(1, batch)

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
                spec = self._probes_spec()
                cmd = torchrun_cmd(4, Path(probes.__file__), str(spec))
                self._finish((self._track(start_job(*cmd, spec.parent / "log")), [], spec.parent / "log"))
                self.probed = spec.parent
            return self.probed

    def _probes_spec(self) -> Path:
        """probes.py's SPEC_JSON for every part the test modules registered, each writing into probes/KIND."""
        out = self.root / "probes"
        spec = {kind: [str(out / kind), *args] for kind, args in probes.REGISTERED.items()}
        for kind in spec:
            (out / kind).mkdir(parents=True, exist_ok=True)
        (out / "spec.json").write_text(json.dumps(spec))
        return out / "spec.json"

    def made(self, name: str):
        """What the job `name` registered in made_later returned, made on first use; what it raised, raised."""
        result, error = self.make_own(name)
        if error is not None:
            raise error
        return result

    def make_own(self, name: str) -> tuple:
        """(what the job `name` returned, what it raised), made once: the background thread makes it without
        raising, so that a test's own job never stops the thread or fails another test. Under a lock of its own: a
        test waits for its job, never for a shared job the thread is making."""
        if name not in self.results:
            with self.own_locks.setdefault(name, threading.Lock()):  # setdefault: one lock per name, atomically
                if name not in self.results:
                    (folder := self.root / name).mkdir()
                    try:
                        self.results[name] = (made_later.REGISTERED[name](folder), None)
                    except Exception as e:  # noqa: BLE001 - the failure of the tests that read it, not the thread's
                        self.results[name] = (None, e)
        return self.results[name]

    def make_in_background(self, jobs: list) -> None:
        """Makes `jobs` (_background_jobs' makers) one after another in a thread of their own, at the lowest CPU
        priority. When a shared job fails, the thread stops, and every test that needs a job not yet made fails with
        its log; a test's own job (made_later) keeps its failure for its readers (make_own)."""
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
        for proc in [*self.jobs, *STARTED_IN_BACKGROUND]:
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
        batch = [n for n, resumed in RESUMED_RUNS.items() if resumed.nproc == nproc and n not in self.done]
        runs, legs, resharded = [], [], {}
        for n in batch:
            resumed = RESUMED_RUNS[n]
            stopped_after(self[resumed.run], resumed.after_step, self.root / n)
            if n in HALF_WRITTEN:
                ckpt(self.root / n, HALF_WRITTEN[n]).mkdir()
                (ckpt(self.root / n, HALF_WRITTEN[n]) / "__0_0.distcp").write_bytes(b"not a checkpoint")
            runs.append((n, resumed))
        if nproc == 4 and not self.resharded:
            root = self.root / "resharded"
            for name, leg in RESHARD_LEGS.items():
                source, initial = ckpt(self[leg.run], leg.after_step), ()
                if leg.initial_load:  # its snapshot now, before the leg reads it: reading must write nothing
                    initial = ("--checkpoint.initial_load_path", str(source), "--no-checkpoint.initial_load_model_only")
                    resharded["source_snapshot"] = snapshot(source)
                else:
                    shutil.copytree(source, ckpt(root / name, leg.after_step))
                legs.append((root / name, (*leg.argv, *initial)))
            legs += [(root / name, SHARED_RUNS[run].argv) for name, run in RESHARD_BACK.items()]
            resharded |= {name: root / name for name in RESHARD_LEGS}
        # The probes after them, in the same job: a job of 4 ranks costs seconds of start-up before any of it.
        spec = self._probes_spec() if nproc == 4 and self.probes_beside_resumes and self.probed is None else None
        self._make(nproc, runs, legs, spec)
        self.resharded = self.resharded or resharded
        if spec is not None:
            self.probed = spec.parent

    def _make(self, nproc: int, runs: list[tuple[str, Run | Resumed]],
              others: list[tuple[Path, tuple[str, ...]]] = (), probes_spec: Path | None = None) -> None:
        """`runs` (name, Run or Resumed) in one job of `nproc` processes, then `others` (folder, overrides), with COMMON
        and STEPS before the overrides, then probes.py's parts of `probes_spec`; the job's output kept beside them."""
        self._finish(self._start(nproc, runs, others, probes_spec))

    def _start(self, nproc: int, runs: list[tuple[str, Run | Resumed]],
               others: list[tuple[Path, tuple[str, ...]]] = (), probes_spec: Path | None = None) -> tuple:
        log = self.root / f"job{len(list(self.root.glob('job*.log')))}.log"
        args = (*COMMON, "--training.steps", str(STEPS))
        made = [(self.root / n, run.record, (*args, *run.argv)) for n, run in runs]
        proc = start_several(nproc, made + [(f, False, (*args, *overrides)) for f, overrides in others], log,
                             probes_spec)
        return self._track(proc), runs, log

    def _finish(self, started: tuple) -> None:
        proc, runs, log = started
        finish_job(proc, log)
        self.logs.update({n: log for n, _ in runs})
        self.done.update({n: self.root / n for n, _ in runs})  # last: a test that finds a run here reads its log


def _job_of(table: dict, nproc: int):
    """What makes the job of `table`'s runs of `nproc` processes: reading any of them makes every one not yet made."""
    first = next((name for name, run in table.items() if run.nproc == nproc), None)
    return lambda shared: first and shared[first]


# The 4-process shared job is the suite's largest, and the unit tests run in one process: so when a session holds both
# (the layout parity tests read every 4-process run: their module is marked `starts_with_session(4)`), the job starts
# with the session, beside the unit tests. Every multi-process test waits for it; the unit tests whose threads answer
# within fractions of a second (marked `answers_within_fractions`) run last of all.
# The other shared jobs are made after it, one after another in a background thread at the lowest CPU priority
# (launch.in_background), from the moment it ends: on the core the unit tests still running in one process leave
# idle, then on what the multi-process tests in front leave (launchers starting, faults and timeouts waited out); the
# tests that read them run last. A test module says which it reads (`reads(job, ...)`, pytest.ini
# registers the markers); only the jobs some selected test reads are made, in this order, and then the tests' own
# jobs registered in made_later, in the order their modules were collected.
BACKGROUND_JOBS = {
    "resumed_4p": SharedRuns.reshard_legs,  # the 4-process resumed runs, and the resharding legs in the same job
    "probes": SharedRuns.probes,  # made at the end of resumed_4p's job where the session reads both
    # The references of the parity tests, which read them with the runs of several processes (`reads` of any job
    # below): made here, not at the end of the session where those tests run.
    "singles": SharedRuns.singles,
    "shared_2p": _job_of(ALL_RUNS, 2),
    "resumed_2p": _job_of(RESUMED_RUNS, 2),
    "shared_8p": _job_of(ALL_RUNS, 8),
}
_SHARED: list[SharedRuns] = []
_LATER: list = []  # the session's background jobs (_background_jobs' makers), until they start
_LATER_LOCK = threading.Lock()
HERE = Path(__file__).parent


def _background_jobs() -> dict:
    """Every job the background can make, by name, in order: BACKGROUND_JOBS', then the tests' own (made_later)."""
    return {**BACKGROUND_JOBS, **{name: lambda shared, name=name: shared.make_own(name)
                                  for name in made_later.REGISTERED}}


def _reads(item) -> set[str]:
    """The background jobs `item` reads: its `reads` markers' jobs, where it asks for shared runs at all."""
    if not {"runs", "resharded", "probed", "made"} & set(item.fixturenames):
        return set()
    jobs = {job for mark in item.iter_markers("reads") for job in mark.args}
    if unknown := jobs - _background_jobs().keys():
        raise pytest.UsageError(f"{item.nodeid} reads {sorted(unknown)}: no such job in {list(_background_jobs())}")
    return jobs


def pytest_collection_modifyitems(config, items):
    def place(item) -> int:
        if item.get_closest_marker("answers_within_fractions"):
            return 3
        return 0 if HERE not in Path(str(item.path)).parents else 2 if _reads(item) else 1

    items.sort(key=place)  # stable: each group keeps pytest's order
    if not any(place(i) in (1, 2) for i in items):
        return
    _SHARED.append(shared := SharedRuns(config._tmp_path_factory.mktemp("shared_runs")))
    if any(place(i) == 0 for i in items):
        for nproc in sorted({m.args[0] for i in items for m in i.iter_markers("starts_with_session")}):
            shared.start(nproc)
    read = set().union(*(_reads(i) for i in items if place(i) == 2))
    if read & {"shared_2p", "resumed_2p", "resumed_4p", "shared_8p"}:
        read.add("singles")
    shared.probes_beside_resumes = {"resumed_4p", "probes"} <= read
    _LATER.extend(make for job, make in _background_jobs().items() if job in read)
    if shared.started and _LATER:
        threading.Thread(target=_start_later, args=(shared, True), daemon=True).start()


def _start_later(shared: SharedRuns, watching: bool = False) -> None:
    """Once the job started with the session has ended, the background jobs start, once: from the thread that
    watches for its end (`watching`), or the first multi-process test, whichever comes first."""
    try:
        shared.finish_started()
    except Exception as e:  # noqa: BLE001 - the tests that read its runs fail with it
        if not watching:
            raise
        shared.failure = e
        return
    with _LATER_LOCK:
        if _LATER:
            shared.make_in_background(_LATER.copy())
            _LATER.clear()


def pytest_runtest_setup(item):  # a hook of this folder's tests only
    _start_later(_SHARED[0])


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
def made(runs):
    """made(name): what the test's own job `name` (made_later.py) returned, made in the background or now."""
    return runs.made


@pytest.fixture(scope="session")
def eager_grads(runs):
    """eager_grads(name): every parameter's gradient after step 1 of the single-process run that the shared run
    `name` is compared with (its `reference`), on the shared runs' batch."""
    return lambda name: load_grads(runs[ALL_RUNS[name].reference])
