"""No comment, docstring, message or page names a project file that does not exist (a file moved, a name left behind).

Every tracked text file (*.py, *.md, *.sh, *.slurm, *.toml and #! scripts) is searched for names ending in .py, .md,
.sh, .slurm or .toml: `loader.py`, `data/mixture.py`, `docs/data.md`, `./train_configs/llama3_8b.toml`. A name is
valid when it is the path of a tracked file or the end of one (`loader.py`, `data/mixture.py`: how the package names
its modules), or a path from the mentioning file's folder. Left alone, as they name no file of this project:
- URLs, absolute paths, and paths in a folder of a name the project has none of (`torch/...`, `torchtitan/...`,
  `llama/model.py`, `outputs/config.toml`, `step-N/config.toml`, `<dump_folder>/...`, `$PWD/...`);
- placeholders, a one-letter name: `scripts/S.py`, `docs/x.md`, a test's `c.toml`;
- in a Python file, the names it holds as a whole string literal, `tmp_path / "nope.toml"`: files the code writes or
  opens (running it checks those), which its comments and messages may name too;
- NOT_PROJECT_FILES, each with its reason.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = (".py", ".md", ".sh", ".slurm", ".toml")
# A path of word characters, `.`, `-`, `$VAR`, `<placeholder>` and `{a,b}` parts, ending in a checked suffix.
NAME = re.compile(r"(?<![\w.$/<{])(?!-)(?:[\w.$<>-]|\{[\w,]*\}|/)*\w\.(?:py|md|sh|slurm|toml)(?![\w/]|\.\w)")
LITERAL = re.compile(r"""(["'])([^"'\n]*)\1""")
URL = re.compile(r"\w+://\S+")
NUMBERED = re.compile(r"\.(?:\d+|N)(?=\.\w+$)")  # config.1.toml, config.N.toml: a run's file, moved aside
NOT_PROJECT_FILES = {  # name -> why it is no file of this project
    "config.toml": "the resolved config a run writes into its dump folder and each checkpoint (runtime/run_history.py)",
    "notes.md": "a user's text file, in the examples of docs/data.md and scripts/train_tokenizer.py",
    "benchmarks/llama3_h100_202412_torchtitan.md": "torchtitan's published figures, a file of its repository",
}


def tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def expand(name: str) -> list[str]:
    """`convert_{to,from}_hf.py` -> both names; an f-string's `{value}/...` stays one name, in a folder not ours."""
    m = re.search(r"\{([\w,]*)\}", name)
    return [name] if not m else [n for part in m.group(1).split(",")
                                 for n in expand(name[:m.start()] + part + name[m.end():])]


def is_project_name(name: str, folders: set[str]) -> bool:
    """Whether `name` would be a file of this project (see the module's docstring)."""
    parts = name.removeprefix("./").split("/")
    if name.startswith("/") or len(parts) > 1 and parts[0] not in folders | {".", ".."}:
        return False
    return len(Path(name).stem) > 1 and NUMBERED.sub("", name) not in NOT_PROJECT_FILES


def stale_names(files: list[str], root: Path = ROOT) -> list[str]:
    """`file:line: name` for each mention of a project file that none of `files` is."""
    known, folders = set(files), {part for f in files for part in Path(f).parts[:-1]}
    ends = {"/".join(Path(f).parts[i:]) for f in files for i in range(len(Path(f).parts))}  # loader.py, data/loader.py
    stale = []
    for f in files:
        text = (root / f).read_text(errors="replace")
        if not (f.endswith(TEXT_SUFFIXES) or text.startswith("#!")):
            continue
        own = {s for _, s in LITERAL.findall(text) if NAME.fullmatch(s)} if f.endswith(".py") else set()
        text = URL.sub(lambda m: " " * len(m.group(0)), text)  # blanked, not cut: line numbers hold
        for m in NAME.finditer(text):
            for name in expand(m.group(0)):
                if (name in own or not is_project_name(name, folders) or name.removeprefix("./") in ends
                        or os.path.normpath(os.path.join(os.path.dirname(f), name)) in known):
                    continue
                stale.append(f"{f}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
    return stale


def test_no_comment_or_page_names_a_missing_file():
    this = Path(__file__).relative_to(ROOT).as_posix()  # its examples below name missing files on purpose
    stale = [s for s in stale_names(tracked()) if not s.startswith(f"{this}:")]
    assert not stale, "these name no tracked file (moved? name the file that now holds the code):\n" + "\n".join(stale)


def test_the_search_sees_a_stale_name_and_leaves_others_alone(tmp_path):
    """The rules themselves, each line written into a made-up torchtitan_lite/data/loader.py: what is flagged."""
    files = ["torchtitan_lite/data/loader.py", "docs/data.md", "train_configs/debug_model.toml"]
    lines = {
        "loader.py, data/loader.py, torchtitan_lite/data/loader.py, ../../docs/data.md, docs/data.md": [],
        "see datasets.py and docs/gone.md and ./train_configs/old.toml": ["datasets.py", "docs/gone.md",
                                                                          "./train_configs/old.toml"],
        "torch/distributed/run.py, llama/model.py, outputs/config.toml, /tmp/x/a.py, docs/x.md, notes.md": [],
        "https://github.com/pytorch/torchtitan/blob/main/torchtitan/train.py, config.1.toml, `$PWD/y.toml`": [],
        "convert_{to,from}_hf.py": ["convert_to_hf.py", "convert_from_hf.py"],
    }
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    for line, expected in lines.items():
        (tmp_path / files[0]).write_text(f"# {line}\n")
        found = [s.rpartition(": ")[2] for s in stale_names(files, tmp_path)]
        assert found == expected, (line, found)
