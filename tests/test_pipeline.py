"""Pipeline stages keep the full model's parameter names, and a pipeline layout that cannot run is refused before any
process starts, in one line (train.py --check, what run_train.sh runs before torchrun)."""

import pytest
import torch

from torchtitan_lite.config import load_config
from torchtitan_lite.models import registry
from torchtitan_lite.models.common.decoder import Decoder
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.parallel.pipeline import merge_stages, split_stages, stage_blocks
from torchtitan_lite.parallel.stage_ties import pipeline_ends
from tests.multiprocess.launch import DEBUGMODEL

ARGS = FLAVORS["debugmodel"].with_(vocab_size=64)  # 6 blocks
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


@pytest.mark.parametrize("schedule, stages", [("1F1B", [[0], [1]]), ("Interleaved1F1B", [[0, 2], [1, 3]])])
def test_stages_hold_every_parameter_once_under_its_full_model_name(schedule, stages):
    with torch.device("meta"):
        full = {n: p.shape for n, p in Transformer(ARGS).named_parameters()}
    p = load_config(["--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.pipeline_parallel_schedule", schedule]).parallelism
    seen = []
    for rank in (0, 1):
        parts = split_stages(Transformer, ARGS, rank, p)
        assert [part.stage for part in parts] == stages[rank]
        names = [n for part in parts for n, _ in part.named_parameters()]
        # What the optimizer and the checkpoint see.
        assert dict(merge_stages(parts).named_parameters()).keys() == set(names)
        seen += names
    assert sorted(seen) == sorted(full)  # each exactly once
    last = split_stages(Transformer, ARGS, 1, p)[-1]
    assert split_stages(Transformer, ARGS, 0, p)[0].tok_embeddings is not None
    assert last.output is not None and last.norm is not None
    assert list(last.layers) == (["3", "4", "5"] if schedule == "1F1B" else ["5"])


def test_a_tied_table_keeps_its_name_on_the_first_and_last_stages():
    """Qwen3's tied embeddings: the last stage keeps the embedding module (unused by its forward) so that the table is
    "tok_embeddings.weight" there too, as on the first stage and in one process (checkpoints, optimizer state); the
    stages between hold none, and all know the model ties (stage_ties.py makes its groups on every rank)."""
    args = registry.get("qwen3").args("debugmodel", 64, 32).with_(n_layers=3)
    p = load_config(["--parallelism.pipeline_parallel_degree", "3"]).parallelism
    first, middle, last = (split_stages(Decoder, args, rank, p)[0] for rank in range(3))
    assert first.output is None and middle.tok_embeddings is None and last.output.weight is last.tok_embeddings.weight
    assert (first.tied, middle.tied, last.tied) == (["tok_embeddings.weight"], [], ["tok_embeddings.weight"])
    assert first.ties and middle.ties and last.ties
    untied = split_stages(Decoder, ARGS, 1, load_config(PP2).parallelism)[0]
    assert untied.tok_embeddings is None and untied.tied == [] and not untied.ties
    hidden = torch.randn(1, 4, args.dim)  # the last stage takes hidden states, never embeds them
    with torch.device("meta"):
        assert last(hidden.to("meta")).shape == (1, 4, 64)


def test_the_tied_groups_pair_each_pipelines_first_and_last_ranks():
    assert pipeline_ends(torch.arange(8).reshape(4, 2), 0) == [[0, 6], [1, 7]]  # pp 4 x dp 2
    assert pipeline_ends(torch.arange(8).reshape(2, 4), 1) == [[0, 3], [4, 7]]  # dp 2 x pp 4
    assert pipeline_ends(torch.arange(8).reshape(2, 2, 2), 0) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_blocks_split_evenly_or_the_way_torchtitan_splits_llama3_405b():
    assert stage_blocks(6, 3) == [2, 2, 2]
    # The embedding and the output count as a block each when only that divides: the end stages hold one block less.
    assert stage_blocks(6, 4) == [1, 2, 2, 1]
    assert stage_blocks(126, 16) == [7] + [8] * 14 + [7]  # 405B, PP 8 interleaved
    assert stage_blocks(6, 5) is None and stage_blocks(6, 8) is None


CASES = {  # world size, overrides, what the one line must name: of the debug model's 6 blocks, as ARGS above
    "blocks_not_split_evenly": (5, ["--parallelism.pipeline_parallel_degree", "5"], "6 blocks do not split evenly"),
    "stages_exceed_blocks": (8, ["--parallelism.pipeline_parallel_degree", "8"], "8 pipeline stages exceed"),
    "layers_per_stage_not_a_divisor": (2, [*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "4"],
                                       "layers_per_stage 4 does not divide"),
    "fewer_microbatches_than_stages": (2, [*PP2, "--parallelism.pipeline_parallel_microbatches", "1"],
                                       "microbatches 1 is fewer than the 2 pipeline stages"),
    "local_batch_not_split": (2, [*PP2, "--parallelism.pipeline_parallel_microbatches", "3"],
                              "local_batch_size 2 does not split into 3"),
    "unknown_schedule": (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "ZeroBubbles"],
                         "unknown parallelism.pipeline_parallel_schedule 'ZeroBubbles'"),
    "refused_schedule": (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "zbvzerobubble"],
                         "ZBVZeroBubble is not supported"),
    "interleaved_with_one_stage_per_rank": (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                                "--parallelism.pipeline_parallel_layers_per_stage", "3"],
                                            "Interleaved1F1B runs several stages per rank"),
    "1f1b_with_two_stages_per_rank": (2, [*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "1"],
                                      "1F1B runs one stage per rank"),
    "degrees_not_multiplying": (4, [*PP2, "--parallelism.tensor_parallel_degree", "4"], "pipeline_parallel_degree 2"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_pipeline_layout_is_one_line(case, error_line):
    world, overrides, expected = CASES[case]
    assert expected in error_line(world, [*DEBUGMODEL, *overrides])
