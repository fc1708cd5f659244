"""Ctrl-C in one process: the first is recorded like any preemption signal (the run stops after the step it is in),
a second kills at once, and a run stopped by Ctrl-C exits 130 unless torchrun launched it."""

import datetime
import logging
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from torchtitan_lite.runtime.signals import Preemption, exit_code, restore_signals


def test_second_ctrl_c_is_not_held():
    before = signal.getsignal(signal.SIGINT)
    preemption = Preemption(group=None)
    try:
        assert signal.getsignal(signal.SIGINT) == preemption._record
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before kill returns to Python code
        assert preemption.received == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # the next one ends the process, whatever it does
        os.kill(os.getpid(), signal.SIGTERM)  # other signals still only record themselves, however many come
        assert preemption.received == signal.SIGTERM and signal.getsignal(signal.SIGTERM) == preemption._record
    finally:
        restore_signals()
    assert signal.getsignal(signal.SIGINT) == before


def test_exit_code(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert (exit_code(None), exit_code("SIGTERM"), exit_code("SIGINT")) == (0, 0, 130)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")  # a torchrun worker: run_train.sh gives the job its 130
    assert exit_code("SIGINT") == 0


@pytest.mark.parametrize("signum, saving, said", [
    (signal.SIGTERM, True, "SIGTERM: stopping after step 4 at the latest, saving a checkpoint"),
    (signal.SIGINT, False, "SIGINT: stopping after step 4 at the latest, without saving (checkpoint.enable is off); "
                           "Ctrl-C again stops at once, without saving")])
def test_a_signal_is_acknowledged_at_once_even_inside_a_long_call(signum, saving, said):
    """The main thread waits inside a C++ call that Python's signal handler cannot interrupt (a store's get, as a
    collective or a long matmul would): the line comes from the listening thread all the same, before the call
    returns, once. Without the listener (speak=False, the other ranks) nothing is said."""
    heard, logger = [], logging.getLogger("torchtitan_lite")
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logger.addHandler(handler)
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=60))
    before_release = []

    def signal_then_release(speak: bool) -> None:
        os.kill(os.getpid(), signum)
        # A hang detector: the line comes within milliseconds. Silence is given half a second to break.
        deadline = time.monotonic() + (30 if speak else 0.5)
        while not heard and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: acknowledged once only
        time.sleep(0.1)
        before_release.extend(heard)
        store.set("released", "1")

    try:
        for speak in (True, False):
            heard.clear(), before_release.clear()
            preemption = Preemption(group=None, saving=saving, speak=speak)
            preemption.step = 3  # in progress (begin_step sets it): its agreement has gone, the stop comes after step 4
            thread = threading.Thread(target=signal_then_release, args=(speak,))
            thread.start()
            store.get("released")
            thread.join()
            store.delete_key("released")
            assert before_release == ([said] if speak else [])
            restore_signals()
    finally:
        restore_signals()
        logger.removeHandler(handler)
