"""MX all-gather under FSDP2 (``parallel.mx_all_gather``): each rank casts its own shard of an MX weight to MX, FSDP2
all-gathers the elements and e8m0 scales (about 1.03 bytes an element for e4m3, 0.53 for e2m1, against bf16's 2),
and the gathered weight is dequantized to the fake-quant values the emulated GEMMs read.

How it plugs in. FSDP2 gathers a parameter through ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` when its
sharded local tensor has them (the extension torchao's float8 weights use). Here they are attributes set on the
plain fp32 local tensor after ``fully_shard`` (``apply_mx_all_gather``), not a tensor subclass: the parameter the
optimizer, clipping and the checkpoints see stays FSDP2's ordinary DTensor of fp32 shards, so a checkpoint moves
between runs with the MX all-gather on and off. The unsharded parameter is a plain tensor in the compute dtype,
so the layers and torch.compile see what they see without it.

What is gathered. Each pass gathers the orientation its GEMM quantizes the weight along: forward w along K
(``cast_dim0``; experts per expert, ``cast_3d_dim0``), and backward's re-gather w along N (``cast_dim1`` /
``cast_3d_dim1``), for the grad-input GEMM. The pass is the FSDP2 parameter group's training state when it
gathers (PRE_BACKWARD for backward's gather and its prefetch, FORWARD otherwise). Both orientations have the
same bytes, so FSDP2's all-gather buffers, sized at the first gather, serve both. The shard is cast from the
compute dtype (the bf16 copy that FSDP2's plain all-gather would send), so the blocks are those of the
cast-after-gather they replace, provided no block of 32 straddles two shards: a 2D weight [N, K] is sharded
along N, so it needs N % (32 x shard ranks) == 0; experts [E, N, K] are sharded on E and need E % shard ranks
== 0. A weight that does not qualify keeps FSDP2's bf16 all-gather, and the set-up log says which and why.

Why the GEMMs need no change (bit for bit the cast-after-gather). The gathered values are fq(w), ``to_mx(w)``
dequantized; the GEMM fake-quantizes its weight again along the same blocks, and fq(fq(w)) == fq(w) for both
scale rules. In a block of scale e every value is q * 2**e with q on the element grid. Under ``floor`` the
largest |q| lies in [2**emax, max_normal], so the block's scale comes out e again; under ``rceil`` it lies in
[max_normal / 2, max_normal], so the scale is e or e - 1, and the grid is closed under doubling up to
max_normal, so either scale gives back every value. A scale clamped at -127 stays -127; zeros, -0, NaN blocks
and saturated infinities (scale 127) come back as they were; where bf16 rounded a product below its normal
range (e4m3 subnormals at scales near -127), the rounded value is on the grid too. The one exception, far from
any weight: under rceil a block whose amax exceeds 448 * 2**119 (2.98e38) fake-quantizes to infinity already
(2**120 times 448 overflows). tests/test_mx_all_gather.py checks this on every bf16 bit pattern. So the layers
read the gathered weight as they read a bf16 one.

Where it does not apply, and why (the config error or the log says so):

* a forward gather reused in backward: a block that does not reshard after forward (the last block, the root,
  ``parallel.reshard_after_forward = false``) holds w along K where grad input needs w along N (likewise a
  block kept unsharded after backward would hold w along N for the next forward: FSDP2's default reshards);
* activation checkpointing: the recomputed forward runs in backward, on w gathered along N;
* ``fuse_expert_casts`` is turned off on the expert groups it gathers: forward would derive w along N from the
  gathered w along K (their w along N comes from backward's gather instead);
* recipes whose forward and grad-input formats differ or are bf16 (the two gathers must have the same bytes);
* NVFP4 recipes: the per-tensor scale needs the amax of the whole weight, a reduction across the shards;
* GEMM backends other than the emulated one (cublas, triton): they cast the weight themselves; by the same
  identity they would give the same bits, but that path is not tested.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from mx_recipe.formats.mx import BLOCK_SIZE, dequantize_along_last
from mx_recipe.formats.recipe import HIGH_PRECISION, MXRecipe
from mx_recipe.nn.convert import MXGroupedExperts
from mx_recipe.nn.linear import MXLinear
from mx_recipe.ops.mx_cast import cast_3d_dim0, cast_3d_dim1, cast_dim0, cast_dim1

MODES = ("auto", "on", "off")
# What "auto" means: the MX all-gather adds a cast of each shard and a dequantize of each gathered weight to save
# half the all-gather bytes; whether that pays depends on the interconnect, so "auto" stays off until measured
# faster (benchmarks/bench_train.py --all-gather both).
AUTO_ON = False
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def config_problem(recipe: object, ac_mode: str, reshard_after_forward: bool) -> tuple[str, str] | None:
    """(key, why) when this run's config rules out the MX all-gather (module docstring), else None."""
    if not isinstance(recipe, MXRecipe):
        what = "no MX recipe" if recipe is None else f"NVFP4 recipe {recipe.name!r} (its per-tensor scale)"
        return "mx.recipe", f"the MX all-gather needs an MX recipe, got {what}"
    if recipe.forward == HIGH_PRECISION or recipe.forward != recipe.grad_input:
        return "mx.recipe", (
            f"the MX all-gather needs forward == grad_input in an MX format, got {recipe.forward!r} and "
            f"{recipe.grad_input!r}"
        )
    if ac_mode != "none":
        return "activation_checkpoint.mode", (
            f"{ac_mode!r} recomputes the forward in backward, where the MX all-gather holds w along N only: "
            "set parallel.mx_all_gather off or activation_checkpoint.mode none"
        )
    if not reshard_after_forward:
        return "parallel.reshard_after_forward", (
            "false keeps forward's gather (w along K) for backward, which needs w along N: "
            "set parallel.mx_all_gather off"
        )
    return None


