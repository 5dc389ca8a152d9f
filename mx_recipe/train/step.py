"""One training step's GPU work: forward and backward over the microbatches, then gradient clipping, then
(``update``) the optimizer, optionally replayed from a CUDA graph.

A MoE step launches thousands of small kernels (router, permutation, per-expert casts), and the host cannot
launch them as fast as the GPU runs them: the GPU idles through much of the step. With
``cuda_graph`` the forward, backward and clipping of a step are captured once, after ``warmup`` eager steps,
and replayed every step after: one launch, no Python. What makes that possible here:

- every rank holds the whole model (``mixed_precision``; FSDP2's hooks run collectives and stream waits on the
  host): the gradient all-reduce of several ranks is one NCCL call, which a graph captures;
- the shapes are static (fixed batch; the MoE's group ends ``offs`` stay on the device) and nothing in the
  step reads a value on the host;
- the microbatches are copied into static device buffers before each replay;
- the fp32 gradients are static: the first microbatch overwrites them (``accumulate_grads(first=True)``),
  so ``zero_grad`` leaves them in place;
- the optimizer stays outside the graph: fused AdamW is a few launches, and the learning-rate schedule and
  checkpoints keep their plain Python floats.

The replay runs the kernels the eager step runs, so the losses are the same bits, stochastic rounding included:
its seeds are drawn on the device from the CUDA generator, whose graph-safe Philox offsets advance on each replay
as the eager draws would. Nothing in the step may copy from the host (the NVFP4 Hadamard signs are made once).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from mx_recipe.nn.weight_casts import weight_casts_once
from mx_recipe.train.mixed_precision import MixedPrecisionModule, compute_weights

Microbatches = list[tuple[torch.Tensor, torch.Tensor]]


def forward_backward(
    model: nn.Module, microbatches: Microbatches, device: torch.device, inject_nan: bool = False,
    cast_weights_once: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Forward and backward over one step's microbatches; returns their mean loss (fp32, detached).

    Each microbatch's loss is scaled by 1/n, so the accumulated gradient is that of the mean over
    all of them. FSDP reduce-scatters the gradients once, after the last microbatch. ``cast_weights_once``: the
    MX weights' casts are made once for all microbatches and recomputes (``mx_recipe.nn.weight_casts``).
    """
    n = len(microbatches)
    total = torch.zeros((), device=device)
    with compute_weights(model), weight_casts_once(model) if cast_weights_once else contextlib.nullcontext():
        for i, (inputs, targets) in enumerate(microbatches):
            if isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(i == n - 1)
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # loss in fp32
            if inject_nan:
                loss = loss * float("nan")
            (loss / n).backward()
            if isinstance(model, MixedPrecisionModule):
                model.accumulate_grads(first=i == 0)
            total += loss.detach() / n
    if isinstance(model, MixedPrecisionModule) and dist.get_world_size() > 1:
        model.all_reduce_grads()  # replicated: every rank holds the whole model
    return total


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients to ``max_norm`` (0: no clipping) and return their total norm, a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP2


def can_capture(model: nn.Module, device: torch.device) -> str | None:
    """Why a step of ``model`` on ``device`` cannot be a CUDA graph (None: it can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    if not isinstance(model, MixedPrecisionModule):  # FSDPModule
        return "FSDP2 runs its collectives from host hooks, which a CUDA graph cannot replay (use dp_replicate)"
    return None


class TrainStep:
    """``step(microbatches)`` -> (mean loss, gradient norm), gradients clipped; then ``update()`` applies them
    (the caller may skip it, e.g. on a non-finite loss) and ``zero_grad()`` readies the next step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        max_norm: float,
        cuda_graph: bool = False,
        warmup: int = 2,
        cast_weights_once: bool = False,
    ):
        if cuda_graph and (reason := can_capture(model, device)) is not None:
            raise ValueError(f"cannot capture the training step in a CUDA graph: {reason}")
        self.model, self.optimizer, self.device, self.max_norm = model, optimizer, device, max_norm
        self.cuda_graph, self.warmup, self.cast_weights_once = cuda_graph, warmup, cast_weights_once
        self.eager_steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: Microbatches = []
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def _eager(self, microbatches: Microbatches, inject_nan: bool) -> tuple[torch.Tensor, torch.Tensor]:
        loss = forward_backward(self.model, microbatches, self.device, inject_nan, self.cast_weights_once)
        return loss, clip_grad_norm(self.model, self.max_norm)

    def __call__(self, microbatches: Microbatches, inject_nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cuda_graph or inject_nan:
            return self._eager(microbatches, inject_nan)
        if self.graph is None and self.eager_steps < self.warmup:
            # Warm-up steps (compilation, cuBLAS and allocator set-up) on a side stream, as capture requires.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                outputs = self._eager(microbatches, inject_nan)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.eager_steps += 1
            return outputs
        if self.graph is None:
            self._capture(microbatches)
        for (x, y), (static_x, static_y) in zip(microbatches, self.static, strict=True):
            static_x.copy_(x, non_blocking=True)
            static_y.copy_(y, non_blocking=True)
        self.graph.replay()
        return self.outputs

    def _capture(self, microbatches: Microbatches) -> None:
        self.static = [(x.to(self.device), y.to(self.device)) for x, y in microbatches]
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up's cached blocks: the graph allocates from its own pool
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self._eager(self.static, inject_nan=False)

    def update(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        """Drop the gradients; in a captured step they stay, as the replay writes the same tensors (the first
        microbatch overwrites them)."""
        if self.graph is None:
            self.optimizer.zero_grad(set_to_none=True)
