"""The memory table of docs/performance.md, made from estimate_memory.py's figures so that it cannot go stale.

    python scripts/memory_table.py           # the table as markdown, every row estimated (the pipeline's: minutes)
    python scripts/memory_table.py --check   # also compares it with docs/performance.md: exit 1 naming stale rows

ROWS is the one list of what the table shows. tests/test_memory.py checks on every run of the suite that the page
lists these rows, and the figures of the first (seconds to estimate, as every row but the pipeline's, whose blocks
are all traced: tools/memory_extrapolate.py); this script checks them all, to be run after a change to what the
estimate counts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]

from torchtitan_lite.config import load_config
from torchtitan_lite.tools.memory import Estimate, estimate_memory

PAGE = ROOT / "docs" / "performance.md"


class Row(NamedTuple):
    config: str  # the first three cells, as the page words them
    mesh: str
    micro_batch: str
    world_size: int
    argv: tuple[str, ...]  # the config and its overrides, as estimate_memory.py takes them


def _row(config: str, mesh: str, micro_batch: str, world_size: int, toml: str, *overrides: str) -> Row:
    return Row(config, mesh, micro_batch, world_size, ("--job.config_file", str(ROOT / "train_configs" / toml),
                                                       *overrides))


CP = ("--training.seq_len", "131072", "--parallelism.context_parallel_degree")
FULL_AC = ("--activation_checkpoint.mode", "full")
ROWS = [
    _row("8B, selective AC", "FSDP 8", "1 x 8192", 8, "llama3_8b.toml"),
    _row("70B, full AC", "FSDP 8 x TP 8 (64)", "8 x 8192", 64, "llama3_70b.toml"),
    _row("405B, full AC", "FSDP 16 x TP 8 (128)", "2 x 8192", 128, "llama3_405b.toml",
         "--parallelism.pipeline_parallel_degree", "1", "--training.local_batch_size", "2"),
    _row("405B, full AC (the config)", "PP 8 x FSDP 8 x TP 8 (512), Interleaved1F1B", "16 x 1 x 8192", 512,
         "llama3_405b.toml"),
    _row("8B at 128k, full AC", "CP 4 (FSDP over cp)", "1 x 131072", 4, "llama3_8b.toml", *CP, "4", *FULL_AC),
    _row("8B at 128k, full AC", "CP 8", "1 x 131072", 8, "llama3_8b.toml", *CP, "8", *FULL_AC),
    _row("8B at 128k, selective AC", "CP 8", "1 x 131072", 8, "llama3_8b.toml", *CP, "8"),
    _row("8B at 128k, selective AC", "CP 16", "1 x 131072", 16, "llama3_8b.toml", *CP, "16"),
]
HEADER = ["| config | mesh | micro-batch | params | grads | optimizer | activations | transient | peak |",
          "|---|---|---|---|---|---|---|---|---|"]


def estimate(row: Row) -> Estimate:
    return estimate_memory(load_config(list(row.argv)), row.world_size)


def line(row: Row, e: Estimate) -> str:
    """The row as the page shows it: GiB per rank, two decimals."""
    figures = (e.param_bytes, e.grad_bytes, e.optimizer_bytes, e.activation_bytes, e.transient_bytes, e.peak_bytes)
    return "| " + " | ".join([row.config, row.mesh, row.micro_batch, *(f"{b / 2**30:.2f}" for b in figures)]) + " |"


def page_rows(text: str) -> dict[tuple[str, str, str], str]:
    """The page table's lines by their first three cells, in order."""
    lines = text.splitlines()
    start = lines.index(HEADER[0]) + 2
    rows = {}
    for text_line in lines[start:]:
        if not text_line.startswith("|"):
            break
        cells = [c.strip() for c in text_line.strip("|").split("|")]
        rows[tuple(cells[:3])] = text_line
    return rows


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print("usage: python scripts/memory_table.py [--check]", file=sys.stderr)
        return 2
    check = argv == ["--check"]
    page = page_rows(PAGE.read_text()) if check else {}
    stale = []
    print("\n".join(HEADER), flush=True)
    for row in ROWS:
        new = line(row, estimate(row))
        print(new, flush=True)
        if check and page.get(row[:3]) != new:
            stale.append(f"{', '.join(row[:3])}: the page has {page.get(row[:3])}")
    if check and list(page) != [row[:3] for row in ROWS]:
        stale.append(f"the page's rows are {list(page)}, this script's {[row[:3] for row in ROWS]}")
    for s in stale:
        print(f"stale: {s}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
