"""training.layout_invariant against the default, per layout, on the CPU, through the trainer: the step's time and the
process's peak memory, and whether the layout's curve is the single process's bitwise.

    python benchmarks/layout_invariant.py [--steps 10] [--repeats 2] [--layouts single,single_1core,fsdp2,...]

The debug model (6 blocks of 256) on 8 sequences of 256 tokens a step, micro-batches of 2 sequences on every
layout (1 process and TP 2 accumulate 4, FSDP 2 and DDP 2 accumulate 2, PP 2 runs 2 local batches of 2 pipeline
micro-batches). Each layout's two modes run in turn, `--repeats` times (default, invariant, default, invariant), so
that drift on a shared machine hits both alike. A run's figure is the median step time over its steps after the
first two (metrics.jsonl's elapsed time between records) and its largest memory_gib (the resident set's peak, on
the CPU). The mode computes with one thread a process on the CPU: the single process pays for it where it had every
core, the others had one each already; "single_1core" binds both modes to one core, which leaves the mode's own
cost. The layouts ending in "_halves", and "cp2", run the mode with training.layout_invariant_cp 2 (CP 2's token
halves), compared with single_1core_halves. A line per layout:
`LAYOUT: invariant/default step time X (a s / b s), memory Y GiB / Z GiB, bitwise to 1 process: yes|no`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from muon_step import run, step_seconds

# Beside muon_step.MODEL (the debug model's config, no validation or checkpoints, every step logged).
BATCH = ("--training.seq_len", "256", "--training.local_batch_size", "2", "--training.global_batch_size", "8",
         "--training.mixed_precision_param", "float32")
# "single_1core": one process bound to one core in both modes (taskset), the mode's own cost at equal threads.
LAYOUTS = {"single": (1, ()), "single_1core": (1, ()), "fsdp2": (2, ()), "fsdp4": (4, ()),
           "hsdp2x2": (4, ("--parallelism.data_parallel_replicate_degree", "2")),
           "ddp2": (2, ("--parallelism.data_parallel_replicate_degree", "2",
                        "--parallelism.data_parallel_shard_degree", "1")),
           # 1F1B, 2 local batches of 2 pipeline micro-batches of 2 sequences.
           "pp2": (2, ("--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4")),
           "tp2": (2, ("--parallelism.tensor_parallel_degree", "2")),
           # training.layout_invariant_cp 2 in the mode: every layout in CP 2's token halves; CP 2 itself.
           "single_1core_halves": (1, ()), "fsdp2_halves": (2, ()),
           "cp2": (2, ("--parallelism.context_parallel_degree", "2"))}
HALVES = {"single_1core_halves", "fsdp2_halves", "cp2"}  # their reference: single_1core_halves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        curves = {}
        for layout in args.layouts.split(","):
            nproc, overrides = LAYOUTS[layout]
            figures: dict[str, list[tuple[float, float]]] = {"default": [], "invariant": []}
            for repeat in range(args.repeats):
                for mode in figures:
                    flag = ("--training.layout_invariant",) if mode == "invariant" else ()
                    if mode == "invariant" and layout in HALVES:
                        flag += ("--training.layout_invariant_cp", "2")
                    records = run(Path(tmp) / f"{layout}-{mode}-{repeat}", nproc, *BATCH, *overrides, *flag,
                                  "--training.steps", str(args.steps),
                                  launcher=("taskset", "-c", "0") if layout.startswith("single_1core") else ())
                    figures[mode].append((step_seconds(records), max(r["memory_gib"] for r in records)))
                    curves[layout, mode] = [(r["loss"], r["grad_norm"]) for r in records]
            (t_default, m_default), (t_inv, m_inv) = ((statistics.median(t for t, _ in f), max(m for _, m in f))
                                                      for f in figures.values())
            reference = ("single_1core_halves" if layout in HALVES else "single", "invariant")
            same = curves[layout, "invariant"] == curves.get(reference)
            print(f"{layout}: invariant/default step time {t_inv / t_default:.2f} ({t_inv:.3f} s / {t_default:.3f} s), "
                  f"memory {m_inv:.2f} GiB / {m_default:.2f} GiB, bitwise to 1 process: "
                  f"{'yes' if same else 'no' if reference in curves else 'not run'}", flush=True)


if __name__ == "__main__":
    main()
