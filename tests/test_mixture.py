"""Mixtures (data/mixture.py, data/digest.py): exact quotas per batch, spread over any dp slice, exact epochs,
resumes on any layout across phases, a one-source mixture equal to the plain loader, and one line per bad input."""

import json
from fractions import Fraction

import pytest
import torch

import train
from tests.test_data import BYTES, DOCS, arange_source, global_batches, write_jsonl
from torchtitan_lite.config import ConfigError, JobConfig, Phase, Source, load_config
from torchtitan_lite.data.loader import DataLoader, Packer, TokenSource
from torchtitan_lite.data.mixture import MixtureSource, build_data, quotas, spread
from torchtitan_lite.models.documents import document_ids


def mixture(phases=((0, {"a": 3, "b": 1}),), global_batch: int = 8, n=(1003, 777), dp: int = 1) -> MixtureSource:
    """Two sources whose tokens are unique: a window's first token names the source and the window."""
    return MixtureSource({"a": arange_source(n[0] * 10, 9), "b": arange_source(n[1] * 10, 9, seed=1)},
                         list(phases), global_batch, dp)


def config(*sources: Source, phases=(), **training) -> JobConfig:
    cfg = JobConfig()
    cfg.training.dataset, cfg.training.seq_len, cfg.training.steps = "mixture", 16, 100
    for k, v in training.items():
        setattr(cfg.training, k, v)
    cfg.mixture.sources, cfg.mixture.phases = list(sources), list(phases)
    return cfg


SYN = Source(name="syn", dataset="synthetic")


def test_quotas_are_the_largest_remainders_summing_to_the_batch():
    assert quotas({"a": 1, "b": 1, "c": 1}, 8, "w") == {"a": 3, "b": 3, "c": 2}  # a tie goes by name, not order
    assert quotas({"c": 1, "b": 1, "a": 1}, 8, "w") == {"a": 3, "b": 3, "c": 2}
    assert quotas({"a": 0.7, "b": 0.2, "c": 0.1}, 10, "w") == {"a": 7, "b": 2, "c": 1}
    assert sum(quotas({"a": 0.55, "b": 0.3, "c": 0.15}, 16, "w").values()) == 16


