"""Install metadata for moe_jax.

Lower bounds hold on Python 3.11 with JAX 0.10.x (CPU machines, CI) and on
Python 3.12 with JAX 0.11.x (the GPU machine).
"""
from setuptools import find_packages, setup

setup(
    name="moe_jax",
    version="0.1.0",
    description=("Hybrid KDA/MLA sparse-MoE language models in JAX/Flax with "
                 "Pallas linear-attention kernels."),
    python_requires=">=3.11",
    packages=find_packages(include=["moe_jax", "moe_jax.*", "pallas_kernels",
                                    "pallas_kernels.*"]),
    install_requires=[
        "jax>=0.10.0",
        "flax>=0.12.0",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11.0",
        "chex>=0.1.90",
        "absl-py>=2.1.0",
        "ml-collections>=1.0.0",
        "numpy>=1.26",
        "tensorboardX>=2.6",
        "tqdm>=4.66",
    ],
    extras_require={
        "gpu": ["jax[cuda13]>=0.10.0", "jax-triton>=0.3.0"],
        "notebooks": ["jupyter", "nbclient>=0.10", "nbformat>=5.9",
                      "ipykernel>=6.29", "matplotlib>=3.8"],
        "test": ["pytest>=8.0", "pytest-xdist>=3.5", "nbclient>=0.10", "nbformat>=5.9",
                 "ipykernel>=6.29", "matplotlib>=3.8"],
    },
)
