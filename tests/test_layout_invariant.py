"""training.layout_invariant's parts, in one process: the canonical tree and its streaming form, the loader's
interleaved micro-batches, the float32 grad norm, and what the mode refuses. Its layouts' bits are compared in
tests/multiprocess/test_layout_invariant.py."""

import pytest
import torch

import train
from torchtitan_lite.data.loader import DataLoader
from torchtitan_lite.data.synthetic import SyntheticSource
from torchtitan_lite.parallel.ordered_reduce import tree_sum
from torchtitan_lite.training.layout_invariant import COST, COST_CP, Accumulator, Canonical
from torchtitan_lite.training.optim import clip_grad_norm_
from tests.conftest import TINY


class Sum(str):
    """A sum written out: which values were added to which, in which order."""

    def __add__(self, other):
        return Sum(f"({self}+{other})")


def leaves(n: int) -> list[Sum]:
    return [Sum(str(i)) for i in range(n)]


def pairwise(values: list):
    """The tree by its definition, written independently of tree_sum: adjacent pairs, an odd one carried up."""
    if len(values) == 1:
        return values[0]
    pairs = [values[i] + values[i + 1] for i in range(0, len(values) - 1, 2)]
    return pairwise(pairs + values[len(pairs) * 2:])


def test_tree_sum_is_the_pairwise_tree():
    for n in range(1, 41):
        assert tree_sum(leaves(n)) == pairwise(leaves(n))
    assert tree_sum(leaves(6)) == "(((0+1)+(2+3))+(4+5))"


@pytest.mark.parametrize("n", range(1, 41))
def test_the_accumulator_builds_the_tree_one_value_at_a_time(n):
    acc = Accumulator()
    for leaf in leaves(n):
        acc.push(leaf)
        assert len(acc.blocks) <= n.bit_length()  # O(log n) partial sums held
    assert acc.total() == tree_sum(leaves(n))


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("micro_steps", range(1, 13))
def test_ranks_summing_each_micro_step_then_the_accumulator_give_one_process_tree(ranks, micro_steps):
    """A power-of-two data-parallel degree: leaf m * ranks + r on rank r, each micro-step's leaves summed across the
    ranks in rank order (the ordered reduce-scatter), the micro-steps accumulated: one process's tree, any count."""
    every = leaves(ranks * micro_steps)
    acc = Accumulator()
    for m in range(micro_steps):
        acc.push(tree_sum(every[m * ranks:(m + 1) * ranks]))
    assert acc.total() == tree_sum(every)


def test_three_ranks_would_not_be_one_tree():
    """Why the mode refuses a degree that is no power of two: its micro-steps are not subtrees."""
    every = leaves(6)
    acc = Accumulator()
    for m in range(2):
        acc.push(tree_sum(every[m * 3:(m + 1) * 3]))
    assert acc.total() != tree_sum(every)


def test_the_tree_is_an_order_of_its_own_in_floats():
    """Not a no-op: in fp32 the tree and a running sum differ for these values."""
    values = [torch.tensor(v, dtype=torch.float32) for v in (1.0, 4e-8, 4e-8, 4e-8)]  # (1 + a) + (a + a)
    running = values[0]
    for v in values[1:]:
        running = running + v
    assert tree_sum(values) != running


