"""torchtitan_lite/runtime/torchrun_output.py: a replica group's torchrun output without torchrun's failure report,
its workers' lines intact and in order (the report as torch 2.13's torchrun prints it, a worker SIGKILLed)."""

import io

from torchtitan_lite.runtime.torchrun_output import relay

WORKERS = b"""[group1-rank0]:worker 0 err line
[group1-rank1]:worker 1 err line
"""
REPORT = b"""W1206 12:06:40.162000 15587 elastic/api.py:1028] Sending process 15675 closing signal SIGTERM
E1206 12:06:40.361000 15587 elastic/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 15676) of b
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
[group1-rank0]:a worker's line that came meanwhile
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
=======================================================
train.py FAILED
-------------------------------------------------------
Failures:
[1]:
  exitcode  : -15 (pid: 15675)  (SIGTERM)
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  traceback : Signal 9 (SIGKILL) received by PID 15676
=======================================================
"""


def relayed(text: bytes) -> bytes:
    out = io.BytesIO()
    relay(io.BytesIO(text), out)
    return out.getvalue()


def test_torchruns_report_of_a_failed_worker_is_left_out_and_the_workers_lines_pass_in_order():
    meanwhile = b"[group1-rank0]:a worker's line that came meanwhile\n"
    assert relayed(WORKERS + REPORT + WORKERS) == WORKERS + meanwhile + WORKERS


def test_a_traceback_of_torchrun_that_is_not_a_failed_worker_passes_whole():
    other = b"Traceback (most recent call last):\n  File \"<stdin>\", line 1, in <module>\nRuntimeError: port in use\n"
    assert relayed(WORKERS + other) == WORKERS + other
    assert relayed(other[:60]) == other[:60]  # cut short: shown as it came


def test_a_closed_console_does_not_stop_the_reading():
    class Closed(io.BytesIO):
        def write(self, b):
            raise BrokenPipeError

    src = io.BytesIO(WORKERS * 1000)
    relay(src, Closed())
    assert src.closed
