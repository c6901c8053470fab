"""Chunked GLA: naive.py (references), chunk.py (the Pallas op and its
custom_vjp), intra.py, passes.py, backward.py (its kernels), tuning.py, step.py
(decoding). Import the modules themselves; this package imports nothing."""
