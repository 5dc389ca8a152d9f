"""The ops: casts (MX and NVFP4), the kernel table and its custom ops (``dispatch``), and the GEMM backends
(``gemm``). Each op runs the reference of ``mx_recipe.formats`` or a kernel of ``mx_kernels``, the same bits.

The device probe (``device``) is exported here."""

from mx_recipe.ops.device import capability, pretend_capability

__all__ = ["capability", "pretend_capability"]
