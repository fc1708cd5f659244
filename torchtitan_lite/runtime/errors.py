"""How a run that cannot go on tells the user why: one `error: ...` line for the whole job, whichever rank fails first.

Under torchrun every rank parses the same config and reaches the same verdict, but not at the same moment. A rank
that finished importing torch a second sooner exits first, torchrun then stops the others with SIGTERM, and rank 0
may die before it has printed anything: the user sees torchrun's failure summary and no reason. So no rank exits on
an error before rank 0 has reported it. Rank 0 prints the line, then posts `reported` in a key-value store that needs
no process group (distributed.job_store: torchrun's agent's, or the one rank 0 serves for the group); the other ranks
wait for that key and exit without a word.

A rank whose error rank 0 does not share (a file missing on one node only) must not wait for a report that never
comes: rank 0 posts `passed` when its own checks before the process group are done, and a rank that sees it reports
the error itself, naming its rank.

Once the process group exists, errors are decided on rank 0 and raised on every rank together (checkpoint._on_rank0),
or are a collective's timeout, which every rank waiting on the stalled step meets within one timeout of the others.
Rank 0 may be the hung rank, though, and then it reports nothing, and a store it serves never answers (a client of a
stopped server waits forever, whatever its timeout). So from then on the line goes through a store that does not live
in rank 0: the agent's, or one rank 1 serves (group_formed), and every wait on it is bounded. The others give rank 0
that long to speak, then speak for it; the first to claim the line in the store prints it, so there is one line
however many ranks survive.

When a worker dies, torchrun stops the others (SIGTERM) and its failure summary names the dead rank. A rank that
torchrun has stopped then says nothing: it leaves at once instead of waiting for rank 0's line, since rank 0 may be
waiting on it (a pipeline's receive) and speaks once it has gone, without the witness, which may have gone with rank 1.

Such a rank writes its line into torchrun's error file rather than to its output, so that torchrun's failure summary
shows it even when only rank 0's output is shown (run_train.sh's LOG_RANK). Where no store can be reached, each
rank prints for itself.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from torchtitan_lite.runtime import signals
from torchtitan_lite.runtime.process import Env, job_store, train_timeout

# Rank 0 reaches its own verdict unless it died, and then torchrun stops this rank anyway: the bound is only a
# backstop against a rank 0 stuck elsewhere. After the group exists, rank 0 raised the same error at the same moment,
# or meets its own timeout within one training timeout of this rank's unless it is the hung one: the others wait the
# shorter of that and _WAIT_AFTER_GROUP_S. A store that answers at all answers in milliseconds.
_WAIT_BEFORE_GROUP_S, _WAIT_AFTER_GROUP_S, _STORE_ANSWER_S, _POLL_S = 600.0, 60.0, 5.0, 0.05
# Once torchrun asks this rank to stop (before or during a gather), a worker has exited (a rank that only hangs stops
# nobody): torchrun signals every survivor at once, so their posts come within moments and the dead rank's never does.
# Waiting longer only delays the restart.
_AFTER_STOP_S = 2.0


def _key(name: str) -> str:
    # One namespace per job and per restart: a restarted job must not read the verdict of its previous attempt.
    run, attempt = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"torchtitan_lite/{run}/{attempt}/{name}"


def _say(line: str, env: Env) -> None:
    # run_train.sh repeats the line after torchrun's failure summary, whose "root cause" is the first rank to exit,
    # not the one that explains the failure: the job's own line comes last.
    if job_log := os.environ.get("TORCHTITAN_LITE_ERROR_LOG"):
        with open(job_log, "a") as f:
            f.write(line + "\n")
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if env.rank != 0 and error_file:  # torchrun's summary prints an error file's "py_callstack" for its rank
        with open(error_file, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    else:
        print(line, file=sys.stderr, flush=True)


def checks_passed(env: Env) -> None:
    """Rank 0 found nothing wrong before the process group: a rank with an error of its own must report it itself."""
    if env.rank == 0 and (store := job_store(env)) is not None:
        store.set(_key("passed"), "1")


def group_formed(env: Env) -> None:
    """Every rank, once the process group exists and rank 0 still answers: reaches the store a line goes through
    when rank 0 cannot say it."""
    _witness(env)


@functools.cache
def _witness(env: Env) -> dist.Store | None:
    """The agent's store, which lives in torchrun, or else (the job store is rank 0's) one rank 1 serves, its address
    posted in rank 0's: a hung rank 0 or a hung rank 1 leaves the other one to speak. None without a job store."""
    store = job_store(env)
    if store is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return store
    key = _key("witness")
    try:
        if env.rank == 1:
            # rank 1 shares rank 0's node, and so its address, unless each node has a single rank
            host = os.environ["MASTER_ADDR"] if env.local_rank == 1 else socket.getfqdn()
            witness = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            store.set(key, f"{host} {witness.port}")
            return witness
        host, port = store.get(key).decode().split()
        # a short bound on connecting: an address other nodes cannot reach must not hold up the start
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=_STORE_ANSWER_S),
                             wait_for_workers=False)
    except RuntimeError:  # DistStoreError, DistNetworkError
        return None


