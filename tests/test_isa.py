"""The instruction-set registry (kvbank/kernels/isa.h, kvbank/kernels/isa.py): one level for the
CPU, a cap that lowers every family's variant and never raises it, reported where users look."""

import logging
import subprocess
import sys

import pytest
import torch
from conftest import cpu_levels

from kvbank import LLM
from kvbank.kernels import isa
from kvbank.server.metrics import render_isa

# every family and the levels it has a variant for (isa.h)
VARIANTS = {
    "matmul": ["scalar", "avx2", "avx512_vnni", "amx"],
    "dense_attention": ["scalar", "avx2", "avx512", "avx512_bf16"],
    "quant_attention": ["scalar", "avx2", "avx512", "avx512_bf16"],
    "quant_write": ["scalar", "avx2"],
    "activation": ["scalar", "avx2", "avx512"],
    "sampling": ["scalar", "avx2", "avx512"],
}


def _expected_variant(family: str, level: str) -> str | None:
    below = [v for v in VARIANTS[family] if isa.LEVELS.index(v) <= isa.LEVELS.index(level)]
    return below[-1] if below else None


@pytest.mark.parametrize("level", cpu_levels())
def test_a_cap_picks_each_familys_best_variant_at_or_below_it(native, level):
    with isa.capped(native, level):
        report = native.isa_report()
        assert report["active"] == level
        assert report["families"] == {family: _expected_variant(family, level) for family in VARIANTS}
        assert native.qmatmul_isa() == report["families"]["matmul"]
        assert native.dense_attention_isa() == report["families"]["dense_attention"]
        assert native.has_quant_decode()
        at_or_below = [v for v in VARIANTS["quant_attention"] if isa.LEVELS.index(v) <= isa.LEVELS.index(level)]
        assert native.quant_decode_isas() == at_or_below


def test_a_cap_above_the_cpu_runs_at_the_cpus_level(native):
    cpu = native.isa_report()["cpu"]
    with isa.capped(native, isa.LEVELS[-1]):
        assert native.isa_report()["active"] == cpu
    with pytest.raises(RuntimeError, match="unknown instruction-set level avx9"):
        native.set_isa_cap("avx9")


def test_levels_are_parsed_by_name_and_refused_naming_the_levels():
    assert isa.parse_level("AVX2") == "avx2"
    assert isa.parse_level("auto") is None and isa.parse_level("") is None
    with pytest.raises(ValueError, match="KVBANK_ISA='sse9' is not an instruction-set level; the levels are auto"):
        isa.parse_level("sse9")


def test_kvbank_isa_caps_a_new_process_and_a_bad_value_is_an_error(kvbank_env):
    code = "from kvbank import kernels; print(kernels.native().isa_report()['active'])"
    run = lambda value: subprocess.run(
        [sys.executable, "-c", code], env={**kvbank_env, "KVBANK_ISA": value}, capture_output=True, text=True
    )
    assert run("avx2").stdout.strip() == "avx2"
    failed = run("avx1024")
    assert failed.returncode != 0 and "KVBANK_ISA='avx1024' is not an instruction-set level" in failed.stderr


def test_the_mlp_gives_the_same_bits_at_every_level(native):
    # silu(gate) * up takes e^x from one polynomial with the same fused multiply-adds in every
    # variant, activations quantize alike, and the matmuls are exact per block: the fused MLP is
    # bit-identical across levels, the scalar one included.
    from test_qmatmul import _weights

    generator = torch.Generator().manual_seed(0)
    o_w, o_kind, _ = _weights("Q4_1", 64, 64, seed=1)
    gate_up_w, gate_up_kind, _ = _weights("Q4_1", 2 * 1600, 64, seed=2)
    down_w, down_kind, _ = _weights("Q8_0", 64, 1600, seed=3)
    # 21 rows: a whole tile of 16 for amx, and 5 more
    attn = torch.randn(21, 64, generator=generator).to(torch.bfloat16)
    residual = torch.randn(21, 64, generator=generator).to(torch.bfloat16)
    norm = torch.full((64,), 30.0, dtype=torch.bfloat16)  # gates of a few hundred: e^-g past both clamps
    outputs = {}
    for level in cpu_levels():  # activations quantized, multiplied and gated by each level's variants
        with isa.capped(native, level):
            outputs[level] = native.qlayer_mlp(
                attn, residual.clone(), [o_w], [o_kind], norm, 1e-5, [gate_up_w], [gate_up_kind], [down_w], [down_kind]
            )
    assert outputs and all(torch.isfinite(out.float()).all() for out in outputs.values())
    first = next(iter(outputs.values()))
    assert all(torch.equal(out, first) for out in outputs.values()), list(outputs)


