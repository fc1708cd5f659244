"""Document masking (models/documents.py): a packed window computes each of its documents as if it were run alone."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtitan_lite.models import documents
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.runtime.metrics import storage_bytes

BOS, EOS, VOCAB = 256, 257, 258  # the byte-level tokenizer's
SEQ = 96
# The largest difference between a document's per-token loss in a packed window and alone, fp32 on the CPU: the
# same arithmetic but for SDPA summing over more keys (those of other documents, at weight exactly 0). Measured:
# 4.8e-7 over these windows.
TOLERANCE = 1e-6


def model(**changes) -> Transformer:
    m = Transformer(FLAVORS["debugmodel"].with_(vocab_size=VOCAB, max_seq_len=SEQ, **changes))
    m.init_weights(seed=3)
    return m.eval()


def doc(n: int, gen: torch.Generator) -> list[int]:
    return [BOS, *torch.randint(0, 256, (n,), generator=gen).tolist(), EOS]


def test_ids_and_positions_restart_at_each_bos():
    tokens = torch.tensor([[7, 8, EOS, BOS, 5, EOS, BOS, BOS, 9],  # a fragment, a document, an empty one, another
                           [BOS, 1, 2, 3, 4, 5, 6, 7, 8]])  # one document; the second row knows nothing of the first
    ids = documents.document_ids(tokens, BOS)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 2, 3, 3], [1] * 9]
    assert documents.positions(ids).tolist() == [[0, 1, 2, 0, 1, 2, 0, 0, 1], list(range(9))]
    allowed = documents.allowed(ids)[0, 0]
    assert allowed[4].tolist() == [False, False, False, True, True, False, False, False, False]
    assert allowed.equal(allowed.tril())


def windows() -> dict[str, list[list[int]]]:
    """Windows of SEQ tokens as the loader cuts them, each as the pieces that must be computed alone."""
    gen = torch.Generator().manual_seed(0)
    a, b, c, d, e = (doc(n, gen) for n in (30, 12, 0, 70, 200))
    return {
        # starts inside a document (its fragment's positions start at the window), ends cutting one
        "packed": [a[10:], b, c, d[: SEQ - len(a[10:]) - len(b) - len(c)]],
        "inside_a_long_document": [e[20:20 + SEQ]],  # longer than the window: no BOS in it at all
        "starting_at_a_document": [e[:SEQ]],
    }


@pytest.mark.parametrize("window", windows())
def test_each_document_in_a_packed_window_is_computed_as_if_alone(window):
    """Per-token losses (and the logits behind them) of every document in a block_causal window equal those of that
    document, or fragment, run alone through the plain causal model, to TOLERANCE."""
    pieces, m = windows()[window], model()
    tokens = torch.tensor([sum(pieces, [])])
    assert tokens.shape == (1, SEQ)
    labels = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = m(tokens, documents=documents.document_ids(tokens, BOS))
        packed_loss = F.cross_entropy(packed[0], labels[0], reduction="none")
        start, worst = 0, 0.0
        for piece in pieces:
            span = slice(start, start + len(piece))
            alone = m(torch.tensor([piece]))[0]
            worst = max(worst, (F.cross_entropy(alone, labels[0, span], reduction="none") - packed_loss[span])
                        .abs().max().item())
            torch.testing.assert_close(packed[0, span], alone, rtol=0, atol=10 * TOLERANCE)
            start += len(piece)
    print(f"{window}: worst per-token loss difference {worst:.1e}")
    assert worst <= TOLERANCE
    if window == "packed":  # and the masking is what does it: causal attention over the window does not
        with torch.no_grad():
            causal = F.cross_entropy(m(tokens)[0], labels[0], reduction="none")
        assert (causal - packed_loss)[len(pieces[0]):].abs().max() > 1e-2


def test_every_block_rotates_at_positions_in_the_document():
    """RoPE scores depend on q - k alone, so a document at window offset o attends alike at positions o.. and 0..
    but for the rounding of larger angles (4.8e-7 vs 9.5e-7 in the test above): the rows each block gets are checked
    here, those of each token's position in its document."""
    m, seen = model(), []
    tokens = torch.tensor([sum(windows()["packed"], [])])
    ids = documents.document_ids(tokens, BOS)
    for block in m.layers.values():  # the attention's inputs: hidden states, rotary rows, mask
        block.attention.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    with torch.no_grad():
        m(tokens, documents=ids)
    assert len(seen) == len(m.layers)
    for rope in seen:
        assert rope.equal(m.rope[documents.positions(ids)])


def test_flex_attention_forward_matches_the_explicit_mask():
    """The GPU's kernel (FlexAttention under a BlockMask), eager on the CPU, gives the explicit mask's logits;
    grouped-query heads as in Llama 3, two windows of different documents in one batch."""
    m = model(n_kv_heads=4)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.tensor([sum(windows()["packed"], []), sum((doc(n, gen) for n in (50, 20, 22)), [])[:SEQ]])
    ids = documents.document_ids(tokens, BOS)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention without torch.compile: the unfused reference, as wanted
        explicit = m(tokens, documents=ids)
        m.document_mask = documents.block_mask
        flex = m(tokens, documents=ids)
    torch.testing.assert_close(flex, explicit, rtol=0, atol=1e-5)
    assert documents.kernel("cuda", cp=1) == "flex" and documents.kernel("cpu", cp=1) == "sdpa"
    assert documents.kernel("cuda", cp=2) == "sdpa"


