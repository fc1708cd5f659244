"""Ctrl-C in one process: the first is recorded like any preemption signal (the run stops after the step it is in),
a second kills at once, and a run stopped by Ctrl-C exits 130 unless torchrun launched it."""

import os
import signal

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
