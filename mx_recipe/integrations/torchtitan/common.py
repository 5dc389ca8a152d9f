"""What the converters of both torchtitan lines share (``converters`` for 0.3, ``registered`` for 0.2.x), with no
torchtitan import: the default skips under torchtitan's names, the device the backends resolve for, and which
layers convert."""

from __future__ import annotations

import torch

from mx_recipe.nn.convert import skip_reason

# convert_to_mx's default skips under torchtitan's names: the output projection (``lm_head`` in torchtitan 0.3,
# ``output`` before) and MoE router gates stay in bf16.
TORCHTITAN_SKIP = ("lm_head", "output", "*router.gate")


def training_device() -> torch.device:
    """The device the model will train on, for resolving the backend (every GPU of a node is alike)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def why_skipped(fqn: str, features: tuple[int, ...], skip: list[str], fqns: list[str], block_size: int) -> str | None:
    """Why the layer at ``fqn`` stays in bf16 (None: it converts): not in torchtitan's include-list ``fqns`` (names
    containing one of them; empty: all), or ``convert_to_mx``'s rule (the ``skip`` patterns, features not
    multiples of the block)."""
    if fqns and not any(target in fqn for target in fqns):
        return "skipped: not in fqns"
    return skip_reason(fqn, features, skip, block_size)