def layouts(n: int = 40):
    """(name, document ids) of windows of random and edge-case layouts: lengths below, at and past multiples of the
    128-token block, documents aligned to blocks (full tiles), one document, one token each."""
    gen = torch.Generator().manual_seed(5)
    cases = [("one_document", torch.ones(2, 300, dtype=torch.long)),
             ("every_token_a_document", torch.arange(1, 201).expand(2, -1)),
             ("aligned_to_blocks", (torch.arange(640) // 256).expand(1, -1)),
             ("aligned_then_cut", (torch.arange(700) // 384).expand(3, -1))]
    for i in range(n):
        batch, seq = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 900, (1,), generator=gen))
        seq = (seq, 128 * (1 + seq // 300), 128 * (1 + seq // 300) + 1)[i % 3]  # and at and just past a block
        bos = torch.rand(batch, seq, generator=gen) < float(torch.rand(1, generator=gen)) ** 3 / 4
        cases.append((f"random_{i}", documents.document_ids(bos.long(), 1)))
    return cases


def test_block_mask_equals_torchs_create_block_mask():
    """The mask built from the ids at block granularity is torch's create_block_mask (the dense path) tensor for
    tensor: partial and full blocks by rows and by columns, their order, the sequence lengths, and the dense mask;
    across the layouts, tiles of all three kinds (empty, partial, full) occur."""
    from torch.nn.attention.flex_attention import create_block_mask

    kinds = torch.zeros(3)
    for name, ids in layouts():
        batch, seq = ids.shape
        ours = documents.block_mask(ids, torch.float32)
        torchs = create_block_mask(documents.document_causal(ids), batch, None, seq, seq, device="cpu")
        for got, want in zip(ours.as_tuple()[:-1], torchs.as_tuple()[:-1]):  # all but the mask_mod
            assert (got.equal(want) if isinstance(want, torch.Tensor) else got == want), name
        assert ours.to_dense().equal(torchs.to_dense()), name
        n = ours.kv_num_blocks.shape[-1]
        partial, full = ours.kv_num_blocks.sum(), ours.full_kv_num_blocks.sum()
        kinds += torch.tensor([batch * n * n - partial - full, partial, full])
    assert (kinds > 0).all(), kinds


class LargestOutput(TorchDispatchMode):
    """Records the most elements any op's output has."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.untyped_storage().nbytes() // t.element_size())
        return out


def test_building_the_block_mask_allocates_nothing_of_seq_squared():
    """No op of the build makes a tensor larger than the block grid (batch x n x (n + 1) for n blocks): nothing of
    batch x seq x seq, which torch's uncompiled create_block_mask materializes (the same probe sees it there)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = 2, 1000
    n = -(-seq // documents.BLOCK)
    ids = documents.document_ids(torch.randint(0, 40, (batch, seq), generator=torch.Generator().manual_seed(3)), 0)
    with LargestOutput() as ours:
        documents.block_mask(ids, torch.float32)
    with LargestOutput() as torchs:
        create_block_mask(documents.document_causal(ids), batch, None, seq, seq, device="cpu")
    assert ours.numel <= batch * n * (n + 1) < batch * seq * seq <= torchs.numel


@pytest.mark.parametrize("batch, seq", [(1, 96), (2, 1000), (3, 1024), (1, 8192)])
def test_the_estimate_counts_what_the_block_mask_holds(batch, seq):
    """tools/memory.py adds block_mask_bytes for each micro-batch's mask: every byte of the mask's tensors."""
    ids = documents.document_ids(torch.randint(0, 300, (batch, seq), generator=torch.Generator().manual_seed(4)), 0)
    mask = documents.block_mask(ids, torch.float32)
    held = storage_bytes(t for t in mask.as_tuple() if isinstance(t, torch.Tensor))
    assert held == documents.block_mask_bytes(batch, seq) > 0


def test_the_gpu_sessions_mask_memory_check_runs_on_the_cpu(monkeypatch, capsys):
    """benchmarks/gpu_paths.py's mask_memory, which a GPU session runs at 8192 and 32k tokens, on the CPU at 1000:
    ours peaks far below one seq x seq bool, torch's at it or above, both hold the estimate's bytes and are equal;
    the checks only a GPU can run are reported skipped there."""
    import gpu_paths  # noqa: PLC0415 - benchmarks/, on pytest's path

    row = gpu_paths.mask_memory("cpu", (1000,))["seq 1000"]
    ours, torchs, square = row["from ids"], row["create_block_mask"], 1000 * 1000 / 2**20
    assert ours["build peak MiB"] < square / 100 and torchs["build peak MiB"] >= square
    assert ours["held bytes"] == torchs["held bytes"] == row["estimate (block_mask_bytes)"]
    assert ours["equal to ours"] and torchs["equal to ours"]
    monkeypatch.setattr("sys.argv", ["gpu_paths.py", "--only", "init"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_paths.main()
    assert '"init": "skipped: needs a GPU"' in capsys.readouterr().out


@pytest.mark.parametrize("device, cp, masked, kernel, warned", [
    ("cuda", 1, True, documents.block_mask, False), ("cuda", 2, True, documents.explicit_mask, True),
    ("cuda", 2, False, documents.explicit_mask, False), ("cpu", 1, True, documents.explicit_mask, False)])
def test_every_stage_masks_with_the_runs_kernel_and_a_gpu_hears_of_the_explicit_one(caplog, device, cp, masked,
                                                                                     kernel, warned):
    parts = [torch.nn.Module(), torch.nn.Module()]
    documents.use_kernel(parts, device, cp, masked)
    assert all(part.document_mask is kernel for part in parts)
    assert ("explicit mask of the whole window" in caplog.text) == warned


def test_synthetic_data_has_no_documents_to_mask(error_line):
    assert "synthetic data has no documents" in error_line(1, ["--model.attn_mask_type", "block_causal"])
