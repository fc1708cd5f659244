import dataclasses
import math

import pytest

from torchtitan_lite.config import OPTIONS, TABLES, ConfigError, JobConfig, help_text, load_config, to_toml, validate


def all_keys() -> list[tuple[str, str, object]]:
    """(section, key, default) for every option, read from the dataclasses so new options are covered too; the
    lists of tables ([[mixture.sources]]) have their own help lines."""
    return [(s.name, f.name, f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
            for s in dataclasses.fields(JobConfig) for f in dataclasses.fields(s.default_factory())
            if f"{s.name}.{f.name}" not in TABLES]


def shown(default: object) -> str:
    """How help prints a default: as TOML would, with none for None."""
    if default is None:
        return "none"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, list):
        return "[" + ", ".join(shown(v) for v in default) + "]"
    return f'"{default}"' if isinstance(default, str) else repr(default)


def write(tmp_path, text: str, name: str = "c.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_defaults_load_and_match_the_dataclasses():
    cfg = load_config([])
    assert cfg == JobConfig()
    assert cfg.training.seq_len == 2048 and cfg.optimizer.lr == 8e-4
    assert cfg.lr_scheduler.decay_ratio is None and cfg.checkpoint.initial_load_model_only is True


def test_toml_values_are_loaded_and_config_file_is_recorded(tmp_path):
    path = write(tmp_path, '[training]\nsteps = 7\nmax_norm = 2\n[model]\nflavor = "8B"\n[compile]\nenable = true\n')
    cfg = load_config(["--job.config_file", path])
    assert cfg.training.steps == 7 and cfg.model.flavor == "8B" and cfg.compile.enable is True
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)  # int accepted for float
    assert cfg.job.config_file == path
    assert cfg.training.seq_len == 2048  # untouched keys keep their defaults


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n")
    # The config file may come after an override: it is found anywhere in argv.
    cfg = load_config(["--training.steps", "9", "--job.config_file", path])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.training.local_batch_size == 8  # default


def test_equals_form_and_negative_numbers():
    cfg = load_config(["--optimizer.lr=3e-4", "--training.global_batch_size", "-1", "--job.description=a=b"])
    assert cfg.optimizer.lr == 3e-4 and cfg.training.global_batch_size == -1 and cfg.job.description == "a=b"


def test_bool_flags():
    assert load_config(["--compile.enable"]).compile.enable is True
    assert load_config(["--compile.enable", "--training.deterministic"]).training.deterministic is True
    assert load_config(["--no-checkpoint.initial_load_model_only"]).checkpoint.initial_load_model_only is False
    for text, want in [("true", True), ("no", False), ("1", True), ("False", False)]:
        assert load_config(["--compile.enable", text]).compile.enable is want
        assert load_config([f"--compile.enable={text}"]).compile.enable is want
    assert "--compile.enable" in error(["--compile.enable=maybe"])
    assert "--no-training.steps" in error(["--no-training.steps"])


def test_optional_float_from_cli_and_toml(tmp_path):
    assert load_config(["--lr_scheduler.decay_ratio", "0.25"]).lr_scheduler.decay_ratio == 0.25
    path = write(tmp_path, "[lr_scheduler]\ndecay_ratio = 0.5\n")
    assert load_config(["--job.config_file", path]).lr_scheduler.decay_ratio == 0.5
    cfg = load_config(["--job.config_file", path, "--lr_scheduler.decay_ratio", "none"])
    assert cfg.lr_scheduler.decay_ratio is None
    assert load_config(["--lr_scheduler.decay_ratio=None"]).lr_scheduler.decay_ratio is None


@pytest.mark.parametrize("argv, named, suggestion", [
    (["--training.step", "3"], "--training.step", "--training.steps"),
    (["--trainig.steps", "3"], "--trainig.steps", "--training.steps"),
    (["--steps", "3"], "--steps", "--training.steps"),
])
def test_unknown_cli_option_suggests_the_real_one(argv, named, suggestion):
    msg = error(argv)
    assert named in msg and "did you mean" in msg and suggestion in msg


