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
import json
import math
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import train
from torchtitan_lite.checkpoint.hf_load import expected_shapes, pieces
from torchtitan_lite.data import files as datasets
from torchtitan_lite.config import help_text, load_config
from torchtitan_lite.config.paths import CALLER_DIR
from torchtitan_lite.data.tokenizer import build_tokenizer
from torchtitan_lite.models import registry
from torchtitan_lite.parallel.dims import ParallelDims
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
    "torchft_lighthouse": "a server, from an optional package (tests/multiprocess/test_replica_groups.py runs one)",
    "export": "only sets a variable for the commands after it",
}
TOKENIZER = "assets/tokenizer/original/tokenizer.model"  # where the big configs expect Llama 3's: the sandbox's BPE
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
    tokenizer_file = root / TOKENIZER
    tokenizer_file.parent.mkdir(parents=True)
    shutil.copy(bpe, tokenizer_file)
    shards = root / "data" / "tokens"
    shards.mkdir(parents=True)
    tokenizer = build_tokenizer(str(tokenizer_file))
    document = datasets.tokenize_documents(iter(["def main():\n    pass\n" * 64]), tokenizer)
    datasets.write_shard(shards / "00000000.bin", iter([document * (2**17 // len(document) + 1)]), tokenizer)  # 128k
    hf_stand_in(root / "hf")
    return root


def hf_stand_in(folder: Path, argv: tuple[str, ...] = ("--job.config_file", "train_configs/debug_model.toml")
                ) -> None:
    """The Hugging Face folder of the model `argv` configures (default: the debug config's, which
    `convert_to_hf.py outputs hf/` writes), as far as `--check` reads it: config.json and the safetensors header. The
    tensors are a sparse file's holes, zeros that take no disk, so a stand-in of an 8B model costs nothing."""
    cfg = load_config(list(argv))
    tokenizer = build_tokenizer(str(ROOT / cfg.model.tokenizer_path) if cfg.model.tokenizer_path else "")
    spec = registry.get(cfg.model.name)
    args = spec.run_args(cfg, tokenizer.n_words)
    hf = spec.hf.bound(args)  # names that depend on the args (DeepSeek-V3's MTP layers)
    folder.mkdir()
    config = hf.config(args, tokenizer.bos_id, tokenizer.eos_id, torch.float32)
    (folder / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for i, (piece, (_, _, shape)) in enumerate(pieces(hf, expected_shapes(spec, args)).items()):
        # One file a tensor, as safetensors maps a whole file at once: a big model's in one would not map.
        name, file = hf.hf_name(piece), f"model-{i:05d}.safetensors"
        size = 2 * math.prod(shape)
        text = json.dumps({"__metadata__": {"format": "pt"}, name: {"dtype": "BF16", "shape": list(shape),
                                                                     "data_offsets": [0, size]}}).encode()
        text += b" " * (-len(text) % 8)
        with open(folder / file, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            f.truncate(8 + len(text) + size)
        weight_map[name] = file
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


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
    if name == "estimate_memory":  # the trainer's options, --world_size and --routing
        world, rest, _ = module.split_options(args)
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
    # A published Hugging Face folder a command starts from: its stand-in, with its tokenizer the one the sandbox's
    # shards were written with (the stand-in of a user's corpus).
    if words[0] == "./run_train.sh" and "--checkpoint.initial_load_in_hf" in words and not Path(
            hf := words[words.index("--checkpoint.initial_load_path") + 1]).exists():
        hf_stand_in(Path(hf), ("--job.config_file", config, *words[1:], "--model.tokenizer_path", TOKENIZER))
        (Path(hf) / "original").mkdir()
        shutil.copy(TOKENIZER, Path(hf) / "original" / "tokenizer.model")
    if words[0] == "./run_train.sh":
        groups = []
        if n := env.get("REPLICA_GROUPS"):  # what run_train.sh adds to every group's arguments
            groups = ["--fault_tolerance.enable", "--fault_tolerance.group_size", n,
                      "--fault_tolerance.groups_per_machine", n]
            monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "started by the launcher")
        check_training(["--job.config_file", config, *words[1:], *groups], int(env.get("NGPU", 4)), monkeypatch,
                       capsys)
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


# ---- Pointers that lead where they say


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(page: Path) -> list[str]:
    """The page's headings, outside its code blocks (a `# comment` in a bash block is none)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]


# `docs/x.md`, `docs/x.md#anchor`, `docs/x.md: Heading`, `README: Heading`, or a bare README.
POINTER = re.compile(r"(README(?:\.md)?|docs/[\w.-]+\.md)(?:#([\w-]+)|: ([A-Z][^();]*))?")


def broken_pointers(text: str) -> list[str]:
    """What is wrong with each docs pointer in `text`: a page that does not exist, an anchor or heading it lacks,
    or the README named without a section (it is an overview now; the reference lives in docs/)."""
    wrong = []
    for match in POINTER.finditer(text):
        name, fragment, heading = match.groups()
        page = ROOT / ("README.md" if name.startswith("README") else name)
        if not page.is_file():
            wrong.append(f"{match[0]}: no such page")
        elif fragment is not None and fragment not in map(anchor, headings(page)):
            wrong.append(f"{match[0]}: {page.name} has no heading with that anchor")
        elif heading is not None and heading.strip() not in headings(page):
            wrong.append(f"{match[0]}: {page.name} has no such heading")
        elif page.name == "README.md" and fragment is heading is None:
            wrong.append(f"{match[0]}: which section? (the options' reference is in docs/)")
    return wrong


def test_help_points_at_pages_and_headings_that_exist():
    text = help_text()
    assert POINTER.search(text), "the help names no docs page: has the pattern gone stale?"
    assert not broken_pointers(text), broken_pointers(text)


def test_a_pointer_to_a_moved_section_is_caught():
    assert broken_pointers("(README: Data and tokenizers)") == [
        "README: Data and tokenizers: README.md has no such heading"]
    assert broken_pointers("(see README)") == ["README: which section? (the options' reference is in docs/)"]
    assert broken_pointers("docs/data.md#packing") == ["docs/data.md#packing: data.md has no heading with that anchor"]
    assert not broken_pointers("(docs/data.md: Mixtures; docs/observability.md#weights--biases, docs/float8.md)")


# ---- Links between pages lead to a file and, with an anchor, to one of its headings

LINKED_PAGES = [*PAGES, *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
# `[text](path)`, `[text](path#anchor)`, `[text](#anchor)`; not URLs (`https:`, `mailto:`).
LINK = re.compile(r"\]\((?![a-z]+:)([^()\s#]*)(?:#([^()\s]*))?\)")


def broken_links(page: Path) -> list[str]:
    """What is wrong with each Markdown link of `page` outside its code blocks: a file that does not exist from the
    page's folder, or an anchor that is none of the linked page's headings (GitHub's anchors, made by `anchor`)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    wrong = []
    for match in LINK.finditer(text):
        path, fragment = match.groups()
        target = page.parent / path if path else page
        if not target.exists():
            wrong.append(f"{page.name}: {match[0][2:-1]}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in map(anchor, headings(target)):
            wrong.append(f"{page.name}: {match[0][2:-1]}: {target.name} has no heading with that anchor")
    return wrong


def test_every_link_of_the_pages_leads_to_a_file_and_heading_that_exist():
    wrong = [w for page in LINKED_PAGES for w in broken_links(page)]
    assert not wrong, "\n".join(wrong)


def test_every_docs_anchor_named_in_the_code_and_tests_exists():
    """`docs/x.md#anchor` in a comment, docstring or message (this file's own examples left out)."""
    folders = ("torchtitan_lite", "scripts", "benchmarks", "tests")
    wrong = []
    for f in [ROOT / "train.py", *(f for folder in folders for f in (ROOT / folder).rglob("*.py"))]:
        if f == Path(__file__).resolve():
            continue
        wrong += [f"{f.relative_to(ROOT)}: {w}" for m in POINTER.finditer(f.read_text()) if m[2] is not None
                  for w in broken_pointers(m[0])]
    assert not wrong, "\n".join(wrong)


def test_a_link_to_a_missing_file_or_anchor_is_caught(tmp_path):
    (tmp_path / "q.md").write_text("# Q\n\n## Memory of 8B, `normal_` (H100)\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "p.md"
    page.write_text("# P\n[a](q.md#memory-of-8b-normal_-h100) [b](#p) [c](https://x.org/#y) [d](q.md)\n"
                    "[e](q.md#memory-of-8b) [f](#q) [g](r.md#p) [h](q.md#not-a-heading)\n")
    assert broken_links(page) == ["p.md: q.md#memory-of-8b: q.md has no heading with that anchor",
                                  "p.md: #q: p.md has no heading with that anchor", "p.md: r.md#p: no such file",
                                  "p.md: q.md#not-a-heading: q.md has no heading with that anchor"]


# ---- The README's layouts say the mesh their commands build

LAYOUT_NAMES = {"PP": "pp", "DP": "dp_replicate", "FSDP": "dp_shard", "CP": "cp", "TP": "tp"}


def readme_layouts() -> list[tuple[str, str]]:
    """(command, comment) of each line of the README's Layouts block."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"\*\*Layouts\.\*\*.*?^```bash\n(.*?)^```", text, re.S | re.M)[1]
    return [tuple(part.strip() for part in line.split("#", 1)) for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("command, comment", readme_layouts())
def test_each_readme_layout_comment_is_the_mesh_its_command_builds(command, comment, monkeypatch):
    """debug_model.toml sets tensor_parallel_degree 2: a command that only adds another degree keeps TP 2, and the
    data-parallel shard takes what is left of NGPU."""
    monkeypatch.chdir(ROOT)
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words if ENV_ASSIGNMENT.match(w))
    assert words[len(env)] == "./run_train.sh", command
    cfg = load_config(["--job.config_file", env.get("CONFIG_FILE", "train_configs/debug_model.toml"),
                       *words[len(env) + 1:]])
    dims = ParallelDims.from_config(cfg.parallelism, int(env["NGPU"]))
    built = {name: getattr(dims, name) for name in LAYOUT_NAMES.values() if getattr(dims, name) > 1}
    said = {LAYOUT_NAMES[name]: int(size) for name, size in re.findall(r"\b(PP|DP|FSDP|CP|TP) (\d+)", comment)}
    assert said == built, f"{command}: the comment says {comment!r}, the command builds {built}"
    schedules = re.findall(r"\b(GPipe|1F1B|Interleaved1F1B|LoopedBFS)\b", comment)
    assert schedules in ([], [cfg.parallelism.pipeline_parallel_schedule]), comment