def test_geglu_gives_the_same_bits_at_every_level_and_the_functions_values_within_its_roundings(native):
    """Gemma's gelu(gate) * up (tanh approximation, as g / (1 + e^-2y)): one formula in plain
    multiplies and adds and one e^x polynomial in every variant, so the bits agree across levels
    (tails, signed zeros, gates past both ends of the exponential's clamps included). Against the
    function in float64: our float32 gelu may round to the neighbouring bfloat16 (2**-7 relative)
    and the product rounds once more (2**-8): within 2**-6 relative. torch's own bfloat16 ops lose
    gates below about -5, where 1 + tanh(y) cancels to 0."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 2 * 1043, generator=generator) * 4).to(torch.bfloat16)  # 1,043: not a multiple of 16
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -50.0, 50.0, 88.0, -100.0, 5.0])
    outputs = {}
    for level in cpu_levels():
        with isa.capped(native, level):
            outputs[level] = native.geglu(x)
    first = next(iter(outputs.values()))
    assert all(torch.equal(out.view(torch.int16), first.view(torch.int16)) for out in outputs.values()), list(outputs)
    gate, up = x.double().chunk(2, dim=-1)
    gelu = gate / (1 + torch.exp(-2 * (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))
    expected = gelu.to(torch.bfloat16).double() * up
    ours = first.double()
    tiny = expected.abs() < 1e-30  # past float32's normal range: absolute
    assert torch.all((ours - expected).abs()[~tiny] <= expected.abs()[~tiny] * 2**-6)
    assert torch.all((ours - expected).abs()[tiny] <= 1e-30)
    # torch's ops lose every gate below about -5 (1 + tanh cancels); ours keep them
    torch_ops = F.gelu(x[:, :1043], approximate="tanh") * x[:, 1043:]
    lost = (torch_ops == 0) & (expected.abs() > 1e-30)
    assert lost.any() and torch.all(ours[lost] != 0)
    rows = native.geglu(x[:, : 2 * 16])  # a strided view: each row's gate then up
    assert torch.equal(rows, native.geglu(x[:, :32].contiguous()))


def test_the_registry_is_in_stats_metrics_and_the_log_line(native):
    report = isa.report(native)
    lines = render_isa(report)
    matmul, cpu = report["families"]["matmul"], report["cpu"]
    assert f'kvbank:cpu_isa_info{{family="matmul",isa="{matmul}",cpu="{cpu}"}} 1' in lines
    assert 'isa="pytorch"' in "\n".join(render_isa({**report, "families": {"quant_write": None}}))
    assert isa.describe(native).startswith(f"CPU level {report['cpu']}")
    assert isa.describe(None) == "native kernels unavailable: PyTorch only"


def test_an_engine_says_whether_it_keeps_batch_invariance_and_warns_where_it_cannot(native, caplog):
    # Below avx2 the engine runs PyTorch's matmuls and batched attention (fast, but a row's bits may
    # depend on its batch): batch_invariant=True cannot be kept there, and the engine says so.
    with isa.capped(native, "scalar"), caplog.at_level(logging.WARNING, logger="kvbank"):
        llm = LLM(num_gpu_blocks=64)
    assert llm.engine.stats()["batch_invariant"] is False
    assert "batch_invariant is not kept here" in caplog.text and "native kernels at scalar" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbank"):
        assert LLM(num_gpu_blocks=64, dtype="float32").engine.stats()["batch_invariant"] is False
        assert "float32" in caplog.text
        caplog.clear()
        assert LLM(num_gpu_blocks=64, batch_invariant=False).engine.stats()["batch_invariant"] is False
        assert LLM(num_gpu_blocks=64).engine.stats()["batch_invariant"] is True  # kept at this CPU's level
    assert "batch_invariant" not in caplog.text
