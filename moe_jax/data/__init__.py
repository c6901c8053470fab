"""Data: the embedded stdlib corpus, user token files, deterministic batching.

Ground floor: numpy only (no jax, nothing of ours outside this package), so it
is cheap to import anywhere.
"""
from moe_jax.data.pipeline import eval_batches
from moe_jax.data.pipeline import make_datasets
from moe_jax.data.pipeline import num_eval_batches
from moe_jax.data.pipeline import SOURCES
from moe_jax.data.pipeline import TokenBatcher
from moe_jax.data.pipeline import unigram_bits_per_byte
from moe_jax.data.stdlib_corpus import BOS
from moe_jax.data.stdlib_corpus import EOS
from moe_jax.data.stdlib_corpus import list_stdlib_files
from moe_jax.data.stdlib_corpus import load_stdlib_splits
from moe_jax.data.stdlib_corpus import NUM_BYTES
from moe_jax.data.stdlib_corpus import PAD
from moe_jax.data.stdlib_corpus import stdlib_root
from moe_jax.data.stdlib_corpus import stdlib_split_info
from moe_jax.data.stdlib_corpus import VOCAB_SIZE
from moe_jax.data.token_file import load_token_file
from moe_jax.data.token_file import load_token_file_splits
from moe_jax.data.token_file import TOKEN_DTYPES
from moe_jax.data.token_file import TokenFileError

__all__ = [
    "BOS", "EOS", "NUM_BYTES", "PAD", "SOURCES", "TOKEN_DTYPES", "TokenBatcher",
    "TokenFileError", "VOCAB_SIZE", "eval_batches", "list_stdlib_files",
    "load_stdlib_splits", "load_token_file", "load_token_file_splits",
    "make_datasets", "num_eval_batches", "stdlib_root", "stdlib_split_info",
    "unigram_bits_per_byte",
]
