"""Shared pytest setup.

Sharding tests run on 8 fake CPU devices; the flag must be set before JAX
initialises its backends, so it lives here, at import time of the test session.
"""
import os

_FLAG = "--xla_force_host_platform_device_count=8"
_USER_XLA_FLAGS = os.environ.get("XLA_FLAGS")
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the flag on purpose)

assert len(jax.devices()) == 8, jax.devices()  # backends start here
# Child processes (notebook kernels, CLI runs) see the user's environment:
# one CPU device, as the README's commands would.
if _USER_XLA_FLAGS is None:
  del os.environ["XLA_FLAGS"]
else:
  os.environ["XLA_FLAGS"] = _USER_XLA_FLAGS

jax.config.update("jax_default_matmul_precision", "highest")

import importlib.util  # noqa: E402
import pathlib  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Compile once per machine: many tests build the same tiny model.
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("MOE_JAX_TEST_CACHE", "/tmp/moe_jax_jit_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def load_config(name: str, arg: str | None = None):
  """get_config(arg) of configs/<name>, loaded by path like config_flags."""
  path = ROOT / "configs" / name
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  if "mesh" in config:
    # One device, as on a user's CPU machine: the 8 fake devices are for the
    # tests that build their mesh on purpose (they set num_devices back).
    config.mesh.num_devices = 1
  return config


def set_field(config, field: str, value):
  """Sets the config entry at dotted path `field` ("train.microbatches")."""
  node = config
  *parents, leaf = field.split(".")
  for p in parents:
    node = node[p]
  node[leaf] = value


def assert_config_error(field: str, value, match: str,
                        variant: str | None = "tiny,smoke"):
  """configs/default.py (`variant`) with `field` (a dotted path) set to
  `value` fails validate_config with a ConfigError matching `match`."""
  from moe_jax.config_validation import ConfigError, validate_config
  config = load_config("default.py", variant)
  set_field(config, field, value)
  with pytest.raises(ConfigError, match=match):
    validate_config(config)


def init_moe(model, x, seed=0):
  """(params, router_state) of a MoE with init's structure, filled from numpy.

  eval_shape runs the real init code for structure; numpy values avoid
  compiling the random initialisers (seconds on a small CPU).
  """
  shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), x))
  rng = np.random.default_rng(seed)
  params = jax.tree_util.tree_map(
      lambda s: jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(s.shape[-2]),
                            s.dtype), shapes["params"])
  state = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                 shapes["router_state"])
  return params, state


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
  """A tiny model trained 6 steps (checkpoints at 3 and 6): (config, workdir, result)."""
  from moe_jax.train.loop import train_and_evaluate
  config = load_config("default.py", "tiny,smoke")
  workdir = str(tmp_path_factory.mktemp("smoke_run"))
  result = train_and_evaluate(config, workdir)
  return config, workdir, result


def execute_notebook(name: str):
  """Executes notebooks/<name> in a python3 kernel (cwd = notebooks/).

  Returns (notebook, printed text of all code cells). Skips the test where
  nbformat/nbclient are not installed (they come with the [test] extra).
  """
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  path = ROOT / "notebooks" / name
  nb = nbformat.read(str(path), as_version=4)
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}}
                          ).execute()
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.get("outputs", []))
  return nb, text
