"""The numerics references, one module each: MX (``mx``), NVFP4 (``nvfp4``), the Philox stream of stochastic
rounding (``philox``), the blocked scale layout (``scale_layout``) and the recipes (``recipe``). Plain PyTorch:
nothing here launches a kernel."""
