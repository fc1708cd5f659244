"""Every command in a ```bash block of README.md and docs/*.md is run or checked, so no page goes stale.

Running them all would take hours and GPUs, so each is checked the cheapest way that still catches a renamed flag, a
removed option or a layout that no longer fits: `./run_train.sh`, `train.py` and `torchrun ... train.py` commands
through `train.py --check` (in this process, `train.run(argv, check=True)`) under the same CONFIG_FILE and
WORLD_SIZE; `python scripts/S.py` commands through that script's own argument parser. The few commands that need a
cluster, a package index or a server are listed in NOT_CHECKED with the reason; any other command fails the test,
so a page cannot add one that nothing checks. The README's quick tour also runs for real
(tests/multiprocess/test_quick_tour.py).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

import train
from torchtitan_lite.data import files as datasets
from torchtitan_lite.config import load_config
from torchtitan_lite.config.paths import CALLER_DIR
from torchtitan_lite.data.tokenizer import build_tokenizer
from torchtitan_lite.quantization import float8

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_CHECKED = {  # a command's first words -> why this test leaves it alone
    "pip install": "installs packages from an index (the set-up line; CI runs it on a fresh machine)",
    "python -m pytest": "the suite itself",
    "sbatch": "needs a Slurm cluster",
    "python -m torch.distributed.flight_recorder.fr_trace": "reads a hung run's comm_traces/ "
                                                            "(tests/multiprocess/test_hung_peer.py runs it on one)",
    "tensorboard": "a server, and an optional package",
    "export": "only sets a variable for the commands after it",
}
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def commands(text: str) -> list[str]:
    """The commands of a page's bash blocks, continuation lines joined, `a && b` split."""
    found = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            # `[--plot out.png]` marks optional arguments: check them too.
            words = [w.removeprefix("[").removesuffix("]") for w in words]
            while words:
                end = words.index("&&") if "&&" in words else len(words)
                found.append(shlex.join(words[:end]))
                words = words[end + 1:]
    return found


def all_commands() -> list[tuple[str, str]]:
    return [(page.name, command) for page in PAGES for command in commands(page.read_text())]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A folder laid out like the repository, where a check may create the folders a command names (outputs/,
    runs/...), with stand-ins for the files the Llama 3 configs expect a user to bring (Llama 3's tokenizer and a
    corpus of token shards): the project's BPE and a one-document shard."""
    root = tmp_path_factory.mktemp("docs")
    for name in ("train_configs", "torchtitan_lite", "scripts"):
        (root / name).symlink_to(ROOT / name)
    bpe = ROOT / "torchtitan_lite" / "assets" / "stdlib_bpe_2k.tiktoken"
    tokenizer_file = root / "assets" / "tokenizer" / "original" / "tokenizer.model"
    tokenizer_file.parent.mkdir(parents=True)
    shutil.copy(bpe, tokenizer_file)
    shards = root / "data" / "tokens"
    shards.mkdir(parents=True)
    tokenizer = build_tokenizer(str(tokenizer_file))
    document = datasets.tokenize_documents(iter(["def main():\n    pass\n" * 64]), tokenizer)
    datasets.write_shard(shards / "00000000.bin", iter([document * (2**17 // len(document) + 1)]), tokenizer)  # 128k
    return root


@functools.cache
def script(name: str):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def check_training(argv: list[str], world_size: int, monkeypatch, capsys) -> None:
    """What run_train.sh runs before torchrun: `WORLD_SIZE=N train.py --check ARGV`, as on the GPUs the pages' big
    configs are written for: float8 (docs/float8.md) is refused on a machine without float8 tensor cores."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setattr(float8, "has_float8_matmul", lambda: True)
    code = train.run(argv, check=True)
    err = capsys.readouterr().err
    assert code == 0, f"train.py --check {shlex.join(argv)} with WORLD_SIZE={world_size}: {err.strip()}"


def check_script(name: str, args: list[str], env: dict[str, str], monkeypatch, capsys) -> None:
    module = script(name)
    if name == "estimate_memory":  # the trainer's options and --world_size
        world, rest = module.split_world_size(args)
        check_training(rest, world or module.default_world_size(load_config(rest)), monkeypatch, capsys)
        return
    try:
        parsed = module.parse_args(args) if hasattr(module, "parse_args") else module.parser().parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"scripts/{name}.py {shlex.join(args)}: {capsys.readouterr().err.strip()}") from e
    if isinstance(parsed, tuple):  # generate.py: (its arguments, config overrides)
        parsed, overrides = parsed
        load_config(overrides)
    for overrides in (getattr(parsed, "run_a", None), getattr(parsed, "run_b", None)):  # loss_compare.py trains
        if overrides is not None:
            config = parsed.config or env.get("CONFIG_FILE", "train_configs/debug_model.toml")
            check_training(["--job.config_file", config, *shlex.split(overrides)], parsed.ngpu or 4, monkeypatch,
                           capsys)


def check(command: str, monkeypatch, capsys) -> None:
    words = shlex.split(command)
    env = {}
    while words and ENV_ASSIGNMENT.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    for prefix in NOT_CHECKED:
        if words[:len(prefix.split())] == prefix.split():
            return
    config = env.get("CONFIG_FILE", "train_configs/debug_model.toml")
    if words[0] == "./run_train.sh":
        check_training(["--job.config_file", config, *words[1:]], int(env.get("NGPU", 4)), monkeypatch, capsys)
    elif words[:2] == ["python", "train.py"]:
        args = words[2:]
        if args == ["--help"]:
            with pytest.raises(SystemExit) as exited:
                train.run(args, check=True)
            assert exited.value.code == 0 and "--training.steps" in capsys.readouterr().out
        else:
            args = args[1:] if args[:1] == ["--check"] else args
            check_training(args, int(env.get("WORLD_SIZE", 1)), monkeypatch, capsys)
    elif words[0] == "torchrun":
        launcher, args = words[1:words.index("train.py")], words[words.index("train.py") + 1:]
        sizes = [int(launcher[launcher.index(flag) + 1]) for flag in ("--nnodes", "--nproc_per_node")]
        check_training(args, math.prod(sizes), monkeypatch, capsys)
    elif words[0] == "python" and re.fullmatch(r"scripts/\w+\.py", words[1]):
        check_script(Path(words[1]).stem, words[2:], env, monkeypatch, capsys)
    else:
        raise AssertionError(f"{command!r}: this test does not know how to check it: add a way to, or list it in "
                             "NOT_CHECKED with the reason")


def test_the_pages_have_commands_to_check():
    pages = {page for page, _ in all_commands()}
    assert {"README.md", "configuration.md", "parallelism.md", "checkpointing.md", "data.md", "hf_interop.md",
            "float8.md"} <= pages


@pytest.mark.parametrize("page, command", all_commands())
def test_every_documented_command_is_valid(page, command, sandbox, monkeypatch, capsys):
    monkeypatch.chdir(sandbox)  # the configs' own paths are read from here (run_train.sh's cd)
    monkeypatch.setenv(CALLER_DIR, str(sandbox))  # and the typed ones too
    check(command, monkeypatch, capsys)