def _pre_backward(group: object) -> bool:
    """Whether FSDP2's parameter group gathers for backward (its pre-backward unshard or a backward prefetch)."""
    state = getattr(group, "_training_state", None)
    if state is None:  # defensive: inside the autograd engine means backward
        return torch._C._current_graph_task_id() != -1
    return state.name == "PRE_BACKWARD"


@dataclass
class MXGather:
    """FSDP2's all-gather extension for one sharded MX weight: 2D [N, K] sharded along N, or experts [E, N, K]
    sharded on E. Its two methods are set as attributes of the weight's sharded local tensor."""

    local: torch.Tensor  # the sharded fp32 weight (FSDP2's local tensor)
    group: object  # the FSDP2 parameter group that gathers it (its training state says which pass)
    elem: str
    rule: str
    shape: tuple[int, ...]  # the unsharded weight's

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2's signature
        if self.group.post_forward_mesh_info is None:
            raise RuntimeError(
                f"MX all-gather of a weight {self.shape}: its FSDP2 group no longer reshards after forward, so "
                "backward would reuse the weight gathered along K; set parallel.mx_all_gather off"
            )
        w = self.local.to(mp_policy.param_dtype or self.local.dtype)  # what FSDP2's plain all-gather would send
        along_n = _pre_backward(self.group)
        if w.dim() == 2:
            cast = cast_dim1 if along_n else cast_dim0
        else:
            cast = cast_3d_dim1 if along_n else cast_3d_dim0
        mx = cast(w, self.elem, self.rule)
        return (mx.qdata, mx.scale), along_n

    def fsdp_post_all_gather(self, outputs, along_n: bool, param_dtype: torch.dtype, *, out=None):
        qdata, scale = outputs  # the ranks' casts along dim 0: [N, K] or [E, N, K]; along N [W * K, N_s] or [E, K, N]
        target = out if out is not None else torch.empty(self.shape, dtype=param_dtype, device=qdata.device)
        k = self.shape[-1]
        dst = target
        if along_n:  # blocks along N: written into the [.., N, K] weight through its transpose
            qdata, scale = qdata.reshape(-1, k, qdata.shape[-1]), scale.reshape(-1, k, scale.shape[-1])
            dst = target.view(qdata.shape[0], -1, k).transpose(1, 2)
        # In place in the unsharded parameter, which forward saved for backward: keep its version.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
            dequantize_along_last(qdata, scale, self.elem, dst.dtype, out=dst)
        for t in outputs:  # FSDP2 allocates them again before its next copy-out: hold only the weight
            t.untyped_storage().resize_(0)
        return (target, (target,)) if out is None else None


def mx_gather_of(param: torch.Tensor) -> MXGather | None:
    """The MX all-gather of an FSDP2 parameter, or None where it has FSDP2's plain one."""
    hook = getattr(getattr(param, "_local_tensor", None), "fsdp_pre_all_gather", None)
    return getattr(hook, "__self__", None) if isinstance(getattr(hook, "__self__", None), MXGather) else None


@dataclass(frozen=True)
class GatherRecord:
    """What one FSDP2 parameter gathers, per all-gather."""

    fqn: str
    block: str  # the FSDP2 module that gathers it ("" for the root)
    mx: bool
    reason: str  # why it keeps the plain all-gather
    gathered_bytes: int  # the whole unsharded weight, as gathered
    plain_bytes: int  # the same in FSDP2's plain all-gather (the compute dtype)