def test_unknown_toml_key_and_section_suggest_the_real_one(tmp_path):
    msg = error(["--job.config_file", write(tmp_path, "[training]\nseq_lne = 3\n")])
    assert "training.seq_lne" in msg and "did you mean training.seq_len" in msg
    msg = error(["--job.config_file", write(tmp_path, "[trainng]\nsteps = 3\n")])
    assert "[trainng]" in msg and "did you mean training" in msg
    msg = error(["--job.config_file", write(tmp_path, "steps = 3\n")])  # a key outside any section
    assert "steps" in msg and "training.steps" in msg


@pytest.mark.parametrize("toml, key", [
    ('[training]\nsteps = "10"\n', "training.steps"),  # string for int
    ("[training]\nsteps = 1.5\n", "training.steps"),  # float for int
    ("[training]\nsteps = true\n", "training.steps"),  # bool is an int in Python, not here
    ("[compile]\nenable = 1\n", "compile.enable"),  # int for bool
    ("[optimizer]\nlr = \"fast\"\n", "optimizer.lr"),
    ("[job]\ndescription = 3\n", "job.description"),
    ("training = 3\n", "training"),  # a section that is not a table
])
def test_wrong_toml_types_name_the_key(tmp_path, toml, key):
    assert key in error(["--job.config_file", write(tmp_path, toml)])


@pytest.mark.parametrize("argv, key", [
    (["--training.steps", "1.5"], "--training.steps"),
    (["--training.steps", "ten"], "--training.steps"),
    (["--optimizer.lr", "fast"], "--optimizer.lr"),
])
def test_wrong_cli_types_name_the_key(argv, key):
    assert key in error(argv)


def test_choices_are_enforced():
    msg = error(["--optimizer.implementation", "fast"])
    assert "optimizer.implementation" in msg and "for-loop" in msg and "'fast'" in msg
    assert "activation_checkpoint.mode" in error(["--activation_checkpoint.mode", "some"])


