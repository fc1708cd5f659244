"""Multi-token prediction (models/common/mtp.py, training/mtp.py) against DeepSeek-V3's equations 21-25 written
plainly: per depth a loop over positions, the module's pieces applied by hand, the loss divided by the window's T.
Its layouts: tests/multiprocess/test_moe_layouts.py (the DeepSeek-V3 rows train one MTP module)."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan_lite.config import ConfigError, load_config
from torchtitan_lite.models import registry
from torchtitan_lite.models.deepseek_v3.model import FLAVORS
from torchtitan_lite.training.mtp import IGNORED, MTP
from torchtitan_lite.training.step import Inputs, Step

from tests.test_step import FP32, batch

VOCAB, SEQ, WEIGHT = 258, 16, 0.3


def model(depth: int):
    args = FLAVORS["debugmodel"].with_(dim=64, n_heads=4, q_rank=32, kv_rank=32, nope_dim=16, rope_dim=8, v_dim=16,
                                       ffn_hidden=128, vocab_size=VOCAB, max_seq_len=SEQ, mtp_depth=depth)
    m = registry.get("deepseek_v3").model_class(args)
    m.init_weights(seed=0)
    return m


def step(depth: int, weight: float = WEIGHT) -> Step:
    return Step(model(depth), torch.device("cpu"), FP32, inputs=Inputs(mtp=MTP.from_config(model(depth).args, weight)))


def grads(m) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def rms(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def plain(m, micro_batches, tokens: int, depth: int):
    """(loss, the MTP loss before its weight, every gradient) by the paper: h^0 the main model's final (normalized)
    hidden states; depth k at position i: h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)] (the embedding
    first, as the published eh_proj), h^k = RMSNorm_k(TRM_k(h')) (its shared_head.norm: what the next depth takes, as
    transformers' MtpModel), P = OutHead(h^k) predicting t_{i+k+1}; L_k = -1/T sum over the positions that have that
    token; the objective loss + WEIGHT / D sum_k L_k."""
    m.zero_grad()
    loss, mtp = 0.0, 0.0
    for inputs, labels in micro_batches:
        window = torch.cat([inputs[:, :1], labels], 1)  # t_1 .. t_{T+1}
        h = m.tok_embeddings(inputs)
        for block in m.layers.values():
            h = block(h, m.rope)
        h = rms(h, m.norm)
        loss = loss + F.cross_entropy(m.output(h).flatten(0, 1), labels.flatten(), reduction="sum")
        for k, module in enumerate(m.mtp.values(), start=1):
            e = m.tok_embeddings(window[:, k:k + SEQ])  # t_{i+k} at position i, where it exists
            cut = e.shape[1]
            x = module.eh_proj(torch.cat([rms(e, module.enorm), rms(h[:, :cut], module.hnorm)], -1))
            h = rms(super(type(module), module).forward(x, m.rope[:cut]), module.norm)  # the block alone: TRM_k
            logits = m.output(h)
            for i in range(SEQ - k):  # position i predicts t_{i+k+1}: label i + k
                mtp = mtp + F.cross_entropy(logits[:, i], labels[:, i + k], reduction="sum")
    loss, mtp = loss / tokens, mtp / tokens
    (loss + WEIGHT / depth * mtp).backward()
    return loss.detach(), mtp.detach(), grads(m)


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_trains_deepseek_v3s_objective_and_logs_its_loss_apart(depth):
    """The step's loss is the main model's cross-entropy (what curves compare), its logged mtp_loss the depths'
    summed losses over T before the weight, and every parameter's gradient (the modules', the shared embedding's
    and output's) that of loss + weight / D x L_MTP: the formula written by hand, positions in a loop."""
    micro_batches, tokens = [batch(2, 0), batch(2, 1)], 4 * SEQ
    ours = step(depth)
    loss = ours.train_step(micro_batches, tokens)
    ref_loss, ref_mtp, ref_grads = plain(model(depth), micro_batches, tokens, depth)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.side_sums[0], ref_mtp, rtol=1e-6, atol=0)
    got = grads(ours.model)
    assert got.keys() == ref_grads.keys() and any(n.startswith(f"mtp.{depth - 1}.") for n in got)
    for name, g in got.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_with_weight_0_the_main_model_trains_as_without_mtp_and_validation_measures_it_alone():
    """The modules run (their loss is logged) but add nothing to the main model's gradients, which are bitwise those
    of the same weights without MTP: the term rides beside the loss, never in it. Validation runs no module."""
    micro_batches, tokens = [batch(2, 0)], 2 * SEQ
    with_mtp, without = step(1, weight=0.0), Step(model(1), torch.device("cpu"), FP32)
    assert torch.equal(with_mtp.train_step(micro_batches, tokens), without.train_step(micro_batches, tokens))
    assert with_mtp.side_sums[0] > 0
    got, want = grads(with_mtp.model), grads(without.model)
    assert all(torch.equal(got[n], g) for n, g in want.items()) and set(got) - set(want) <= {
        n for n in got if n.startswith("mtp.") and not got[n].any()}
    measured = with_mtp.eval_step(micro_batches, tokens)
    assert torch.equal(measured, without.eval_step(micro_batches, tokens))


def test_targets_are_the_labels_shifted_on_whole_windows_with_the_windows_end_ignored():
    labels = torch.arange(10).view(2, 5)
    tokens, targets = MTP(2, 1.0).targets(labels)
    for b in range(2):
        for i in range(5):
            for k in (1, 2):  # depth k embeds t_{i+k} (label i + k - 1) and predicts label i + k
                assert tokens[b, i, k - 1] == labels[b, (i + k - 1) % 5]
                assert targets[b, i, k] == (labels[b, i + k] if i + k < 5 else IGNORED)
    assert torch.equal(targets[..., 0], labels)


def test_mtp_depth_is_a_deepseek_v3_setting():
    """model.mtp_depth on a model without MTP modules is refused in one line; DeepSeek-V3's flavors carry theirs."""
    cfg = load_config(["--model.mtp_depth", "1"])
    with pytest.raises(ConfigError, match="model.mtp_depth is set but model llama3 has no multi-token prediction"):
        registry.get("llama3").run_args(cfg, VOCAB)
    ds = load_config(["--model.name", "deepseek_v3", "--model.mtp_depth", "2"])
    assert registry.get("deepseek_v3").run_args(ds, VOCAB).mtp_depth == 2
    assert FLAVORS["671B"].mtp_depth == 1 and FLAVORS["16B"].mtp_depth == 0


def test_the_memory_estimate_holds_the_mtp_modules_parameters_and_activations():
    """One process, fp32: the estimate's parameter bytes grow by exactly the MTP module's (4 bytes each), and its
    activations by what the module's block and its depth's logits keep for backward."""
    from torchtitan_lite.tools.memory import estimate_memory

    argv = ["--model.name", "deepseek_v3", "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--training.mixed_precision_param", "float32"]
    with_mtp, without = (estimate_memory(load_config([*argv, "--model.mtp_depth", str(d)]), 1) for d in (1, 0))
    mtp_params = sum(p.numel() for p in registry.get("deepseek_v3").model_class(
        registry.get("deepseek_v3").args("debugmodel", with_mtp.vocab_size, 64)).mtp.parameters())
    assert with_mtp.param_bytes - without.param_bytes == 4 * mtp_params
    assert with_mtp.activation_bytes > without.activation_bytes
