"""The pipeline bubble, measured: how much of each step every stage sits idle, beside the theory.

    python benchmarks/pipeline_bubble.py [--microbatches 4] [--steps 6] [--warmup 2] [-- overrides...]

Runs the trainer on 2 processes (PP 2, the debug model, 6 blocks) once per schedule: GPipe, 1F1B (one stage per
rank) and Interleaved1F1B (3 stages of 1 block per rank). In each job every rank times the pipeline call of a step
(`pipeline.Pipeline.forward_backward`) and, inside it, its stages' forward and backward computations
(`forward_one_chunk`, `backward_one_chunk`); the rest of the call is waiting for the other stage. Idle fraction =
1 - busy / call, over the steps after --warmup (the first step infers the stages' shapes). The theory, with p ranks,
m micro-batches and v stages per rank: (p-1)/(m+p-1), and (p-1)/(v*m+p-1) interleaved, for stages of equal work;
here the last stage also runs the output projection, so rank 0 waits more than the theory and rank 1 less, and
their mean is what compares. A mean above the theory is the sends' and the schedule's own time. Prints one line per
schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 3}  # name -> stages per rank on the 6-block debug model
# Interleaved: 6 stages of 1 block (by default 4 stages of 1, 2, 2, 1 blocks), so every stage's work is alike.


def worker(out: Path, warmup: int, argv: list[str]) -> int:
    """train.py, with the pipeline's calls and its stages' computations timed; writes OUT/bubble.RANK.json."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    import train
    from torchtitan_lite.parallel import pipeline

    busy, calls, spans = [0.0], [], []

    def timed(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - t0
        return run

    for name in ("forward_one_chunk", "backward_one_chunk"):
        setattr(_PipelineStageBase, name, timed(getattr(_PipelineStageBase, name)))
    call = pipeline.Pipeline.forward_backward

    def timed_call(self, *args, **kwargs):
        busy[0], t0 = 0.0, time.perf_counter()
        result = call(self, *args, **kwargs)
        calls.append(time.perf_counter() - t0)
        spans.append(busy[0])
        return result

    pipeline.Pipeline.forward_backward = timed_call
    code = train.run(argv)
    kept = list(zip(calls, spans))[warmup:]
    idle = 1 - sum(b for _, b in kept) / sum(c for c, _ in kept)
    (out / f"bubble.{os.environ['RANK']}.json").write_text(json.dumps({
        "idle": idle, "call_s": statistics.median(c for c, _ in kept)}))
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("overrides", nargs="*", help="trainer options after --")
    args = parser.parse_args()
    p, m = 2, args.microbatches
    print(f"PP {p}, {m} micro-batches of 2 x 512 tokens, debug model; idle fraction of each rank's pipeline call")
    print(f"{'schedule':<16} {'stages/rank':>11} {'theory':>8} {'rank 0':>8} {'rank 1':>8} {'mean':>8} {'step s':>8}")
    for schedule, v in SCHEDULES.items():
        with tempfile.TemporaryDirectory() as dump:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(p),
                   __file__, "--worker", dump, str(args.warmup),
                   "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.dump_folder", dump,
                   "--parallelism.pipeline_parallel_degree", str(p), "--parallelism.tensor_parallel_degree", "1",
                   "--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_schedule",
                   schedule, "--parallelism.pipeline_parallel_microbatches", str(m), "--training.local_batch_size",
                   str(2 * m), "--training.seq_len", "512", "--training.steps", str(args.steps),
                   "--training.mixed_precision_param", "float32", "--no-checkpoint.enable", "--no-validation.enable",
                   "--no-compile.enable", "--activation_checkpoint.mode", "none",
                   "--parallelism.pipeline_parallel_layers_per_stage", str(6 // (p * v)), *args.overrides]
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{schedule} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
            ranks = [json.loads((Path(dump) / f"bubble.{r}.json").read_text()) for r in range(p)]
        theory = (p - 1) / (v * m + p - 1)
        idle = [r["idle"] for r in ranks]
        print(f"{schedule:<16} {v:>11} {theory:>8.3f} {idle[0]:>8.3f} {idle[1]:>8.3f} {sum(idle) / p:>8.3f} "
              f"{max(r['call_s'] for r in ranks):>8.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]))
    main()
