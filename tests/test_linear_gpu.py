"""MXLinear on CUDA, where its casts run as Triton kernels, is bit-identical to the hand
emulation built from the reference to_mx and torch.mm on the same device."""

import pytest
import torch
from test_linear import ALL_RECIPES, LEADS, emulate, make_inputs, run_mx

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("lead", LEADS.values(), ids=LEADS.keys())
# fp32 input (which training never casts) in the full tier only, as the cast kernels' own GPU tests: each case
# compiles kernels
@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda r: r.name)
def test_mx_linear_cuda_kernels_bit_exact_vs_reference_emulation(recipe, dtype, lead):
    x, w, b, g = (t.cuda() for t in make_inputs(lead, dtype))
    got = run_mx(x, w, b, g, recipe)
    want = emulate(x, w, b, g, recipe)
    for name, a, e in zip(("y", "gx", "gw", "gb"), got, want, strict=True):
        assert a.device.type == "cuda"
        assert torch.equal(a, e), f"{name} differs"
