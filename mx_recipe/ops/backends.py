"""The layer interface every GEMM backend implements, and ``resolve_backend``, which picks one for a recipe and a
device once, when a model is converted ("auto": cublas where the device and recipe allow it, else emulated; never
triton), with a clear error for a forced backend that the device or recipe cannot run.

A backend runs the three GEMMs of a linear (y = x @ w.T, gx = g @ w, gw = g.T @ x) and of the MoE grouped GEMM
for one family of recipes, casting each operand as its recipe says: ``mx_backends`` for ``MXRecipe`` (emulated,
cublas, triton), ``nvfp4_backends`` for ``NVFP4Recipe`` (emulated, cublas). The layers (``mx_recipe.nn``) hold one
autograd Function each and call only this interface, so a format is a backend family, not a branch in a layer.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch

from mx_recipe.formats.recipe import MXRecipe, NVFP4Recipe
from mx_recipe.ops.gemm import cublas_available, cublas_gaps, describe_device, mx_elems, resolve_name
from mx_recipe.ops.mx_backends import CublasBackend, EmulatedBackend, TritonBackend
from mx_recipe.ops.nvfp4_backends import NVFP4CublasBackend, NVFP4EmulatedBackend

Recipe = MXRecipe | NVFP4Recipe
Tensors = tuple[torch.Tensor | None, ...]


class Backend(Protocol):
    """What the layers call. Operands are the backend's own (fake-quant tensors, MX or NVFP4 tensors); None where
    a GEMM runs in high precision or an operand is not needed."""

    name: str
    recipe_type: type  # the recipes it runs
    grouped: bool  # has the MoE grouped GEMM

    def check_weight(self, w: torch.Tensor, recipe: Any) -> None: ...

    def shares_input_casts(self, recipe: Any) -> bool:
        """Whether linears of ``recipe`` that read one input take one set of casts of it."""

    def input_casts(self, x: torch.Tensor, recipe: Any, for_grad_weight: bool, shared: bool = False) -> tuple:
        """x along K (the forward GEMM's operand) and x along M (the grad-weight GEMM's) where forward makes it."""

    def weight_casts(self, w: torch.Tensor, recipe: Any, dtype: torch.dtype) -> tuple[Any, Any]:
        """w along K (forward) and along N (grad input), made once for a step: ``mx_recipe.nn.weight_casts``."""

    def forward(self, x: torch.Tensor, x_k: Any, w: torch.Tensor, recipe: Any, w_k: Any = None) -> torch.Tensor:
        """y = x @ w.T; ``w_k``: w along K, made already."""

    def save_input(self, x: torch.Tensor, x_m: Any) -> tuple[Tensors, str]:
        """The tensors forward keeps of x for the grad-weight GEMM, and a tag for ``load_input``."""

    def load_input(self, saved: Tensors, form: str, recipe: Any, dtype: torch.dtype) -> tuple[Any, Any]:
        """(x, x along M) back from ``save_input``'s tensors."""

    def grad_casts(self, g: torch.Tensor, recipe: Any, need_gx: bool, need_gw: bool) -> tuple[Any, Any]:
        """g along N (grad input) and along M (grad weight), from one read of g."""

    def grad_input(self, g: torch.Tensor, g_n: Any, w: torch.Tensor, recipe: Any, w_n: Any = None) -> torch.Tensor:
        """gx = g @ w; ``w_n``: w along N, made already."""

    def grad_weight(self, g: torch.Tensor, g_m: Any, x: Any, x_m: Any, recipe: Any) -> torch.Tensor:
        """gw = g.T @ x."""

    def grouped_input_casts(self, x: torch.Tensor, offs: torch.Tensor, recipe: Any, for_grad_weight: bool) -> Any:
        """x's casts for the grouped GEMMs that read it, made once (None: each GEMM casts x itself)."""

    def grouped_forward(
        self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: Any, for_grad_input: bool,
        for_grad_weight: bool, x_casts: Any = None, w_casts: Any = None,
    ) -> tuple[torch.Tensor, Tensors]:  # fmt: skip
        """y = x_e @ w[e].T per token group (rows past the groups zero), and what backward keeps; ``x_casts``:
        from ``grouped_input_casts``, shared by the GEMMs of one x; ``w_casts``: from ``weight_casts``."""

    def grouped_backward(
        self, g: torch.Tensor, saved: Tensors, recipe: Any, need_gx: bool, need_gw: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """gx = g_e @ w[e] (rows past the groups zero) and gw[e] = g_e.T @ x_e, in g's dtype."""


def resolve_backend(recipe: MXRecipe | NVFP4Recipe, device: torch.device, grouped: bool = False) -> Backend:
    """The backend that runs ``recipe.backend`` on ``device``, resolved once, before training.

    ``grouped``: the model has MoE experts (grouped GEMMs). A forced 'cublas' that the device or the
    recipe cannot run is a ValueError here; so is a forced 'triton' off sm_89+ GPUs or with experts
    (it runs every element format, mixed too, but dense GEMMs only). 'auto' never takes triton, and
    takes cublas only for what it is known to run: e4m3 operands (PyTorch's MXFP8 tests and the
    scaled_mm v2 MXFP8 recipe check cover e4m3 only); anything else stays emulated. A forced
    'cublas' runs e5m2 dense GEMMs through torch._scaled_mm, whose checks accept it (unverified on
    hardware).
    """
    if isinstance(recipe, NVFP4Recipe):
        return _resolve_nvfp4(recipe, device, grouped)
    if not isinstance(recipe, MXRecipe):
        raise TypeError(f"resolve_backend: expected an MXRecipe or NVFP4Recipe, got {type(recipe).__name__}")
    name = resolve_name(recipe.backend, device)
    if name == "triton" and grouped:
        raise ValueError(
            f"MX recipe {recipe.name!r} cannot use backend 'triton' for this model: the triton backend has no "
            "MoE grouped GEMM. Use backend 'emulated' (or 'auto')."
        )
    if name == "cublas":
        gaps = cublas_gaps(recipe, device, grouped)
        if recipe.backend == "auto" and (gaps or mx_elems(recipe) - {"e4m3"}):
            name = "emulated"
        elif gaps:
            raise ValueError(f"MX recipe {recipe.name!r} cannot use backend 'cublas' on {device}: " + "; ".join(gaps))
    return {"emulated": EmulatedBackend, "cublas": CublasBackend, "triton": TritonBackend}[name]()


def _resolve_nvfp4(recipe: NVFP4Recipe, device: torch.device, grouped: bool) -> Backend:
    """NVFP4: 'cublas' runs the dense linears' GEMMs through torch._scaled_mm with NVFP4 operands (sm_100;
    ``NVFP4CublasBackend``), 'emulated' emulates them, and 'auto' takes cublas where it can run (a dense linear on
    sm_100), as the MX recipes do. No NVFP4 grouped GEMM is wired, so a forced 'cublas' on a model with MoE
    experts is an error, as it is off sm_100."""
    available = cublas_available(device)
    if recipe.backend == "emulated" or (recipe.backend == "auto" and (grouped or not available)):
        return NVFP4EmulatedBackend()
    if not available:
        raise ValueError(
            f"NVFP4 recipe {recipe.name!r}: backend 'cublas' needs an NVIDIA GPU of compute capability 10.0 or "
            f"later (sm_100) for torch._scaled_mm with NVFP4 operands, but {describe_device(device)}. Use 'emulated'."
        )
    if grouped:
        raise ValueError(
            f"NVFP4 recipe {recipe.name!r}: backend 'cublas' has no NVFP4 grouped GEMM for the MoE experts. "
            "Use 'emulated'."
        )
    return NVFP4CublasBackend()


def default_backend(recipe: MXRecipe | NVFP4Recipe, device: torch.device, grouped: bool = False) -> Backend:
    """``resolve_backend``, cached in eager mode: what ``mx_linear`` and ``mx_grouped_mm`` run on when given no
    backend. Dynamo traces it once a graph, and would warn of a cache wrapper in its way."""
    if torch.compiler.is_compiling():
        return resolve_backend(recipe, device, grouped)
    return _cached_backend(recipe, device, grouped)


@functools.lru_cache
def _cached_backend(recipe: MXRecipe | NVFP4Recipe, device: torch.device, grouped: bool) -> Backend:
    return resolve_backend(recipe, device, grouped)