_SILENT = object()


def _ask(call, *args):
    """call(*args) on a store, or _SILENT when it does not answer in _STORE_ANSWER_S (its server is stopped or gone).
    A store that fell silent is not asked again: a second request could interleave with the first on its socket."""
    answer = []

    def run() -> None:
        try:
            answer.append(call(*args))
        except RuntimeError:
            answer.append(_SILENT)

    thread = threading.Thread(target=run, daemon=True)  # left behind, it ends with the process
    thread.start()
    thread.join(_STORE_ANSWER_S)
    return answer[0] if answer else _SILENT


def gather(env: Env, name: str, value: str, wait_s: float) -> dict[int, str]:
    """Posts `value` as this rank's `name` in the store a line goes through, then returns every rank's `name` posted
    within `wait_s` (all ranks', or sooner when every rank posted; at most _AFTER_STOP_S more once torchrun stops
    this rank): what surviving ranks know about a hang, pooled without a collective. Only this rank's without such a
    store."""
    witness = _witness(env) if dist.is_initialized() else None
    if witness is None or _ask(witness.set, _key(f"{name}/{env.rank}"), value) is _SILENT:
        return {env.rank: value}
    deadline, stopped = time.monotonic() + wait_s, False
    posted = _ask(witness.add, _key(f"{name}/count"), 1)
    while posted is not _SILENT and posted < env.world_size and time.monotonic() < deadline:
        if not stopped and (stopped := signals.stop_requested()):
            deadline = min(deadline, time.monotonic() + _AFTER_STOP_S)
        time.sleep(_POLL_S)
        posted = _ask(witness.add, _key(f"{name}/count"), 0)
    got = {env.rank: value}  # this rank's own post, whatever becomes of the store
    for rank in range(env.world_size):
        key = _key(f"{name}/{rank}")
        if (there := _ask(witness.check, [key])) is _SILENT or (there and (v := _ask(witness.get, key)) is _SILENT):
            break
        if there:
            got[rank] = v.decode()
    return got


def report(error: Exception, env: Env) -> None:
    """Prints `error: <message>` once for the whole job: on rank 0, or on this rank when rank 0 has nothing to say.
    Returns only once the line is out, so the caller may exit."""
    if dist.is_initialized() and (witness := _witness(env)) is not None:
        return _report_once(error, env, witness)
    store = job_store(env)
    if env.rank == 0 or store is None:
        _say(f"error: {error}" if env.rank == 0 else f"error: rank {env.rank}: {error}", env)
        if store is not None:
            store.set(_key("reported"), "1")
        return
    after_group = dist.is_initialized()  # and yet no witness: its store could not be reached
    deadline = time.monotonic() + (_WAIT_AFTER_GROUP_S if after_group else _WAIT_BEFORE_GROUP_S)
    while time.monotonic() < deadline:
        try:
            if store.check([_key("reported")]):
                return
            if not after_group and store.check([_key("passed")]):
                break
        except RuntimeError:  # the store was rank 0's (no agent store) and rank 0 has exited, having reported
            return
        time.sleep(_POLL_S)
    _say(f"error: rank {env.rank}: {error}", env)


def _report_once(error: Exception, env: Env, witness: dist.Store) -> None:
    """After the group exists: rank 0 says it, or a surviving rank when rank 0 stays silent; one line either way."""
    if env.rank != 0:
        timeout = train_timeout()
        deadline = time.monotonic() + min(_WAIT_AFTER_GROUP_S, timeout.total_seconds() if timeout else float("inf"))
        while time.monotonic() < deadline:
            if _ask(witness.check, [_key("reported")]) is not False:
                return  # said; or silent: the witness's server is the hung rank, and rank 0 is alive to speak
            # Stopped by torchrun: a worker failed, and torchrun's summary names it. Rank 0 may be waiting on this
            # rank (a pipeline's receive): it speaks once this rank has gone.
            if signals.stop_requested():
                return
            time.sleep(_POLL_S)
    # Stopped, the others say nothing (above): no election, and no call to a witness that may have gone with rank 1.
    if env.rank == 0 and signals.stop_requested():
        return _say(f"error: {error}", env)
    me = str(env.rank)
    speaker = _ask(witness.compare_set, _key("speaker"), "", me)  # atomic: one rank wins
    if speaker is _SILENT or speaker.decode() == me:
        _say(f"error: {error}" if env.rank == 0 else f"error: rank {env.rank}: {error}", env)
        if speaker is not _SILENT:
            _ask(witness.set, _key("reported"), "1")
