"""linears_on_one_input: several MXLinears reading one input (wq, wk, wv; w1, w3) cast it once per orientation,
and give bit for bit the outputs and gradients of the separate calls (docs/DESIGN.md, "The MX linear: three
GEMMs, six casts"): every recipe, save_mx_input, fuse_x_casts, the cublas path through the emulator, a frozen
weight, no_grad, under torch.compile(fullgraph=True), and in the Llama model; NVFP4 recipes too (x along K
and, after the Hadamard transform, along M from one read, shared)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scaled_mm_emulator import scaled_mm as emulated_scaled_mm

from mx_recipe.formats.recipe import NVFP4_RECIPES, RECIPES, MXRecipe, NVFP4Recipe
from mx_recipe.nn.linear import MXLinear, linears_on_one_input
from mx_recipe.ops.mx_backends import CublasBackend, EmulatedBackend
from mx_recipe.ops.nvfp4_backends import NVFP4CublasBackend

K, OUTS = 64, (96, 32, 32)  # wq-like, wk-like, wv-like

CASES = [
    *RECIPES.values(),
    MXRecipe.from_name("mxfp8", save_mx_input=True),
    MXRecipe.from_name("mxfp4_sr", fuse_x_casts=True),
    MXRecipe("fwd_e4m3_wgrad_e5m2", grad_weight="e5m2"),  # x along M in another format: cast on its own
]


def make_linears(recipe: MXRecipe | NVFP4Recipe, backend=None, seed: int = 0) -> list[MXLinear]:
    gen = torch.Generator().manual_seed(seed)
    linears = [MXLinear(K, n, bias=False, recipe=recipe, backend=backend, dtype=torch.bfloat16) for n in OUTS]
    with torch.no_grad():
        for lin in linears:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / K**0.5)
    return linears


def run(fn, linears: list[MXLinear], x: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs, x.grad and the weights' grads of one forward + backward of ``fn(x, linears)``."""
    x = x.detach().requires_grad_(True)
    for lin in linears:
        lin.weight.grad = None
    ys = fn(x, linears)
    torch.manual_seed(0)  # stochastic rounding's draws, the same for both
    torch.autograd.backward(ys, grads)
    return [*(y.detach() for y in ys), x.grad, *(lin.weight.grad for lin in linears)]


def separate(x, linears):
    return [lin(x) for lin in linears]


def inputs(lead=(2, 20)):  # M = 40 rows: x along M is padded to 64
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*lead, K, generator=gen).to(torch.bfloat16)
    return x, [torch.randn(*lead, n, generator=gen).to(torch.bfloat16) for n in OUTS]


def assert_equal(got, want, what):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None and b is None) or torch.equal(a, b), f"{what}: tensor {i} differs"


@pytest.mark.parametrize("recipe", CASES, ids=lambda r: r.name)
def test_shared_casts_give_the_bits_of_separate_calls(recipe):
    linears = make_linears(recipe)
    x, grads = inputs()
    assert_equal(run(linears_on_one_input, linears, x, grads), run(separate, linears, x, grads), recipe.name)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_e5m2_grads"])
def test_shared_casts_on_the_cublas_path(recipe):
    """MX operands (blocked scales), x along M saved in MX form once, through the scaled_mm emulator."""
    linears = make_linears(RECIPES[recipe], CublasBackend(scaled_mm=emulated_scaled_mm))
    linears[1].backend = linears[2].backend = linears[0].backend  # one backend object, as convert_to_mx gives
    x, grads = inputs((64,))
    assert_equal(run(linears_on_one_input, linears, x, grads), run(separate, linears, x, grads), recipe)


def test_x_is_cast_once_per_orientation(monkeypatch):
    calls = []
    backend = EmulatedBackend()
    for name in ("cast", "cast_both"):
        original = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda t, *a, _f=original, _n=name, **k: calls.append(_n) or _f(t, *a, **k))
    linears = make_linears(RECIPES["mxfp8"], backend)
    x, grads = inputs()
    run(linears_on_one_input, linears, x, grads)
    # forward: x once for both orientations, each weight along K; backward per linear: g both ways, w along N
    assert calls.count("cast_both") == 1 + 3 and calls.count("cast") == 3 + 3
    calls.clear()
    run(separate, linears, x, grads)  # each linear: x both ways (fuse_x_casts), w, then g both ways, w along N
    assert calls.count("cast_both") == 3 + 3 and calls.count("cast") == 3 + 3
    calls.clear()
    for lin in linears:
        lin.recipe = MXRecipe.from_name("mxfp8", fuse_x_casts=False, share_input_casts=False)
    run(separate, linears, x, grads)  # each linear: x along K, w, then g both ways, w and x along M
    assert calls.count("cast_both") == 3 and calls.count("cast") == 3 * 4


def test_a_frozen_weight_and_no_grad(monkeypatch):
    recipe = RECIPES["mxfp8"]
    linears = make_linears(recipe)
    linears[1].weight.requires_grad_(False)
    x, grads = inputs()
    assert_equal(run(linears_on_one_input, linears, x, grads), run(separate, linears, x, grads), "frozen wk")
    with torch.no_grad():
        assert_equal(linears_on_one_input(x, linears), separate(x, linears), "no_grad")


