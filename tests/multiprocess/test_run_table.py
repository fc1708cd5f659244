"""The shared runs' tables (run_table.py) say what they mean: a run's kind comes from its config as the trainer parses
it, never from its name; its model reaches its command line; and the single-process run it is compared with trains
what it trains. In this process, from the command lines alone: nothing here starts a job."""

import pytest

import run_table
from run_table import (ALL_RUNS, CONTEXT_PARALLEL, KINDS, PIPELINED, RESHARD_LEGS, RESUMED_RUNS, SHARED_RUNS, Run,
                       of_kind)
from launch import PP2


@pytest.mark.parametrize("kind", KINDS)
def test_renaming_a_run_changes_none_of_its_kinds(kind):
    renamed = {f"run{i}": run for i, run in enumerate(SHARED_RUNS.values())}
    expected = [f"run{i}" for i, name in enumerate(SHARED_RUNS) if name in of_kind(SHARED_RUNS, kind)]
    assert of_kind(renamed, kind) == expected


def test_a_name_that_says_otherwise_does_not_make_a_kind():
    runs = {"pp2_by_name_only": SHARED_RUNS["fsdp4"], "fsdp4_by_name_only": Run(2, PP2)}
    assert of_kind(runs, "pipelined") == ["fsdp4_by_name_only"]
    assert of_kind(runs, "context_parallel") == []


def test_the_kinds_agree_with_the_names_the_runs_have_today():
    """A cheap check that the parsed kinds select what the names used to: "pp..." pipelined, "...cp..." context
    parallel (test_estimate_memory.py's "pp2" runs among them)."""
    assert PIPELINED == [name for name in SHARED_RUNS if name.startswith("pp")]
    assert CONTEXT_PARALLEL == [name for name in SHARED_RUNS if "cp" in name]
    for name, run in SHARED_RUNS.items():
        assert (run.dims.pp, run.dims.cp, run.dims.tp) == (2 if "pp2" in name else 1,
                                                          4 if "cp4" in name else 2 if "cp2" in name else 1,
                                                          4 if "tp4" in name else 2 if "tp2" in name else 1), name


def test_a_runs_model_reaches_its_command_line():
    assert Run(2, PP2, model="moe").argv == ("--model.name", "moe", *PP2)
    for name, run in {**ALL_RUNS, **RESUMED_RUNS, **RESHARD_LEGS}.items():
        assert run.argv[:2] == ("--model.name", run.model), name
    assert all(run.config.model.name == run.model for run in ALL_RUNS.values())


def test_every_reference_is_one_process_training_what_its_runs_train():
    """The same model (architecture, flavor, masking), sequence length, data, float8 recipe, experts' MXFP8 recipe
    and optimizer: the layout and its options are what a run changes against its reference (a precision too, where
    its test's tolerance says so)."""
    def trains(run: Run) -> tuple:
        cfg, t = run.config, run.config.training
        float8 = cfg.float8.enable_float8_linear and cfg.float8.recipe_name
        experts = cfg.float8.moe_fqns and (cfg.float8.moe_fqns, cfg.float8.moe_recipe_name)
        return cfg.model, t.seq_len, t.dataset, t.dataset_path, float8, experts, cfg.optimizer.name, cfg.muon

    for name, run in ALL_RUNS.items():
        if run.reference is None:
            assert run.nproc == 1, f"{name} has no single-process run to be compared with"
            continue
        reference = ALL_RUNS[run.reference]
        assert (reference.nproc, reference.reference) == (1, None), name
        assert trains(reference) == trains(run), name


def test_a_resumed_run_resumes_a_saved_step_of_a_run_of_its_model():
    for name, resumed in {**RESUMED_RUNS, **RESHARD_LEGS}.items():
        run = ALL_RUNS[resumed.run]
        assert resumed.model == run.model, name
        assert run.config.checkpoint.enable and resumed.after_step % run.config.checkpoint.interval == 0, name


def test_no_name_is_in_two_tables():
    tables = [getattr(run_table, t) for t in ("SHARED_RUNS", "PAIR_RUNS", "REFERENCES", "MASKED_RUNS", "MOE_RUNS",
                                              "COMPILED_RUNS", "FLOAT8_RUNS", "SINGLES", "INVARIANT_RUNS")]
    assert sum(map(len, tables)) == len(ALL_RUNS)  # ALL_RUNS merges them: a second entry would hide the first
    assert not set(ALL_RUNS) & set(RESUMED_RUNS)


def test_every_architecture_meets_every_layout():
    """The model axis, pairwise rather than a cross product (issue 58): each registered architecture the runs train,
    its dense and mixture-of-experts flavors together, is compared with one process on every kind of layout at least
    once; expert parallelism where it has a mixture."""
    def layouts(run: Run) -> set[str]:
        d = run.dims
        kinds = {"pp": d.pp > 1, "cp": d.cp > 1, "tp": d.tp > 1, "fsdp": d.dp_shard * d.cp > 1,
                 "hsdp": d.dp_replicate > 1 and d.dp_shard * d.cp > 1, "ep": d.ep > 1}
        return {kind for kind, used in kinds.items() if used}

    met: dict[str, set[str]] = {}
    for run in ALL_RUNS.values():
        if run.reference is not None and run.record:  # compared with one process, gradients too
            met.setdefault(run.model, set()).update(layouts(run))
    assert set(met) >= {"llama3", "qwen3"}
    every = {"pp", "cp", "tp", "fsdp", "hsdp", "ep"}
    for model, kinds in met.items():
        assert kinds == every, f"{model} never meets {sorted(every - kinds)}"
