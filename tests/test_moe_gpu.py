"""MoE on the GPU: mx_grouped_mm against the per-group reference, ragged and empty groups."""

import pytest
import torch
from test_moe import GROUP_SIZES, check_routed_experts, reference

from mx_recipe import MXRecipe
from mx_recipe.nn.grouped import mx_grouped_mm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_rceil", "mxfp8_wgrad_bf16", "mxfp4"])
@pytest.mark.parametrize("sizes", [*GROUP_SIZES, [100, 3, 0, 29, 250, 0, 1, 129]])
def test_mx_grouped_mm_cuda_matches_per_group_reference(name, sizes):
    torch.manual_seed(len(sizes) + sum(sizes))
    recipe = MXRecipe.from_name(name)
    m, n, k = sum(sizes), 128, 256
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(sizes), n, k, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor(sizes, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)
    y = mx_grouped_mm(x, w, offs, recipe)
    y.backward(g)
    ry, rdx, rdw = reference(x.detach(), w.detach(), sizes, g, recipe)
    # Same MX operands; the grouped and plain bf16 GEMMs may sum in different orders.
    for got, want in ((y, ry), (x.grad, rdx), (w.grad, rdw)):
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    for e, size in enumerate(sizes):
        if size == 0:
            assert torch.count_nonzero(w.grad[e]) == 0


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_rceil", "mxfp4"])
def test_fuse_expert_casts_is_bit_identical_cuda(name):
    """fake_quant_2d on the 3D weights in forward: the same gradients, bit for bit."""
    sizes = [100, 3, 0, 29, 250, 0, 1, 129]
    torch.manual_seed(5)
    m, n, k = sum(sizes), 128, 256
    x0 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w0 = (torch.randn(len(sizes), n, k, device="cuda") * 0.1).to(torch.bfloat16)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor(sizes, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)
    results = []
    for fuse in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = mx_grouped_mm(x, w, offs, MXRecipe.from_name(name, fuse_expert_casts=fuse))
        y.backward(g)
        results.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_rceil", "mxfp4", "mxfp8_wgrad_bf16"])
def test_routed_experts_are_bit_identical_to_the_routed_copy_cuda(name):
    for sizes in ([5, 0, 40, 1], [0, 0, 64, 0], [300, 1, 0, 211]):
        check_routed_experts(name, sizes, "cuda")
