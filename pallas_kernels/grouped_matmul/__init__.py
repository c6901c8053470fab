"""Grouped matmul (the routed experts' product) as Pallas GPU kernels.

layout.py holds the tunings and the group-sorted row layout (visits) both
kernel families walk; gmm.py the Triton kernels and the custom VJP; mosaic.py
the Mosaic GPU kernels; naive.py the references the tests compare them with.
"""
from pallas_kernels.grouped_matmul.gmm import gmm, tgmm
from pallas_kernels.grouped_matmul.layout import Tuning, visits
from pallas_kernels.grouped_matmul.mosaic import mosaic_gpu_available
from pallas_kernels.grouped_matmul.naive import gmm_reference, tgmm_reference

__all__ = ["Tuning", "gmm", "gmm_reference", "mosaic_gpu_available", "tgmm",
           "tgmm_reference", "visits"]
