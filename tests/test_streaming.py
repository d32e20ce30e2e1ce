"""The weight-streaming GEMM (jakiro_lib.models.streaming): equal to F.linear up to rounding for any rows and
shape, a row's result independent of the rows beside it, served as the packed copy's "stream" backend, traced by
torch.compile, and left out with one warning where it cannot be built."""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jakiro_lib.models import kernels, streaming

needs_stream = pytest.mark.skipif(not streaming.available(), reason="the streaming GEMM cannot be built here")

SHAPES = [(48, 96), (100, 37), (3, 5), (960, 576)]  # (out, in): whole panels, a ragged last panel, one panel


@needs_stream
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_it_equals_linear_for_any_rows_and_shape(out_features, in_features):
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    packed = streaming.pack(weight)
    assert packed.shape == (-(-out_features // 16), in_features, 16)
    for rows in (1, 2, 3, 7, 8, 9, 17, 40):  # one pass of up to 8 rows, and several
        x = torch.randn(rows, in_features, generator=gen)
        close = {"atol": 2e-4, "rtol": 1e-4}  # fp32 sums of up to 576 products, in another order than MKL's
        torch.testing.assert_close(streaming.linear(x, packed, weight, None), F.linear(x, weight), **close)
        torch.testing.assert_close(streaming.linear(x[None], packed, weight, bias), F.linear(x[None], weight, bias),
                                   **close)


@needs_stream
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Bit for bit: a plain step's row and the same row inside a verify forward of any size agree."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 576, generator=gen)
    packed = streaming.pack(weight)
    x = torch.randn(40, 576, generator=gen)
    whole = streaming.linear(x, packed, weight, None)
    for rows in range(1, 41):
        assert torch.equal(streaming.linear(x[:rows], packed, weight, None), whole[:rows]), rows
    assert torch.equal(streaming.linear(x[5:6], packed, weight, None), whole[5:6])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 160), nn.ReLU(), nn.Linear(160, 48, bias=False)).eval()


@needs_stream
def test_the_packed_copy_serves_its_rows_through_the_stream_backend(monkeypatch):
    calls = []
    real = streaming.linear
    monkeypatch.setattr(streaming, "linear", lambda x, *a: calls.append(x.shape[-2]) or real(x, *a))
    net = _net()
    ref = copy.deepcopy(net)
    gemm = kernels.enable_packed_gemm(net, max_rows=8, backend="stream")
    assert (gemm.backend, gemm.min_rows, gemm.max_rows) == ("stream", 1, 8)
    for rows in (1, 3, 8, 9):
        x = torch.randn(1, rows, 96)
        with torch.inference_mode():
            torch.testing.assert_close(net(x), ref(x))
    assert calls == [1, 1, 3, 3, 8, 8]  # 9 rows: plain
    assert "stream" in kernels.probe_gemm(_net(), max_rows=8, repeats=1).ratios


@needs_stream
def test_torch_compile_traces_the_stream_kernel():
    net = _net()
    kernels.enable_packed_gemm(net, max_rows=8, backend="stream")
    x = torch.randn(4, 96)
    with torch.inference_mode():
        eager = net(x)
        compiled = torch.compile(net, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(compiled, eager)


def test_where_it_cannot_be_built_it_is_left_out_with_one_warning(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'jakiro_stream_gemm': c++: not found\nmore lines")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    streaming.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not streaming.available()
            assert not kernels.packed_gemm_available(torch.zeros(1), "stream")
        assert [r.getMessage() for r in caplog.records] == [
            "the streaming GEMM could not be built here (Error building extension 'jakiro_stream_gemm': c++: not "
            "found); packed weights use MKL or oneDNN"]
        monkeypatch.setenv("JAKIRO_STREAM_GEMM", "0")
        streaming.available.cache_clear()
        assert not streaming.available()
        assert "stream" not in kernels.probe_gemm(_net(), max_rows=2, repeats=1).ratios
    finally:
        monkeypatch.undo()
        streaming.available.cache_clear()