@pytest.mark.parametrize("argv, expected", [
    (["--training.seq_len", "1"], "training.seq_len must be >= 2 (got 1)"),
    (["--training.steps", "-5"], "training.steps must be >= 1 (got -5)"),
    (["--training.global_batch_size", "0"], "training.global_batch_size must be -1"),
    (["--optimizer.lr", "0"], "optimizer.lr must be > 0"),
    (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio must be none or in [0, 1]"),
    (["--lr_scheduler.min_lr_factor", "-0.1"], "lr_scheduler.min_lr_factor must be in [0, 1]"),
    (["--training.max_norm", "-1"], "training.max_norm must be >= 0"),
    (["--parallelism.data_parallel_shard_degree", "0"], "parallelism.data_parallel_shard_degree must be -1"),
    (["--parallelism.tensor_parallel_degree", "0"], "parallelism.tensor_parallel_degree must be >= 1"),
    (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k must be >= 0"),
    (["--metrics.log_freq", "0"], "metrics.log_freq must be >= 1"),
    (["--validation.steps", "0"], "validation.steps must be >= 1"),
    (["--activation_checkpoint.selective_ac_option", "every"], "activation_checkpoint.selective_ac_option"),
])
def test_impossible_values_are_rejected(argv, expected):
    assert expected in error(argv)


NUMBERS = [o for o in [*OPTIONS.values(), *(o for _, item in TABLES.values() for o in item.values())]
           if o.type in (int, float)]


@pytest.mark.parametrize("o", NUMBERS, ids=[o.key for o in NUMBERS])
def test_every_number_declares_its_range_and_floats_refuse_nan_and_inf(o):
    assert o.rule is not None, f"{o.key}: give it a range in opt(..., rule=...) (torchtitan_lite/config/rules.py)"
    assert o.default is None or o.rule.ok(o.default)
    if o.type is float:
        assert not any(o.rule.ok(v) for v in (math.nan, math.inf, -math.inf)), o.rule.text


@pytest.mark.parametrize("argv, expected", [
    # The issue's four: each passed `train.py --check`, and AdamW then raised on every rank.
    (["--optimizer.beta2", "1.5"], "optimizer.beta2 must be in [0, 1) (got 1.5)"),
    (["--optimizer.eps", "-1"], "optimizer.eps must be > 0 and finite (got -1.0)"),
    (["--optimizer.lr", "inf"], "optimizer.lr must be > 0 and finite (got inf)"),
    (["--checkpoint.load_step", "-5"], "checkpoint.load_step must be -1 (the newest complete checkpoint) or >= 0 "
                                       "(got -5)"),
    (["--optimizer.beta1", "1"], "optimizer.beta1 must be in [0, 1) (got 1.0)"),  # 1 would never forget
    (["--optimizer.beta1", "-0.1"], "optimizer.beta1 must be in [0, 1) (got -0.1)"),
    (["--optimizer.eps", "0"], "optimizer.eps must be > 0 and finite (got 0.0)"),
    (["--optimizer.lr", "nan"], "optimizer.lr must be > 0 and finite (got nan)"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay must be >= 0 and finite (got -0.1)"),
    (["--optimizer.weight_decay", "inf"], "optimizer.weight_decay must be >= 0 and finite (got inf)"),
    (["--training.max_norm", "inf"], "training.max_norm must be >= 0 and finite (0 disables clipping) (got inf)"),
    (["--lr_scheduler.min_lr_factor", "nan"], "lr_scheduler.min_lr_factor must be in [0, 1] (got nan)"),
    (["--lr_scheduler.decay_ratio", "inf"], "lr_scheduler.decay_ratio must be none or in [0, 1] (got inf)"),
    (["--training.seed", "-1"], "training.seed must be in [0, 2**64) (got -1)"),
    (["--training.seed", str(2**64)], f"training.seed must be in [0, 2**64) (got {2**64})"),
    (["--comm.train_timeout_seconds", "0"], "comm.train_timeout_seconds must be in [1, 604800] (got 0)"),
    (["--comm.init_timeout_seconds", "100000000000000"],
     "comm.init_timeout_seconds must be in [1, 604800] (got 100000000000000)"),
    (["--parallelism.pipeline_parallel_microbatches", "0"],
     "parallelism.pipeline_parallel_microbatches must be >= 1 or -1 (got 0)"),
])
def test_out_of_range_numbers_are_one_line_naming_the_range(argv, expected):
    assert error(argv) == expected


@pytest.mark.parametrize("toml, expected", [
    ("[optimizer]\nlr = inf\n", "optimizer.lr must be > 0 and finite (got inf)"),
    ("[optimizer]\nbeta2 = nan\n", "optimizer.beta2 must be in [0, 1) (got nan)"),
    ("[training]\nmax_norm = -inf\n", "training.max_norm must be >= 0 and finite (0 disables clipping) (got -inf)"),
])
def test_toml_nan_and_inf_are_refused(tmp_path, toml, expected):
    assert error(["--job.config_file", write(tmp_path, toml)]) == expected


@pytest.mark.parametrize("argv", [["--optimizer.beta2", "1.5"], ["--optimizer.eps", "-1"], ["--optimizer.lr", "inf"],
                                  ["--checkpoint.load_step", "-5"]])
def test_check_refuses_the_issues_examples_in_one_line(argv, error_line):
    assert error_line(4, argv).startswith(f"error: {argv[0][2:]} must be ")


def test_range_edges_are_allowed():
    cfg = load_config(["--training.seq_len", "2", "--lr_scheduler.decay_ratio", "0", "--training.max_norm", "0",
                       "--activation_checkpoint.selective_ac_option", "op"])
    assert cfg.training.seq_len == 2 and cfg.lr_scheduler.decay_ratio == 0.0
    cfg = load_config(["--optimizer.beta1", "0", "--optimizer.beta2", "0.999999", "--optimizer.weight_decay", "0",
                       "--checkpoint.load_step", "0", "--training.seed", str(2**64 - 1), "--lr_scheduler.min_lr_factor",
                       "1", "--optimizer.eps", "1e-300"])
    assert cfg.optimizer.beta1 == 0 and cfg.checkpoint.load_step == 0 and cfg.training.seed == 2**64 - 1


def test_validate_checks_configs_built_in_code():
    cfg = JobConfig()
    validate(cfg)
    cfg.training.steps = "10"
    with pytest.raises(ConfigError, match="training.steps"):
        validate(cfg)


def test_malformed_toml_names_the_file(tmp_path):
    path = write(tmp_path, "[training\nsteps = 3\n")
    msg = error(["--job.config_file", path])
    assert path in msg and "not valid TOML" in msg and "line 1" in msg


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    msg = error(["--job.config_file", path])
    assert "not found" in msg and path in msg


@pytest.mark.parametrize("argv, expected", [
    (["train.toml"], "unexpected argument 'train.toml'"),
    (["--training.steps"], "--training.steps is missing its value"),
    (["--training.steps", "--training.seq_len", "4"], "--training.steps is missing its value"),
])
def test_malformed_command_lines(argv, expected):
    assert expected in error(argv)


def test_to_toml_round_trips_exactly(tmp_path):
    first = write(tmp_path, "[optimizer]\nlr = 3e-4\n", "first.toml")
    cfg = load_config(["--job.config_file", first, "--optimizer.eps=1e-15", "--lr_scheduler.decay_ratio=0.1",
                       "--training.max_norm=0.30000000000000004", "--compile.enable", "--model.flavor=8B",
                       "--job.description", 'quote " backslash \\ tab \t newline \n é ✓ \x7f'])
    assert cfg.optimizer.lr == 3e-4
    again = load_config(["--job.config_file", write(tmp_path, to_toml(cfg), "again.toml")])
    again.job.config_file = cfg.job.config_file  # the only field that names where it was read from
    assert again == cfg


def test_list_options_take_a_toml_array_or_a_comma_list_and_check_each_item(tmp_path):
    path = write(tmp_path, '[float8]\nfilter_fqns = ["attention.wk", "w3"]\n')
    cfg = load_config(["--job.config_file", path])
    assert cfg.float8.filter_fqns == ["attention.wk", "w3"]
    assert load_config(["--float8.filter_fqns", " wq, w2,"]).float8.filter_fqns == ["wq", "w2"]
    assert load_config(["--job.config_file", path, "--float8.filter_fqns", ""]).float8.filter_fqns == []
    assert error(["--job.config_file", write(tmp_path, '[float8]\nfilter_fqns = "w3"\n', "s.toml")]) == (
        f"float8.filter_fqns in {tmp_path / 's.toml'} must be a list of strings (got str 'w3')")
    assert error(["--job.config_file", write(tmp_path, '[float8]\nfilter_fqns = ["w3", 1]\n', "i.toml")]) == (
        f"float8.filter_fqns in {tmp_path / 'i.toml'} must be a list of strings (got list ['w3', 1])")
    assert "filter_fqns = [\"attention.wk\", \"w3\"]" in to_toml(cfg)
    again = load_config(["--job.config_file", write(tmp_path, to_toml(cfg), "again.toml")])
    assert again.float8.filter_fqns == ["attention.wk", "w3"]


def test_to_toml_omits_none_and_it_reloads_as_default(tmp_path):
    text = to_toml(JobConfig())
    assert "decay_ratio" not in text and "lr = 0.0008" in text
    assert load_config(["--job.config_file", write(tmp_path, text)]).lr_scheduler.decay_ratio is None


def test_help_lists_every_option_with_default_and_choices(capsys):
    text = help_text()
    lines = text.splitlines()
    for section, key, default in all_keys():
        line = next((l for l in lines if l.strip().startswith(f"--{section}.{key} ")), None)
        assert line is not None, f"--{section}.{key} missing from help"
        assert f" = {shown(default)}" in line, line
    assert "{foreach, fused, for-loop}" in text
    for key, (_, options) in TABLES.items():  # the lists of tables: a header, then each field as in TOML
        assert f"  [[{key}]]  (TOML only) " in text
        assert all(f"    {o.name} {o.type.__name__} = " in text for o in options.values())
    assert "  --optimizer.beta2 float = 0.95  must be in [0, 1)" in lines
    assert "  --lr_scheduler.decay_ratio float|none = none  must be none or in [0, 1]" in lines
    assert all(" must be " in l for l in lines if l.strip().startswith(tuple(f"--{o.key} " for o in NUMBERS)))
    with pytest.raises(SystemExit) as e:
        load_config(["--training.steps", "3", "--help"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == text



def test_a_mistyped_choice_gets_a_did_you_mean():
    """A value outside an option's choices, and a flavor in another case (difflib alone finds none for "8b")."""
    from torchtitan_lite.models import registry

    assert error(["--moe.score_func", "sigmod"]).endswith("(got 'sigmod'); did you mean sigmoid?")
    with pytest.raises(ConfigError) as e:
        registry.get("llama3").args("8b", 128256, 8192)
    assert str(e.value).endswith("; did you mean 8B?"), e.value
