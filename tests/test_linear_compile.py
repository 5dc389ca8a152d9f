"""MXLinear under torch.compile(fullgraph=True): no graph break, and the same bits as eager.

fullgraph=True raises on any graph break, so compiling forward + backward is the check. On the CPU:

* every recipe, and save_mx_input on and fuse_x_casts off on two of them each, with backend="aot_eager"
  (dynamo + AOTAutograd, eager kernels): the graph capture that training uses, compared bit for bit with eager;
* inductor (C++ code generation) for mxfp8 without save_mx_input: the C++ backend has no
  float8_e8m0fnu type, which a real MX cast's scales have (the fake-quant path never materializes
  them: formats.fake_quant), so save_mx_input compiles with aot_eager only on the CPU. No bias:
  inductor fuses ``mm + bias`` into one addmm, which rounds once where eager rounds twice (not MX
  numerics). Not e2m1: inductor's C++ code for the fused e2m1 fake-quant along M of torch 2.13 returns
  values that change from run to run, NaNs among them, though each of its steps compiles exactly alone
  (seen on an AVX-512 host); the GPU test below compiles mxfp4_sr with inductor's Triton code.

Stochastic rounding draws its bits in backward from the default generator, seeded the same before
both backward passes: equal bits also show that the draws stayed in the backward graph
(formats.uniform_like) rather than being moved into forward and saved.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mx_recipe.formats.recipe import RECIPES, MXRecipe
from mx_recipe.nn.linear import MXLinear

K, N = 64, 96


def with_save_mx(r: MXRecipe) -> MXRecipe:
    return MXRecipe(**{**r.__dict__, "name": f"{r.name}+save_mx", "save_mx_input": True})


def unfused(r: MXRecipe) -> MXRecipe:
    return MXRecipe(**{**r.__dict__, "name": f"{r.name}-fuse_x", "fuse_x_casts": False})


# save_mx_input on an fp8 and an fp4 recipe: the two ways of dequantizing the saved x (linear._dequantize);
# fuse_x_casts off: x along K in forward, along M in backward (on by default: x along M made in forward, saved)
CASES = [
    *RECIPES.values(),
    with_save_mx(RECIPES["mxfp8_e5m2_grads"]),
    with_save_mx(RECIPES["mxfp4_sr"]),
    unfused(RECIPES["mxfp8"]),
    unfused(RECIPES["mxfp4_sr"]),
]


def step(fn: nn.Module, lin: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """y, x.grad and the parameters' grads of one forward + backward through ``fn``."""
    x = x.detach().requires_grad_(True)
    for p in lin.parameters():
        p.grad = None
    y = fn(x)
    torch.manual_seed(0)  # stochastic rounding's bits, the same for eager and compiled
    y.backward(g)
    return [y.detach(), x.grad, *(p.grad for p in lin.parameters())]


def check_compiled_equals_eager(
    recipe: MXRecipe, backend: str, bias: bool, lead: tuple[int, ...], device: str = "cpu"
) -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    lin = MXLinear(K, N, bias=bias, recipe=recipe, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / K**0.5)
    x = torch.randn(*lead, K, generator=gen).to(device, torch.bfloat16)
    g = torch.randn(*lead, N, generator=gen).to(device, torch.bfloat16)
    compiled = torch.compile(lin, fullgraph=True, backend=backend)
    got = step(compiled, lin, x, g)
    want = step(lin, lin, x, g)
    for what, a, b in zip(["y", "x.grad", "weight.grad", "bias.grad"], got, want, strict=False):
        assert torch.equal(a, b), f"{recipe.name} {backend}: {what} differs from eager"


@pytest.mark.parametrize("recipe", CASES, ids=lambda r: r.name)
def test_fullgraph_aot_eager_bit_exact(recipe):
    check_compiled_equals_eager(recipe, "aot_eager", bias=True, lead=(2, 20))  # M = 40: padded along M


@pytest.mark.slow
def test_fullgraph_inductor_bit_exact():
    check_compiled_equals_eager(RECIPES["mxfp8"], "inductor", bias=False, lead=(40,))


GPU_CASES = [
    RECIPES["mxfp8"],
    with_save_mx(RECIPES["mxfp8"]),
    unfused(RECIPES["mxfp8"]),
    RECIPES["mxfp4_sr"],
    with_save_mx(RECIPES["mxfp4_sr"]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_CASES, ids=lambda r: r.name)
def test_fullgraph_inductor_cuda_bit_exact(recipe):
    """On the GPU, inductor's Triton code generation, the cast kernels as custom ops."""
    check_compiled_equals_eager(recipe, "inductor", bias=False, lead=(40,), device="cuda")