@pytest.mark.parametrize("counts", [[6, 2], [5, 3], [3, 3, 2], [7, 1], [13, 7, 4], [1, 1, 1, 5]])
def test_every_dp_slice_holds_each_source_near_its_share(counts):
    g, slots = sum(counts), spread(counts)
    assert [slots.count(i) for i in range(len(counts))] == counts
    for m in range(g + 1):  # every prefix within one window of proportional
        assert all(abs(slots[:m].count(i) - Fraction(m * q, g)) < 1 for i, q in enumerate(counts))
    for dp in (d for d in range(1, g + 1) if g % d == 0):  # spread for dp ranks: each slice within one window
        slots = spread(counts, dp)
        assert [slots.count(i) for i in range(len(counts))] == counts
        for r in range(dp):
            part = slots[r * g // dp:(r + 1) * g // dp]
            assert all(abs(part.count(i) - Fraction(q, dp)) < 1 for i, q in enumerate(counts)), (dp, r)


def test_the_dp_degree_moves_windows_between_slices_never_in_or_out_of_a_batch():
    phases = [(0, {"a": 5, "b": 3}), (3, {"a": 1, "b": 1})]
    one = global_batches(mixture(phases), 1, 6)[0]
    for dp in (2, 4, 8):
        batches, _ = global_batches(mixture(phases, dp=dp), dp, 6)
        for (ref, _), (got, _) in zip(one, batches):
            assert sorted(ref[:, 0].tolist()) == sorted(got[:, 0].tolist())  # a window's first token names it


def test_each_batch_holds_exactly_the_phase_quotas():
    mix = mixture(phases=[(0, {"a": 3, "b": 1}), (4, {"a": 1, "b": 1})])
    for step in range(8):
        where = mix.positions(list(range(step * 8, step * 8 + 8)))
        assert sum(src == 0 for src, _ in where) == (6 if step < 4 else 4)


def test_over_e_epochs_each_window_of_a_source_appears_exactly_e_times():
    b = TokenSource([torch.arange(10**6, 10**6 + 300)], 9, 1, "b")  # tokens apart from a's
    mix = MixtureSource({"a": arange_source(480, 9), "b": b}, [(0, {"a": 1, "b": 1}), (6, {"a": 3, "b": 1})], 8)
    steps = 6 + (3 * 48 - 6 * 4) // 6  # a: 4 windows a batch, then 6, to 3 epochs of its 48
    firsts = mix.windows(torch.arange(steps * 8))[:, 0].tolist()
    counts = torch.bincount(torch.tensor([t // 10 for t in firsts if t < 10**6]), minlength=48)
    assert counts.tolist() == [3] * 48


def test_one_source_mixture_is_the_plain_loader_bit_for_bit():
    plain, _ = global_batches(arange_source(1003 * 10, 9), 1, 20)
    mixed, _ = global_batches(MixtureSource({"a": arange_source(1003 * 10, 9)}, [(0, {"a": 2.5})], 8), 1, 20)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(plain, mixed))
    # Built from the config: a lone source keeps the plain run's seeded key.
    cfg, plain_cfg = config(SYN), config(dataset="synthetic")
    index = torch.arange(64)
    assert torch.equal(build_data(cfg, BYTES, 8)[0].windows(index), build_data(plain_cfg, BYTES, 8)[0].windows(index))


def test_reordering_the_sources_changes_nothing():
    two = [SYN, Source(name="noise", dataset="synthetic", weight=2)]
    index = torch.arange(80)
    first = build_data(config(*two), BYTES, 8)[0].windows(index)
    assert torch.equal(first, build_data(config(*two[::-1]), BYTES, 8)[0].windows(index))
    renamed = [SYN, Source(name="noise2", dataset="synthetic", weight=2)]  # the name keys the order
    assert not torch.equal(first, build_data(config(*renamed), BYTES, 8)[0].windows(index))


@pytest.mark.parametrize("dp_after", [1, 2, 4, 8])
def test_resume_continues_across_a_phase_boundary_on_any_dp(dp_after):
    phases = [(0, {"a": 3, "b": 1}), (6, {"a": 1, "b": 3}), (9, {"a": 1, "b": 1})]
    ref, _ = global_batches(mixture(phases), 1, 12)
    _, loaders = global_batches(mixture(phases), 2, 5)
    got, _ = global_batches(mixture(phases), dp_after, 7, state=loaders[0].state_dict())
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(ref[5:], got))


def resume(source, state: dict) -> None:
    DataLoader(source, 8, 2, 0, 1).load_state_dict(state)


def test_a_future_phase_may_change_and_the_past_may_not():
    loader = DataLoader(mixture([(0, {"a": 3, "b": 1}), (6, {"a": 1, "b": 1})]), 8, 2, 0, 1)
    for _ in range(5):
        loader.next_batch()
    state = loader.state_dict()
    resume(mixture([(0, {"a": 3, "b": 1}), (7, {"a": 1, "b": 3})]), state)  # edits the future: fine
    resume(mixture([(0, {"a": 6, "b": 2})]), state)  # other weights, the same quotas: the same past
    with pytest.raises(ConfigError, match=r"the mixture's past changed: the 5 steps saved drew from step 0: a 6, b 2 "
                                          r"windows per batch, this config gives them from step 0: a 4, b 4"):
        resume(mixture([(0, {"a": 1, "b": 1})]), state)
    with pytest.raises(ConfigError, match="global batches of 8 windows, this run's are 16"):
        DataLoader(mixture(global_batch=16), 16, 2, 0, 1).load_state_dict(state)
    with pytest.raises(ConfigError, match="source 'a' held 1003 windows per epoch when the checkpoint was saved and "
                                          "1000 now"):
        resume(mixture(n=(1000, 777)), state)
    # Saved before digests existed: the load leaves the template's own, a fresh loader's.
    resume(mixture([(0, {"a": 1, "b": 1})]), {**state, "digest": DataLoader(mixture(), 8, 2, 0, 1).state_dict()["digest"]})


def test_a_resume_with_another_seed_is_refused_unless_no_source_it_trained_is_seeded():
    sources = [SYN, Source(name="code", dataset="synthetic", weight=2)]
    loader = DataLoader(build_data(config(*sources, seed=5), BYTES, 8)[0], 8, 2, 0, 1)
    loader.next_batch()
    state = loader.state_dict()
    resume(build_data(config(*sources, seed=5), BYTES, 8)[0], state)
    with pytest.raises(ConfigError, match="the checkpoint was trained with training.seed 5 and this run has 6"):
        resume(build_data(config(*sources, seed=6), BYTES, 8)[0], state)
    # A stream's order is its own: a past drawn from streams alone holds no seed, and any seed resumes it.
    streams = lambda seed: MixtureSource({"a": arange_source(1003 * 10, 9), "web": Stream()},
                                         [(0, {"a": 0, "web": 1})], 8, seed=seed)
    loader = DataLoader(streams(5), 8, 2, 0, 1)
    loader.next_batch()
    assert "seed" not in json.loads(loader.state_dict()["digest"])
    resume(streams(6), loader.state_dict())


def test_toggling_validation_on_held_out_files_is_refused_on_resume():
    train_part, _ = arange_source(1003 * 10, 9).hold_out()
    loader = DataLoader(train_part, 8, 2, 0, 1)
    loader.next_batch()
    with pytest.raises(ConfigError, match="validation held out every 50th window of the training data when the "
                                          "checkpoint was saved, and does not now"):
        resume(arange_source(1003 * 10, 9), loader.state_dict())


class Stream:
    """A streaming part, as HFSource is: each rank reads its own shard of documents in order."""
    streaming, n = True, None

    def open(self, dp_rank, dp_size, docs, offset, position=""):
        documents = ([dp_rank * 1000 + d] * 5 for d in range(docs, 10**6))  # seeks, as HFSource.open does
        return Packer(documents, 10, docs, offset)


def test_a_streamed_source_in_a_mixture_resumes_on_the_same_dp_only():
    parts = lambda: MixtureSource({"a": arange_source(1003 * 10, 9), "web": Stream()}, [(0, {"a": 1, "web": 1})], 8)
    ref, _ = global_batches(parts(), 2, 6)
    _, loaders = global_batches(parts(), 2, 3)
    states = [l.state_dict() for l in loaders]
    resumed = [DataLoader(parts(), 8, 2, r, 2) for r in range(2)]
    for loader, state in zip(resumed, states):
        loader.load_state_dict({**states[0], **state})
    got = [torch.cat([x for loader in resumed for x, _ in loader.next_batch()]) for _ in range(3)]
    assert all(torch.equal(x, y) for (x, _), y in zip(ref[3:], got))
    with pytest.raises(ConfigError, match="the checkpoint streamed the mixture's Hugging Face sources on 2 "
                                          "data-parallel ranks, each its own shard; resuming on 4"):
        DataLoader(parts(), 8, 2, 0, 4).load_state_dict(states[0])


def test_synthetic_windows_are_one_document_in_a_block_causal_mixture(tmp_path):
    """block_causal cuts a window into documents at each BOS: beside text, a synthetic source's windows hold none, so
    they stay whole (causal), as train_configs/debug_mixture.toml says."""
    write_jsonl(tmp_path / "docs.jsonl", DOCS)
    cfg = config(SYN, Source(name="docs", dataset="jsonl", dataset_path=str(tmp_path / "docs.jsonl")), seq_len=64)
    cfg.model.attn_mask_type, cfg.job.dump_folder = "block_causal", str(tmp_path / "run")
    _, _, bos_id, global_batch, source, _ = train.preflight(cfg, 1)
    loader, documents = DataLoader(source, global_batch, global_batch, 0, 1), {"syn": set(), "docs": set()}
    for _ in range(40):
        [(inputs, _)] = loader.next_batch()
        for row, i in zip(document_ids(inputs, bos_id), loader.sources):
            documents[source.names[i]].add(len(row.unique()))
    assert documents["syn"] == {1} and max(documents["docs"]) > 1, documents


def test_the_cap_and_the_plan_are_known_before_the_first_step(caplog):
    code = Source(name="code", dataset="python_stdlib", max_epochs=0.5)
    caplog.set_level("INFO", logger="torchtitan_lite")
    source, vals = build_data(config(code, SYN, steps=10), BYTES, 8)
    assert "mixture plan for 10 steps" in caplog.text and sorted(vals) == []
    n = source.parts[source.names.index("code")].n
    steps = int(n * 0.5 / 4) + 2  # 4 windows per batch: past half an epoch
    with pytest.raises(ConfigError, match=r"mixture source 'code': training.steps = \d+ takes 0.5\d* epochs of its "
                                          r"\d+ windows, over its max_epochs = 0.5"):
        build_data(config(code, SYN, steps=steps), BYTES, 8)


def test_each_source_validates_on_its_own_held_out_part():
    cfg = config(SYN, Source(name="code", dataset="python_stdlib"))
    cfg.validation.enable = True
    source, vals = build_data(cfg, BYTES, 8)
    assert sorted(vals) == ["code", "syn"]
    assert vals["code"].n < source.parts[source.names.index("code")].n  # every 50th file


@pytest.mark.parametrize("change, error_line", [
    (lambda c: setattr(c.mixture, "sources", []), 'training.dataset is "mixture" but [mixture] has no sources'),
    (lambda c: c.mixture.sources.append(Source(name="syn")), "mixture source name 'syn' is used 2 times"),
    (lambda c: setattr(c.mixture, "weights", "syn=1,code=2"), "mixture.weights: no source is named 'code'"),
    (lambda c: setattr(c.mixture, "weights", "syn"), "mixture.weights: 'syn' is not NAME=WEIGHT"),
    (lambda c: c.mixture.phases.append(Phase(5, {"cod": 1})), "mixture phase at step 5: no source is named 'cod'"),
    (lambda c: setattr(c.mixture, "weights", "syn=-1"), "mixture weights: the weight of 'syn' is -1.0"),
    (lambda c: setattr(c.mixture, "weights", "syn=0,b=0"), "mixture weights: every weight is 0"),
    (lambda c: c.mixture.phases.append(Phase(5, {"syn": 1, "b": 0.001})),
     "mixture phase at step 5: weight 0.001 of 'b' is 0.00799 of the 8 windows of a global batch, which rounds to 0"),
    (lambda c: c.mixture.phases.extend([Phase(7, {"syn": 1}), Phase(5, {"syn": 1})]),
     "mixture phases must start in increasing steps after 0: the phase at step 5 comes after the one at step 7"),
    (lambda c: c.mixture.phases.append(Phase(100, {"syn": 1})), "the mixture phase at step 100 starts after the last"),
    (lambda c: setattr(c.mixture.sources[1], "dataset_path", "/no/such"),
     "mixture.sources[b].dataset_path: /no/such does not exist"),
    (lambda c: setattr(c.training, "dataset", "synthetic"), "[mixture] is set but training.dataset is 'synthetic'"),
])
def test_bad_mixtures_are_one_line(change, error_line):
    cfg = config(SYN, Source(name="b", dataset="text", dataset_path=__file__))
    change(cfg)
    with pytest.raises(ConfigError) as e:
        build_data(cfg, BYTES, 8)
    assert error_line in str(e.value) and "\n" not in str(e.value)


def test_the_toml_form_and_check_exit_2(tmp_path, capsys):
    path = tmp_path / "m.toml"
    path.write_text('[training]\ndataset = "mixture"\nseq_len = 16\nsteps = 10\n[mixture]\nweights = "syn=2"\n'
                    '[[mixture.sources]]\nname = "syn"\ndataset = "synthetic"\n'
                    '[[mixture.sources]]\nname = "code"\ndataset = "synthetic"\n'
                    '[[mixture.phases]]\nstart_step = 5\nweights = {syn = 1, code = 3}\n')
    cfg = load_config(["--job.config_file", str(path)])
    assert [s.name for s in cfg.mixture.sources] == ["syn", "code"] and cfg.mixture.phases == [Phase(5, {"syn": 1.0,
                                                                                                         "code": 3.0})]
    mix = build_data(cfg, BYTES, 8)[0]
    assert mix.quotas == [[3, 5], [6, 2]]  # by name: code, syn; --mixture.weights' syn=2 against code's 1
    path.write_text(path.read_text() + "[[mixture.phases]]\nstart_step = 7\nweight = {}\n")
    with pytest.raises(ConfigError, match=r"unknown key weight in \[\[mixture.phases\]\] number 2 in .*; did you mean "
                                          "weights?"):
        load_config(["--job.config_file", str(path)])
    assert train.run(["--job.config_file", str(path), "--mixture.weights", "cod=1"], check=True) == 2
    assert "error: unknown key weight" in capsys.readouterr().err