def test_interleaved_micro_batches_are_the_global_batchs_leaves_in_order():
    source = SyntheticSource(seq_len=8, regular_ids=50, seed=3)
    one = DataLoader(source, 12, 1, 0, 1, interleave=1).next_batch()
    for dp in (2, 4):
        ranks = [DataLoader(source, 12, 1, r, dp, interleave=1).next_batch() for r in range(dp)]
        for m in range(12 // dp):
            for r in range(dp):
                assert torch.equal(ranks[r][m][0], one[m * dp + r][0])
    # A pipeline's local batch of 2 leaves (its micro-batches) on each of 2 ranks: leaves 0 and 2, then 4 and 6 on
    # rank 0.
    rank0 = DataLoader(source, 12, 2, 0, 2, interleave=1).next_batch()
    assert [len(b[0]) for b in rank0] == [2, 2, 2]
    assert all(torch.equal(rank0[k][0][j], one[(2 * k + j) * 2][0][0]) for k in range(3) for j in range(2))
    # Without it a rank's micro-batches are its slice's (the default, unchanged).
    assert torch.equal(DataLoader(source, 12, 1, 1, 2).next_batch()[0][0], one[6][0])


def test_the_canonical_accumulation_sums_each_parameters_micro_batches_in_the_tree():
    """One process, no group: the hooks take each micro-batch's gradient as autograd leaves it, and finish sets the
    tree's sum, the loss's too."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    acc = Canonical([w], None)
    acc.start(torch.device("cpu"))
    # (1 + a) + (a + a) is not ((1 + a) + a) + a in fp32: a running sum would not pass
    grads = [torch.tensor([1.0, 1.0]), torch.tensor([2.0, 4e-8]), torch.tensor([3.0, 4e-8]), torch.tensor([4.0, 4e-8])]
    assert not torch.equal(tree_sum(grads), grads[0] + grads[1] + grads[2] + grads[3])
    for g in grads:
        (w * g).sum().backward()
        assert w.grad is None  # taken by the hook
        acc.add(g.sum())
    assert torch.equal(acc.finish(), tree_sum([g.sum() for g in grads]))
    assert torch.equal(w.grad, tree_sum(grads))


def test_a_parameter_a_micro_batch_left_without_a_gradient_is_refused():
    used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    acc = Canonical([used, unused], None)
    acc.start(torch.device("cpu"))
    (used * unused).sum().backward()
    used.sum().backward()  # the second micro-batch reaches `used` alone
    acc.add(torch.ones(()))
    with pytest.raises(RuntimeError, match=r"received \[1, 2\] gradients"):
        acc.finish()


def test_the_grad_norm_in_float32_is_the_float64_norm_rounded():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, 1e-4, 3.0])
    exact = clip_grad_norm_([p], 0.0, 1)
    rounded = clip_grad_norm_([p], 0.0, 1, in_float32=True)
    assert rounded.dtype == torch.float64 and rounded == exact.float().double() and rounded != exact


def test_check_says_what_the_mode_costs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = ["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path), "--training.layout_invariant"]
    assert train.run(argv, check=True) == 0
    assert COST in capsys.readouterr().out


def test_check_says_what_cp_2s_halves_cost(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path), "--training.layout_invariant",
            *CP2_BLOCKS, "--parallelism.context_parallel_degree", "2"]
    assert train.run(argv, check=True) == 0
    assert COST_CP in capsys.readouterr().out


def test_cp_2s_halves_without_the_mode_are_refused(error_line):
    line = error_line(1, list(CP2_BLOCKS))
    assert "training.layout_invariant_cp is training.layout_invariant's order" in line


CP2_BLOCKS = ("--training.layout_invariant_cp", "2")


@pytest.mark.parametrize("world, overrides, named", [
    (4, ["--parallelism.tensor_parallel_degree", "4"], "parallelism.tensor_parallel_degree 4"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--model.flavor", "tiny_moe"], "TP 2 beside FSDP alone"),
    (2, ["--parallelism.context_parallel_degree", "2"], "parallelism.context_parallel_degree is 2"),
    (4, [*CP2_BLOCKS, "--parallelism.context_parallel_degree", "4"], "parallelism.context_parallel_degree is 4"),
    (4, [*CP2_BLOCKS, "--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
     "not tensor, pipeline"),
    (2, [*CP2_BLOCKS, "--parallelism.pipeline_parallel_degree", "2"], "not tensor, pipeline"),
    (4, [*CP2_BLOCKS, "--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree",
         "2"], "replicated data parallelism"),
    (1, [*CP2_BLOCKS, "--training.seq_len", "66"], "training.seq_len 66 is not a multiple of 4"),
    (1, [*CP2_BLOCKS, "--model.flavor", "tiny_moe"], "a mixture of experts"),
    (1, [*CP2_BLOCKS, "--training.z_loss", "1e-4"], "training.z_loss"),
    (2, [*CP2_BLOCKS, "--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_load_balancer",
         "none"], "context_parallel_load_balancer none"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--model.name", "qwen3", "--model.flavor", "debugmodel"],
     "without tied weights"),
    (3, ["--training.global_batch_size", "6"], "parallelism.data_parallel_shard_degree is 3"),
    (8, ["--parallelism.data_parallel_replicate_degree", "4"], "data_parallel_replicate_degree is 4"),
    (4, ["--model.flavor", "tiny_moe", "--parallelism.expert_parallel_degree", "4"], "expert_parallel_degree is 4"),
    (1, ["--training.mixed_precision_param", "bfloat16"], "training.mixed_precision_param"),
    (1, ["--compile.enable"], "compile.enable"),
    (4, ["--parallelism.fsdp_defer_grad_reduce"], "parallelism.fsdp_defer_grad_reduce"),
    (4, ["--parallelism.fsdp_cpu_offload", "--no-parallelism.fsdp_offload_pin_memory"], "parallelism.fsdp_cpu_offload"),
    (1, ["--optimizer.name", "Muon"], "optimizer.name"),
    (1, ["--model.name", "qwen3", "--model.flavor", "debugmodel"], "model.name qwen3"),
    (1, ["--model.flavor", "tiny_moe", "--moe.capacity_factor", "1.25"], "moe.capacity_factor"),
    (1, ["--model.attn_mask_type", "block_causal", "--training.dataset", "python_stdlib"], "block_causal"),
])
def test_what_the_mode_does_not_cover_is_refused_in_one_line(error_line, world, overrides, named):
    line = error_line(world, ["--training.layout_invariant", *overrides])
    assert "training.layout_invariant" in line and named in line and "drop training.layout_invariant" in line
