"""The reference backend against the A8W8 spec, value by value."""

import torch

from vllm_pypto.kernels import reference as ref


def test_amax_floor_applies_to_tiny_rows():
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1e-6, -2e-6, 0.0, 5e-7]])
    q, s = ref.quantize_per_token(x)
    assert torch.equal(s, torch.full((2,), 1e-4 / 127, dtype=torch.float32))
    # 2e-6 * (127 / 1e-4) = 2.54 -> 3, 1e-6 -> 1.27 -> 1; not scaled up to 127 as an amax of 2e-6 would
    assert q[1].tolist() == [1, -3, 0, 1]
    assert q[0].tolist() == [0, 0, 0, 0]


def test_ties_round_half_to_even():
    # amax = 127 gives a multiplier of exactly 1.0, so x lands on the tie itself
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5]])
    q, s = ref.quantize_per_token(x)
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, -2, 4]
    assert s.item() == 1.0


def test_never_minus_128_and_symmetric():
    x = torch.randn(64, 333) * 50
    x[3, 7] = -1e4  # the row's amax is this negative value
    q, s = ref.quantize_per_token(x)
    assert q.min().item() == -127 and q.max().item() <= 127
    assert q[3, 7].item() == -127
    assert torch.equal(ref.quantize_per_token(-x)[0], -q)


def test_multiplier_is_127_over_amax_in_fp32():
    torch.manual_seed(0)
    x = (torch.randn(200, 512) * 3).to(torch.bfloat16)
    q, s = ref.quantize_per_token(x)
    xf = x.float()
    amax = torch.clamp(xf.abs().max(dim=1, keepdim=True).values, min=1e-4)
    # 127/amax as a correctly rounded fp32 division (fp64 then fp32 is exact for division)
    inv = (torch.full_like(amax, 127.0, dtype=torch.float64) / amax.double()).float()
    expect = torch.clamp(torch.round(xf * inv), -127, 127).to(torch.int8)
    assert torch.equal(q, expect)
    # torch's scalar/tensor is reciprocal-times-scalar: a different multiplier for some rows,
    # and different int8 values for this input; the spec's division must not be written that way
    sloppy = torch.clamp(torch.round(xf * (127.0 / amax)), -127, 127).to(torch.int8)
    assert not torch.equal(sloppy, expect)
    assert torch.equal(s, (amax / 127).squeeze(1))


def test_int8_gemm_is_exact_int32():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-127, 128, (17, 1000), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (301, 1000), dtype=torch.int8, generator=g)
    acc = ref.int8_gemm(a, w)
    assert acc.dtype == torch.int32
    assert torch.equal(acc.long(), a.long() @ w.long().T)
    # worst case magnitude still fits: K * 127 * 127
    big = torch.full((1, 17408), 127, dtype=torch.int8)
    assert ref.int8_gemm(big, big).item() == 17408 * 127 * 127


def test_epilogue_order_acc_times_wscale_then_ascale():
    # values found by search so that (acc*ws)*as and acc*(ws*as) round differently in fp32
    acc = torch.tensor([[298285]], dtype=torch.int32)
    ws, as_ = torch.tensor([0.18097656965255737]), torch.tensor([3.459845781326294])
    y = ref.dequant_epilogue(acc, ws, as_, torch.float32)
    left = (acc.float() * ws) * as_
    other = acc.float() * (ws * as_)
    assert left.item() != other.item()
    assert y.item() == left.item()


def test_a8w8_linear_matches_spec_written_out():
    torch.manual_seed(2)
    x = (torch.randn(5, 3, 96) * 2).to(torch.bfloat16)
    w, ws = ref.quantize_weight_per_channel(torch.randn(40, 96))
    y = ref.a8w8_linear(x, w, ws)
    assert y.shape == (5, 3, 40) and y.dtype == torch.bfloat16
    x2 = x.reshape(-1, 96).float()
    amax = x2.abs().amax(1, keepdim=True).clamp_min(1e-4)
    q = torch.round(x2 * (127 / amax)).clamp(-127, 127)
    acc = q.double() @ w.double().T  # exact
    expect = ((acc.float() * ws[None]) * (amax / 127)).to(torch.bfloat16)
    assert torch.equal(y.reshape(-1, 40), expect)


def test_weight_quantization_per_channel():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [100.0, 50.0, -25.0]])
    q, s = ref.quantize_weight_per_channel(w)
    assert torch.allclose(s, torch.tensor([2 / 127, 1e-4 / 127, 100 / 127]))
    assert q[0].tolist() == [64, -127, 32]  # 63.5 -> 64 (half to even), 31.75 -> 32
    assert q[1].tolist() == [0, 0, 0] and q[2].tolist() == [127, 64, -32]


def test_non_finite_rows_are_isolated():
    x = torch.randn(4, 64).to(torch.bfloat16)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    w, ws = ref.quantize_weight_per_channel(torch.randn(8, 64))
    y = ref.a8w8_linear(x, w, ws)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[3]).all()
    clean = ref.a8w8_linear(x[[0, 3]], w, ws)
    assert torch.equal(clean, y[[0, 3]])


def test_weight_quantization_refuses_non_finite():
    w = torch.randn(4, 8)
    w[2, 3] = float("nan")
    try:
        ref.quantize_weight_per_channel(w)
    except ValueError as e:
        assert "output channel 2" in str(e)
    else:
        raise AssertionError("NaN weight was quantized")


def test_custom_op_traces_under_torch_compile():
    from vllm_pypto.kernels import get_backend

    be = get_backend("reference")
    w, ws = ref.quantize_weight_per_channel(torch.randn(32, 64))
    packed = be.prepack(w, ws)

    def f(x):
        return be.linear(x * 2, packed) + 1

    x = torch.randn(3, 64).to(torch.bfloat16)
    compiled = torch.compile(f, fullgraph=True, backend="eager")  # fullgraph: no graph break allowed
    assert torch.equal(compiled(x), f(x))
