"""A float8 run in one process with the rest of the trainer: compiled blocks give eager's gradients, its checkpoints
hold nn.Linear's state dict (a run without float8 loads them, and the other way round), and they export to Hugging
Face as plain weights. torchao's emulated matmuls, the debug model (tests/assets/tiny.toml), one step a run.

Compiled by aot_eager, the step-1 gradients are eager's bit for bit: AOTAutograd traces and reruns the same kernels.
Inductor is not run here: it takes a minute to compile on the 2-core machine, and it is not bitwise, since it
computes the norms and rotary ops in fp32 with another rounding, which float8's 3 mantissa bits amplify; its
gradients differ from eager's by as much as an ulp's change of the weights moves eager's own
(benchmarks/float8_compile.py, figures in docs/performance.md#float8-on-the-cpu).
"""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch._dynamo.utils import counters

from grad_dump import load_grads, recording
from tests.multiprocess.launch import TINY, ckpt, train_in_process
from torchtitan_lite.checkpoint.reader import read_metadata, read_tensors
from torchtitan_lite.config import load_config
from torchtitan_lite.models.llama3.model import Transformer
from torchtitan_lite.tools.memory import model_args

import convert_to_hf  # scripts/convert_to_hf.py (pytest.ini puts scripts/ on the path)

FLOAT8 = ("--float8.enable_float8_linear", "--float8.emulate")
SAVED = ("--training.steps", "1", "--checkpoint.enable")
# A step at lr 1e-30 moves no fp32 weight (each update is far below half an ulp): a run's save after one such step
# holds exactly the weights it loaded.
STILL = (*SAVED, "--optimizer.lr", "1e-30")


def plain_model() -> Transformer:
    return Transformer(model_args(load_config(["--job.config_file", str(TINY)]))[0])


def model_tensors(step_folder) -> dict[str, torch.Tensor]:
    return {k: v for k, v in read_tensors(str(step_folder)).items() if k.startswith("model.")}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Weights without float8, as a checkpoint holding only the model (what an imported Hugging Face model or a seed
    checkpoint holds): random, norms included, so a run that failed to load them would hold others."""
    path = tmp_path_factory.mktemp("float8") / "weights"
    model = plain_model()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5 if p.dim() > 1 else
                    torch.rand(p.shape, generator=generator) + 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's warning that no process group is initialized
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture(scope="module")
def eager(weights):
    """An eager float8 run from `weights`, its step-1 gradients recorded (grad_dump.py), its state saved."""
    folder = weights.parent / "eager"
    folder.mkdir()
    with recording(folder):
        train_in_process(folder, *FLOAT8, "--checkpoint.initial_load_path", str(weights), *STILL)
    return folder


def test_compiled_float8_blocks_give_eagers_gradients_bitwise(weights, eager, tmp_path):
    graphs = counters["stats"]["unique_graphs"]
    with recording(tmp_path):
        train_in_process(tmp_path, *FLOAT8, "--checkpoint.initial_load_path", str(weights), "--training.steps", "1",
                         "--compile.enable", "--compile.backend", "aot_eager")
    assert counters["stats"]["unique_graphs"] > graphs  # the blocks did compile
    compiled, reference = load_grads(tmp_path), load_grads(eager)
    assert compiled.keys() == reference.keys() and all(g is not None for g in compiled.values())
    for name, grad in reference.items():
        assert torch.equal(compiled[name], grad), name


def test_a_float8_checkpoint_is_nn_linears_and_loads_both_ways(weights, eager, tmp_path):
    """A float8 run starts from weights without float8 (checkpoint.initial_load_path) and saves exactly them, as
    nn.Linear's state dict in fp32 (Float8Linear keeps its weight's name and dtype; nothing float8 is saved); a run
    without float8 starts from that save with exactly its weights, and saves its full state under the same keys."""
    saved = model_tensors(ckpt(eager, 1))
    with torch.device("meta"):
        assert saved.keys() == {f"model.{k}" for k in plain_model().state_dict()}
    assert_same(saved, model_tensors(weights))
    plain = tmp_path / "plain"
    train_in_process(plain, "--checkpoint.initial_load_path", str(ckpt(eager, 1)), *STILL)
    assert_same(model_tensors(ckpt(plain, 1)), saved)
    assert read_metadata(str(ckpt(plain, 1))).state_dict_metadata.keys() == \
        read_metadata(str(ckpt(eager, 1))).state_dict_metadata.keys()  # optimizer state keyed alike, and the rest
    initial = plain_model()
    initial.init_weights(seed=7)  # tests/assets/tiny.toml's: what a run that loaded nothing would have saved
    assert not torch.equal(initial.output.weight, saved["model.output.weight"])


def test_a_float8_checkpoint_exports_to_hugging_face_as_plain_weights(eager, tmp_path):
    """scripts/convert_to_hf.py on the float8 run's checkpoint: transformers' Llama loads every weight, none left
    over, in fp32, and gives the logits of our model (without float8) holding the same weights."""
    transformers = pytest.importorskip("transformers")
    assert convert_to_hf.main([str(ckpt(eager, 1)), str(tmp_path / "hf")]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert {p.dtype for p in hf.parameters()} == {torch.float32}
    ours = plain_model().eval()
    ours.load_state_dict({k.removeprefix("model."): v for k, v in model_tensors(ckpt(eager, 1)).items()})
    tokens = torch.randint(0, ours.args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours(tokens), hf.eval()(tokens).logits
    print(f"logits max |ours - transformers|: {(got - expected).abs().max():.3g} (largest {expected.abs().max():.3g})")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
