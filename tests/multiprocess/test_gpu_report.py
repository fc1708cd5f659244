"""benchmarks/gpu_report.py, run as CI runs it on a CPU (the debug model on 2 processes, 4 steps, aot_eager), so the
script a GPU user runs first is never untested: every section is there, and the facts it reports hold."""

import re
import subprocess
import sys

from launch import ROOT, TIMEOUT_S, TINY


def test_gpu_report_on_the_cpu():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"), "--config", str(TINY), "--nproc", "2",
           "--steps", "4", "--warmup", "1", "--backend", "aot_eager"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    for key in ("eager tokens/s", "compiled tokens/s", "eager MFU %", "compiled peak GiB", "estimated peak GiB"):
        assert re.search(rf"^{re.escape(key)}\s+[\d,.]+$", out, re.M), key
    assert "device syncs: steps that only train [0, 0, 0], a logging step 3" in out  # loss, grad norm, stop latch
    # FSDP 2 over 7 groups (6 blocks + the root): the rules of tests/multiprocess/test_collectives.py.
    assert re.search(r"^\s+12 all_gather\s+world\s", out, re.M)
    assert re.search(r"^\s+7 reduce_scatter\s+world\s", out, re.M)
    assert re.search(r"^compiled/eager tokens/s: \d+\.\d+$", out, re.M)
