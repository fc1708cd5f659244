"""Throughput accounting (runtime/metrics.py): FLOPs per token, the peak MFU is against, memory."""

import logging
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from torch.utils.flop_counter import (FlopCounterMode, bmm_flop, register_flop_formula, sdpa_backward_flop_count,
                                      sdpa_flop_count)

from tests.multiprocess.launch import TINY
from torchtitan_lite.models import registry
from torchtitan_lite.models.common.decoder import TransformerBlock, count_params
from torchtitan_lite.models.common.rope import rope_table
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.parallel.parallelize import apply_ac
from torchtitan_lite.quantization import float8
from torchtitan_lite.runtime import metrics
from torchtitan_lite.runtime.metrics import (FLOAT8, cpu_peak, flops_per_token, memory_gib, peak_flops,
                                            stated_peak_flops)

CPU = torch.device("cpu")


def test_flops_per_token_matches_hand_count():
    # N = 1000 - 200 = 800 -> 6N = 4800; 12 * L2 * H3 * D4 * S5 = 1440
    assert flops_per_token(1000, n_layers=2, n_heads=3, head_dim=4, seq_len=5, embedding_params=200) == 6240.0


def test_peak_flops_cpu_is_positive_and_measured_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_LITE_CACHE", str(tmp_path))
    cpu_peak.cache_clear()
    try:
        first = peak_flops(CPU, torch.float32)
        assert first > 1e8  # any CPU does well over 0.1 GFLOP/s on a 512^3 matmul
        hits = cpu_peak.cache_info().hits
        assert peak_flops(CPU, torch.float32) is first
        assert cpu_peak.cache_info().hits == hits + 1  # cached in the process too: not even the file is read again
    finally:
        cpu_peak.cache_clear()


def test_peak_flops_gpu_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 PCIe")
    assert peak_flops(torch.device("cuda"), torch.bfloat16) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda"), torch.bfloat16) == 989e12
    assert peak_flops(torch.device("cuda"), torch.float32) == 67e12  # torch's default: fp32 matmuls without TF32
    assert not metrics._tf32_allowed()
    monkeypatch.setattr(metrics, "_tf32_allowed", lambda: True)
    assert peak_flops(torch.device("cuda"), torch.float32) == 989e12 / 2
    assert stated_peak_flops(torch.device("cuda"), torch.float32) == (
        989e12 / 2, "tf32 dense peak of NVIDIA H100 80GB HBM3 (datasheet): 494.5 TFLOP/s")


@pytest.mark.parametrize("name, fp8, bf16", [
    ("NVIDIA H100 80GB HBM3", 1979e12, 989e12), ("NVIDIA H100 PCIe", 1513e12, 756e12),
    ("NVIDIA H100 NVL", 1670e12, 835e12), ("NVIDIA H200", 1979e12, 989e12), ("NVIDIA H200 NVL", 1670e12, 835e12),
    ("NVIDIA B200", 4500e12, 2250e12), ("NVIDIA L40S", 733e12, 362e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 312e12),  # no fp8 units: float8 runs only emulated there, at bf16's peak
])
def test_float8_peak_is_the_datasheets_dense_fp8_figure(monkeypatch, name, fp8, bf16):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    assert peak_flops(torch.device("cuda"), FLOAT8) == fp8
    assert peak_flops(torch.device("cuda"), torch.bfloat16) == bf16
    kind = "bf16" if fp8 == bf16 else "fp8"  # stated as what it is
    stated = stated_peak_flops(torch.device("cuda"), FLOAT8)
    assert stated == (fp8, f"{kind} dense peak of {name} (datasheet): {fp8 / 1e12:.1f} TFLOP/s")


def test_a_float8_run_measures_mfu_against_the_fp8_peak_unless_emulated(tmp_path, monkeypatch):
    """train.py asks for the fp8 peak when the converted linears multiply in float8, and for its compute dtype's when
    torchao emulates them in high precision. Stopped at that call: an unemulated CPU step would take minutes
    (torch._scaled_mm's reference kernel)."""
    import train  # noqa: PLC0415 - the trainer, only for this test

    class Asked(Exception):
        pass

    def asked(device, dtype):
        raise Asked(dtype)

    monkeypatch.setattr(train, "stated_peak_flops", asked)
    monkeypatch.setattr(float8, "has_float8_matmul", lambda: True)  # what an H100 answers
    for emulate, expected in (("--no-float8.emulate", FLOAT8), ("--float8.emulate", torch.float32)):
        with pytest.raises(Asked) as peak:
            train.run(["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path),
                       "--float8.enable_float8_linear", emulate])
        assert peak.value.args[0] == expected


