"""Grouped matmul (the routed experts' product) as Pallas GPU kernels.

gmm.py holds the kernels and their custom VJP; naive.py the references the
tests compare them with.
"""
from pallas_kernels.grouped_matmul.gmm import Tuning, gmm, tgmm, visits
from pallas_kernels.grouped_matmul.naive import gmm_reference, tgmm_reference

__all__ = ["Tuning", "gmm", "gmm_reference", "tgmm", "tgmm_reference",
           "visits"]
