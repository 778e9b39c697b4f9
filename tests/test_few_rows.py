"""Float linears over a decode step's few rows through the CPU kernel (kvopt.models.few_rows): PyTorch's results
within rounding, PyTorch's own forward beyond the few rows, and a replaced weight in force."""

import pytest
import torch

from kvopt.kernels.cpu import linear_rows
from kvopt.models.few_rows import FEW_ROWS, few_rows_forward

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_equal_pytorchs_linear_and_more_rows_take_it(dtype, monkeypatch):
    if linear_rows() is None:
        pytest.skip("kvopt's CPU kernels are not built here: PyTorch's linear serves")
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 70).to(dtype)
    forward = few_rows_forward(linear)
    assert forward != linear.forward
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for rows in (1, FEW_ROWS[dtype], FEW_ROWS[dtype] + 5):
        x = torch.randn(rows, 200).to(dtype)
        with torch.no_grad():
            torch.testing.assert_close(forward(x).float(), linear(x).float(), atol=tolerance, rtol=tolerance)
    calls = []
    monkeypatch.setattr(linear, "forward", lambda x: calls.append(x.shape[0]) or x)
    forward = few_rows_forward(linear)
    with torch.no_grad():
        forward(torch.randn(FEW_ROWS[dtype] + 1, 200).to(dtype))
        forward(torch.randn(1, 200).to(dtype))
    assert calls == [FEW_ROWS[dtype] + 1]  # beyond the few rows only
    with torch.no_grad():
        linear.weight = torch.nn.Parameter(torch.zeros(70, 200, dtype=dtype))
        assert torch.equal(forward(torch.randn(1, 200).to(dtype)), linear.bias.detach()[None])


def test_other_modules_and_dtypes_keep_their_forward():
    conv = torch.nn.Conv1d(4, 4, 1)
    assert few_rows_forward(conv) == conv.forward
    half = torch.nn.Linear(8, 8).half()
    assert few_rows_forward(half) == half.forward