class SharedCastsBackend(EmulatedBackend):
    """The emulated backend, recording whether each of its input casts was one shared by several linears."""

    def __init__(self):
        self.shared: list[bool] = []

    def input_casts(self, x, recipe, for_grad_weight, shared=False):
        self.shared.append(shared)
        return super().input_casts(x, recipe, for_grad_weight, shared)


def test_off_or_mixed_recipes_fall_back_to_separate_calls():
    x, _ = inputs()
    backend = SharedCastsBackend()
    linears_on_one_input(x, make_linears(MXRecipe.from_name("mxfp8", share_input_casts=False), backend))
    mixed = make_linears(RECIPES["mxfp8"], backend)
    mixed[2].recipe = RECIPES["mxfp8_rceil"]
    linears_on_one_input(x, mixed)
    assert backend.shared == [False] * 6  # each linear cast x on its own
    linears_on_one_input(x, make_linears(RECIPES["mxfp8"], backend))
    assert backend.shared[6:] == [True]  # and with one recipe, once for all three
    with pytest.raises(ValueError, match="share_input_casts"):
        MXRecipe(share_input_casts=1)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4_sr"])
def test_fullgraph_compile_equals_eager(recipe):
    torch._dynamo.reset()
    linears = make_linears(RECIPES[recipe])
    x, grads = inputs()
    compiled = torch.compile(linears_on_one_input, fullgraph=True, backend="aot_eager")
    assert_equal(run(compiled, linears, x, grads), run(separate, linears, x, grads), recipe)


def test_llama_shares_the_casts_and_trains_the_same_bits():
    """A converted debug Llama: project() takes the shared path in attention and FFN, and the loss and every
    gradient equal those of the same model with share_input_casts off."""
    from mx_recipe.models.llama import LLAMA_FLAVORS, Transformer
    from mx_recipe.nn.convert import convert_to_mx

    def build(share: bool, backend: SharedCastsBackend) -> torch.nn.Module:
        torch.manual_seed(0)
        args = dataclasses.replace(LLAMA_FLAVORS["debug"], vocab_size=128, n_layers=2, max_seq_len=64)
        model = Transformer(args).to(torch.bfloat16)
        model.init_weights()
        convert_to_mx(model, MXRecipe.from_name("mxfp8", share_input_casts=share), log=False)
        for module in model.modules():
            if isinstance(module, MXLinear):
                module.backend = backend
        return model

    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(2))
    results, shared_calls = [], []
    for share in (True, False):
        backend = SharedCastsBackend()
        model = build(share, backend)
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
        shared_calls.append(sum(backend.shared))
    assert_equal(*results, "llama")
    assert shared_calls == [4, 0]  # two blocks, attention and FFN each; none with sharing off


@pytest.mark.parametrize("name", sorted(NVFP4_RECIPES))
def test_nvfp4_shares_one_cast_of_x(name, monkeypatch):
    """NVFP4: the same bits as separate calls, with x quantized once (both of its operands) instead of once a
    linear; a frozen weight and no_grad too."""
    import mx_recipe.ops.nvfp4_backends as nvfp4_backends

    recipe = NVFP4Recipe.from_name(name, hadamard_seed=5)
    linears = make_linears(recipe)
    x, grads = inputs()
    casts_of_x = []
    real = nvfp4_backends.fake_quant_nvfp4

    def counting(t, *args, **kwargs):
        casts_of_x.append(t.shape == (40, K) and not kwargs.get("rounding"))  # x's casts round to nearest
        return real(t, *args, **kwargs)

    monkeypatch.setattr(nvfp4_backends, "fake_quant_nvfp4", counting)
    shared = run(linears_on_one_input, linears, x, grads)
    assert sum(casts_of_x) == 1
    casts_of_x.clear()
    assert_equal(shared, run(separate, linears, x, grads), name)
    assert sum(casts_of_x) == 3
    linears[1].weight.requires_grad_(False)
    assert_equal(run(linears_on_one_input, linears, x, grads), run(separate, linears, x, grads), "frozen wk")
    with torch.no_grad():
        assert_equal(linears_on_one_input(x, linears), separate(x, linears), "no_grad")


def test_nvfp4_shared_casts_on_the_cublas_path():
    """Packed operands through the NVFP4 scaled_mm emulator: x cast once, the same bits as separate calls."""
    from scaled_mm_emulator import nvfp4_scaled_mm

    linears = make_linears(NVFP4_RECIPES["nvfp4"], NVFP4CublasBackend(scaled_mm=nvfp4_scaled_mm))
    linears[1].backend = linears[2].backend = linears[0].backend
    x, grads = inputs((64,))
    assert_equal(run(linears_on_one_input, linears, x, grads), run(separate, linears, x, grads), "nvfp4 cublas")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_rceil", "mxfp8_e5m2_grads", "nvfp4"])
def test_gpu_shared_casts_give_the_bits_of_separate_calls(recipe):
    """On the GPU the casts are the fake-quant kernels (Gluon on Hopper; NVFP4's Triton kernel), and the fused
    one makes both of x's."""
    linears = [lin.cuda() for lin in make_linears({**RECIPES, **NVFP4_RECIPES}[recipe])]
    x, grads = inputs((4, 100))
    x, grads = x.cuda(), [g.cuda() for g in grads]
    assert_equal(run(linears_on_one_input, linears, x, grads), run(separate, linears, x, grads), recipe)