def _fsdp_groups(module: nn.Module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # a torch with one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _weight_problem(fsdp_param, group, root: bool, recipe: MXRecipe) -> str | None:
    """Why this parameter keeps the plain all-gather (None: it takes the MX one)."""
    module, name = fsdp_param._module_info.module, fsdp_param._module_info.param_name
    mx_linear = isinstance(module, MXLinear) and name == "weight"
    mx_experts = isinstance(module, MXGroupedExperts) and name in EXPERT_WEIGHTS
    if not (mx_linear or mx_experts):
        return "not an MX weight"
    if module.recipe != recipe or getattr(module.backend, "name", "") != "emulated":
        return "not on the emulated backend with the run's recipe"
    if root:
        return "the root module"
    if group.post_forward_mesh_info is None or group.post_forward_mesh_info != group.mesh_info:
        return "its block does not reshard after forward (backward reuses forward's gather)"
    if not getattr(group, "reshard_after_backward", True):
        return "its block does not reshard after backward (the next forward would reuse backward's gather)"
    if fsdp_param.fsdp_placement.dim != 0 or getattr(fsdp_param, "offload_to_cpu", False):
        return "sharded on another dim or offloaded"
    shape, ranks = tuple(fsdp_param._orig_size), group.mesh_info.shard_mesh_size
    if len(shape) == 2 and shape[0] % (BLOCK_SIZE * ranks):
        return f"out features {shape[0]} not a multiple of 32 x {ranks} ranks (a block would straddle shards)"
    if len(shape) == 3 and shape[0] % ranks:
        return f"{shape[0]} experts not a multiple of {ranks} ranks"
    return None


@torch.no_grad()
def apply_mx_all_gather(model: nn.Module, recipe: MXRecipe | None, on: bool) -> list[GatherRecord]:
    """Give every MX weight of the FSDP2 ``model`` that qualifies (module docstring) the MX all-gather when ``on``,
    after ``fully_shard`` and before the first forward; return what each parameter gathers."""
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    blocks = {id(m): fqn for fqn, m in model.named_modules()}
    records, gathered_experts = [], []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in _fsdp_groups(module):
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                numel = param.numel()  # a DTensor's: the whole weight
                plain = numel * (fsdp_param.mp_policy.param_dtype or param.dtype).itemsize
                problem = _weight_problem(fsdp_param, group, module is model, recipe) if on else "off"
                gathered = plain
                if problem is None:
                    local = fsdp_param._sharded_local_tensor
                    gather = MXGather(local, group, recipe.forward, recipe.scale_rule, tuple(fsdp_param._orig_size))
                    local.fsdp_pre_all_gather = gather.fsdp_pre_all_gather
                    local.fsdp_post_all_gather = gather.fsdp_post_all_gather
                    fsdp_param._init_extensions()  # FSDP2 looks for the extension once, in fully_shard
                    if isinstance(fsdp_param._module_info.module, MXGroupedExperts):
                        gathered_experts.append(fsdp_param._module_info.module)
                    gathered = numel * (4 if recipe.forward == "e2m1" else 8) // 8 + numel // BLOCK_SIZE
                fqn = names.get(id(param), fsdp_param._module_info.param_name)
                records.append(GatherRecord(fqn, blocks[id(module)], problem is None, problem or "", gathered, plain))
    for experts in gathered_experts:  # their w along N comes from backward's gather (module docstring)
        experts.recipe = dataclasses.replace(experts.recipe, fuse_expert_casts=False)
    return records


def describe_all_gather(model: nn.Module, compute_dtype: str) -> str:
    """Which all-gather FSDP2 runs, for the start-up line: "MX all-gather for 26 of 41 parameters (e4m3 + e8m0
    scales)" or "all-gather bf16"."""
    params = [p for p in model.parameters() if hasattr(p, "_local_tensor")]
    gathers = [g for g in map(mx_gather_of, params) if g is not None]
    if not gathers:
        return f"all-gather {compute_dtype}"
    return f"MX all-gather for {len(gathers)} of {len(params)} parameters ({gathers[0].elem} + e8m0 scales)"


def format_gather_report(records: list[GatherRecord]) -> str:
    """The bytes each all-gather moves, with the MX all-gather and in the compute dtype, for the largest block and
    for all of them together (one pass; a step gathers twice, forward and backward), and the weights that keep the
    plain all-gather and why."""
    totals: dict[str, list[int]] = {}
    for r in records:
        t = totals.setdefault(r.block, [0, 0])
        t[0], t[1] = t[0] + r.gathered_bytes, t[1] + r.plain_bytes
    largest = max(totals, key=lambda b: totals[b][1])
    mib = 2**20
    lines = [
        f"all-gather bytes: {largest or 'root'} {totals[largest][0] / mib:.2f} MiB a gather "
        f"(plain {totals[largest][1] / mib:.2f} MiB); all blocks, one pass: "
        f"{sum(t[0] for t in totals.values()) / mib:.2f} MiB (plain {sum(t[1] for t in totals.values()) / mib:.2f} MiB)"
    ]
    kept: dict[tuple[str, str], int] = {}
    for r in records:
        if not r.mx and r.reason not in ("off", "not an MX weight"):
            kept[r.block, r.reason] = kept.get((r.block, r.reason), 0) + 1
    lines += [f"  {block or 'root'}: {n} MX weights gather plain, {why}" for (block, why), n in kept.items()]
    return "\n".join(lines)
