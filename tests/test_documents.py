"""Document masking (models/documents.py): a packed window computes each of its documents as if it were run alone."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from torchtitan_lite.models import documents
from torchtitan_lite.models.llama import FLAVORS, Transformer

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


def test_every_block_rotates_at_positions_in_the_document(monkeypatch):
    """RoPE scores depend on q - k alone, so a document at window offset o attends alike at positions o.. and 0..
    but for the rounding of larger angles (4.8e-7 vs 9.5e-7 in the test above): the rows each block gets are checked
    here, those of each token's position in its document."""
    m, seen = model(), []
    tokens = torch.tensor([sum(windows()["packed"], [])])
    ids = documents.document_ids(tokens, BOS)
    for block in m.layers.values():
        attend = block.attention.attend
        monkeypatch.setattr(block.attention, "attend", lambda q, k, v, rope, mask, f=attend: seen.append(rope) or
                            f(q, k, v, rope, mask))
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
