"""How a run that cannot go on tells the user why: one `error: ...` line for the whole job, whichever rank fails first.

Under torchrun every rank parses the same config and reaches the same verdict, but not at the same moment. A rank
that finished importing torch a second sooner exits first, torchrun then stops the others with SIGTERM, and rank 0
may die before it has printed anything: the user sees torchrun's failure summary and no reason. So no rank exits on
an error before rank 0 has reported it. Rank 0 prints the line, then posts `reported` in a key-value store that needs
no process group (distributed.job_store: torchrun's agent's, or the one rank 0 serves for the group); the other ranks
wait for that key and exit without a word.

A rank whose error rank 0 does not share (a file missing on one node only) must not wait for a report that never
comes: rank 0 posts `passed` when its own checks before the process group are done, and a rank that sees it reports
the error itself, naming its rank. Once the process group exists, errors are decided on rank 0 and raised on every rank
together (checkpoint._on_rank0), so the others wait for `reported` alone, for a bounded time.

Such a rank writes its line into torchrun's error file rather than to its output, so that torchrun's failure summary
shows it even when only rank 0's output is shown (run_train.sh's LOG_RANK). Where no store can be reached, each
rank prints for itself.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

from torchtitan_lite.distributed import Env, job_store

# Rank 0 reaches its own verdict unless it died, and then torchrun stops this rank anyway: the bound is only a
# backstop against a rank 0 stuck elsewhere. After the group exists, rank 0 raised the same error at the same moment.
_WAIT_BEFORE_GROUP_S, _WAIT_AFTER_GROUP_S, _POLL_S = 600.0, 60.0, 0.05


def _key(name: str) -> str:
    # One namespace per job and per restart: a restarted job must not read the verdict of its previous attempt.
    run, attempt = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"torchtitan_lite/{run}/{attempt}/{name}"


def _say(line: str, env: Env) -> None:
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


def report(error: Exception, env: Env) -> None:
    """Prints `error: <message>` once for the whole job: on rank 0, or on this rank when rank 0 has nothing to say.
    Returns only once the line is out, so the caller may exit."""
    store = job_store(env)
    if env.rank == 0 or store is None:
        _say(f"error: {error}" if env.rank == 0 else f"error: rank {env.rank}: {error}", env)
        if store is not None:
            store.set(_key("reported"), "1")
        return
    after_group = dist.is_initialized()
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