def test_unknown_gpu_warns_and_uses_h100(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Mystery GPU 9000")
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        assert peak_flops(torch.device("cuda"), torch.bfloat16) == 989e12
    assert "Mystery GPU 9000" in caplog.text
    assert stated_peak_flops(torch.device("cuda"), torch.bfloat16)[1] == (
        "bf16 dense peak of Mystery GPU 9000 (unknown GPU: the H100 SXM's datasheet): 989.0 TFLOP/s")


def test_memory_gib_cpu_positive():
    assert 0 < memory_gib(CPU) < 1024


# The CPU's flash-attention kernel is not in torch's FLOP table: counted here as torch counts the GPU kernels, less
# the scores matrix that the backward kernel recomputes (an implementation's recompute, which model FLOPs leave out,
# as they leave out activation checkpointing's).
aten = torch.ops.aten


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    b, h, s_q, d = query_shape
    recompute = bmm_flop((b * h, s_q, d), (b * h, d, key_shape[2]))
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape) - recompute


def counted_flops_per_token(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    """FlopCounterMode's count of one forward and backward, per token."""
    with FlopCounterMode(display=False) as counter:
        out = model(tokens) if isinstance(model, Transformer) else model(tokens, model.rope)
        out.float().pow(2).mean().backward()
    return counter.get_total_flops() / tokens.shape[0] / tokens.shape[1]


def test_flops_per_token_is_what_a_step_computes():
    """The debug model's step, counted op by op, is 6N + 12·L·H·D·S per token to 0.1% (N counts the norms' weights,
    which do no matmul). With every block recomputed (full AC) a step adds the blocks' forward but their last matmul
    (w2: non-reentrant checkpointing stops recomputing once backward has what it needs), 2·(N_blocks - N_w2) +
    4·L·H·D·S: a recompute factor of 1.24 here, which MFU leaves out, as torchtitan does."""
    args = FLAVORS["debugmodel"].with_(vocab_size=2050, max_seq_len=256)
    model = Transformer(args)
    model.init_weights()
    n, embedding = count_params(model)
    formula = flops_per_token(n, args.n_layers, args.n_heads, args.head_dim, args.max_seq_len, embedding)
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    assert counted_flops_per_token(model, tokens) == pytest.approx(formula, rel=2e-3)
    apply_ac(model, "full", "")
    w2 = sum(p.numel() for name, p in model.layers.named_parameters() if "w2" in name)
    recompute = 2 * (sum(p.numel() for p in model.layers.parameters()) - w2) + \
        4 * args.n_layers * args.n_heads * args.head_dim * args.max_seq_len
    recomputed = counted_flops_per_token(model, tokens)
    assert recomputed == pytest.approx(formula + recompute, rel=2e-3)
    assert recomputed / formula == pytest.approx(1.24, abs=0.01)


def test_qwen3s_flops_per_token_is_what_a_step_computes():
    """Qwen3's step counted op by op is its spec's figure to 0.1%: the tied table is counted once, as the output
    projection's matmul (its lookup computes nothing), and the attention's S x S term has its own head size (8 x 64
    = 512, not dim 256). (FlopCounterMode does not count grouped_mm: a mixture's figure is checked in test_moe.py.)"""
    spec = registry.get("qwen3")
    model = spec.model_class(spec.args("debugmodel", 2050, 256))
    model.init_weights()
    tokens = torch.randint(0, 2050, (2, 256))
    assert counted_flops_per_token(model, tokens) == pytest.approx(spec.flops_per_token(model, 256), rel=2e-3)


def test_flops_per_token_of_an_8b_block():
    """One Llama 3 8B block (GQA 32/8 heads, FFN 14336) at 8192 tokens, counted on the meta device (no memory):
    the block's share of the formula, 6·N_block + 12·H·D·S per token."""
    args = FLAVORS["8B"].with_(vocab_size=128256, max_seq_len=8192)
    with torch.device("meta"):
        block = TransformerBlock(0, args)
        block.rope = rope_table(args)
    n = sum(p.numel() for p in block.parameters())
    formula = 6 * n + 12 * args.n_heads * args.head_dim * args.max_seq_len
    tokens = torch.empty(1, args.max_seq_len, args.dim, device="meta", requires_grad=True)
    assert counted_flops_per_token(block, tokens) == pytest.approx(formula, rel=2e-3)


def test_cpu_peak_is_the_fastest_matmul_layout(monkeypatch):
    """fp16 on a CPU without fp16 units runs a @ b 20x slower than a @ b^T, and a step does both: a peak taken from
    the slow layout gave MFU 253%. The peak is the fastest layout's, so MFU cannot pass 100%. Timed by a fake
    clock that each matmul advances by its layout's cost."""
    clock, cost = [0.0], {(False, False): 1.0, (False, True): 0.05, (True, False): 0.5}
    matmul = torch.Tensor.__matmul__

    def timed(x, y):
        clock[0] += cost[(not x.is_contiguous(), not y.is_contiguous())]
        return matmul(x, y)

    monkeypatch.setattr(torch.Tensor, "__matmul__", timed)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    assert metrics._measure_cpu_peak(torch.float16, 1) == pytest.approx(2 * 512**3 / 0.05)


# ---- The CPU's peak: measured once per machine, so that MFU is against one stated number


class Measurements:
    """Stands in for the timing: counts the measurements, each a new value (a re-measurement shows)."""

    def __init__(self, seconds: float = 0.0):
        self.calls, self.seconds, self.lock = [], seconds, threading.Lock()

    def __call__(self, dtype: torch.dtype, num_threads: int) -> float:
        with self.lock:
            self.calls.append(dtype)
            value = 1e10 * len(self.calls) + 0.123456789
        time.sleep(self.seconds)  # another process asking now finds no file yet
        return value


@pytest.fixture
def measurements(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_LITE_CACHE", str(tmp_path))
    measure = Measurements()
    monkeypatch.setattr(metrics, "_measure_cpu_peak", measure)
    return measure


def test_the_cpu_peak_is_measured_once_and_read_back_by_later_processes(measurements, tmp_path):
    peak = cpu_peak.__wrapped__  # not the process's cache: each call is a new run's first
    flops, text = peak(torch.float32, 1)
    assert measurements.calls == [torch.float32]
    assert peak(torch.float32, 1) == (flops, text) and len(measurements.calls) == 1  # read, not measured again
    [cached] = (tmp_path / "cpu_peak").glob("*.json")
    assert re.fullmatch(rf"fp32 matmul peak of this CPU, 1 thread: 10\.0 GFLOP/s, measured once \(\d{{4}}-[\d-]+ "
                        rf"[\d:]+\), cached in {re.escape(str(cached))}", text), text
    # A later run is another process: it reads the same number, to the last bit, and measures nothing.
    code = ("import torch; from torchtitan_lite.runtime import metrics\n"
            "metrics._measure_cpu_peak = None  # a measurement would fail\n"
            "print(repr(metrics.peak_flops(torch.device('cpu'), torch.float32)))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert float(other.stdout) == flops


def test_the_cpu_peak_s_key_separates_dtype_threads_cpu_and_torch(measurements, monkeypatch):
    peak = cpu_peak.__wrapped__
    values = {peak(torch.float32, 1)[0], peak(torch.float32, 2)[0], peak(torch.bfloat16, 1)[0]}
    with monkeypatch.context() as m:
        m.setattr(metrics, "cpu_identity", lambda: "model name : another CPU\n")
        values.add(peak(torch.float32, 1)[0])
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "99.0")  # another torch: other matmul kernels
        values.add(peak(torch.float32, 1)[0])
    assert len(measurements.calls) == len(values) == 5
    assert {peak(torch.float32, 1)[0], peak(torch.float32, 2)[0]} < values  # each kept apart
    assert len(measurements.calls) == 5


def test_concurrent_first_calls_measure_once(tmp_path, monkeypatch):
    """The ranks of a node start together: one measures while the others wait for its number (measuring at once,
    they would time each other's load). Threads stand in for the ranks: each opens the lock file anew, and flock
    locks one open file against another, in one process as across processes."""
    monkeypatch.setenv("TORCHTITAN_LITE_CACHE", str(tmp_path))
    measure = Measurements(seconds=0.5)
    monkeypatch.setattr(metrics, "_measure_cpu_peak", measure)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: cpu_peak.__wrapped__(torch.float32, 1), range(4)))
    assert len(measure.calls) == 1
    assert len(set(results)) == 1


def test_an_unwritable_cache_measures_in_process_and_says_so(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCHTITAN_LITE_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(metrics, "_measure_cpu_peak", Measurements())
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        flops, text = cpu_peak.__wrapped__(torch.float32, 1)
    assert flops > 0 and "measured at start (not cached:" in text
    assert "cannot keep the CPU's peak" in caplog.text


def test_the_cpu_peak_is_measured_on_the_workers_thread_count(monkeypatch):
    """train.py --check measures for the workers it precedes, which share the cores (fewer threads than it has)."""
    seen = []
    monkeypatch.setattr(metrics, "_time_matmuls", lambda dtype: seen.append(torch.get_num_threads()) or 1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        metrics._measure_cpu_peak(torch.float32, 1)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
