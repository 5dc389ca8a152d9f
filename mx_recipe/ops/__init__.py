"""The ops: casts (MX and NVFP4), the kernel table and its custom ops (``dispatch``), the GEMM backends
(``backends``: ``mx_backends``, ``nvfp4_backends``) and the raw GEMMs (``gemm``). Each op runs the reference
of ``mx_recipe.formats`` or a kernel of ``mx_kernels``, the same bits.

The kernel settings (``settings``) and the device probe (``device``) are exported here."""

from mx_recipe.ops.device import capability, pretend_capability
from mx_recipe.ops.settings import KernelSettings, get_kernel_settings, kernel_settings, set_kernel_settings

__all__ = [
    "KernelSettings",
    "capability",
    "get_kernel_settings",
    "kernel_settings",
    "pretend_capability",
    "set_kernel_settings",
]
