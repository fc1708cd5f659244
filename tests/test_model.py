import math

import torch

from torchtitan_lite.models import registry
from torchtitan_lite.models.common.decoder import count_params
from torchtitan_lite.models.common.moe import inactive_params
from torchtitan_lite.models.common.rope import rope_table
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer


def build(flavor="debugmodel", device="meta", **changes):
    with torch.device(device):
        return Transformer(FLAVORS[flavor].with_(vocab_size=changes.pop("vocab_size", 258), **changes))


def test_published_flavors_parameter_counts():
    # Llama 3.1 with its 128256-token vocabulary; counted on meta, no memory.
    expected = {"8B": 8_030_261_248, "70B": 70_553_706_496, "405B": 405_853_388_800}
    for flavor, n in expected.items():
        assert count_params(build(flavor, vocab_size=128256))[0] == n, flavor


def test_qwen3_sizes_are_the_published_ones():
    """Qwen's model cards: total parameters and non-embedding ones (the table and an untied output projection left
    out), each to the card's precision (its last digit, rounded or cut); a mixture's activated ones (its top 8 of 128
    experts). An independent check of the flavors, tied embeddings (a table counted once) and the explicit head size."""
    cards = {"0.6B": (0.6, 0.44), "1.7B": (1.7, 1.4), "4B": (4.0, 3.6), "8B": (8.2, 6.95), "14B": (14.8, 13.2),
             "32B": (32.8, 31.2), "30B-A3B": (30.5, 3.3), "235B-A22B": (235, 22)}
    spec = registry.get("qwen3")
    for flavor, (total, second) in cards.items():
        with torch.device("meta"):
            model = spec.model_class(spec.args(flavor, 151_936, 64))
        n, table = count_params(model)
        outside = n - table * (1 if model.args.tie_embeddings else 2)
        figure = outside if model.args.moe is None else n - inactive_params(model)  # the card's second figure
        for got, card in ((n, total), (figure, second)):  # within 0.6 of the card's last digit (3.35B reads 3.3B)
            assert abs(got / 1e9 - card) <= 0.6 * 10 ** -len(str(card).partition(".")[2]), (flavor, got, card)


def test_forward_shapes_and_gqa():
    model = build(device="cpu", max_seq_len=32, n_kv_heads=4)
    model.init_weights(seed=0)
    assert model.layers["0"].attention.wk.weight.shape == (4 * 16, 256)
    logits = model(torch.randint(0, 258, (3, 32)))
    assert logits.shape == (3, 32, 258) and torch.isfinite(logits).all()


def test_causal():
    model = build(device="cpu", max_seq_len=16)
    model.init_weights(seed=0)
    x = torch.randint(0, 258, (1, 16))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 258
    a, b = model(x), model(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6) and not torch.allclose(a[0, 10:], b[0, 10:])


def test_init_weights_after_to_empty_initializes_everything():
    model = build(max_seq_len=32)
    model.to_empty(device="cpu")
    for t in list(model.parameters()) + list(model.buffers()):
        t.data.fill_(float("nan"))
    model.init_weights(seed=3)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert torch.equal(model.rope, rope_table(model.args))
    assert torch.equal(model.layers["2"].ffn_norm.weight, torch.ones(256))
    wo = model.layers["2"].attention.wo.weight
    assert abs(wo.std().item() - 0.02 / math.sqrt(2 * 3)) < 5e-4  # depth-scaled
    out = model.output.weight
    assert out.abs().max().item() <= 3 * 256**-0.5 + 1e-7  # truncated at 3 std


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (build(device="cpu", max_seq_len=8) for _ in range(3))
    a.init_weights(seed=1), b.init_weights(seed=1), c.init_weights(seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.output.weight, c.output.weight)


def test_llama31_rope_scaling_changes_only_low_frequencies():
    base = FLAVORS["8B"].with_(vocab_size=8, max_seq_len=16)
    scaled, plain = rope_table(base), rope_table(base.with_(rope_scaling=False))
    assert torch.equal(scaled[:, 0], plain[:, 0])  # the highest frequency is kept
    assert not torch.equal(scaled[:, -1], plain[:, -1])  # the lowest is stretched 8x
