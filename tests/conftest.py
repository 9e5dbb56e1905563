"""Test setup: the JAX CPU backend with 8 fake devices, set before jax loads,
and two guards on: implicit rank promotion raises (no silent broadcasting)
and implicit host-to-device transfers raise (every transfer is an explicit
`jax.device_put` with a chosen sharding)."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the test run, its subprocesses
# and later runs: the end-to-end tests compile the same micro programs
# again and again (a cached micro run takes a third of the time). It counts
# no fewer compilations: the job's counters count traces, which still run.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), "kimi_jax_test_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 * 2**30))

import contextlib  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_transfer_guard_host_to_device", "disallow")


import pytest  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "host_inputs: the test feeds host (numpy) inputs straight "
      "into pure functions, eagerly, by design (numerics of losses, sampling, "
      "the model against references); the host-to-device transfer guard is "
      "off for it. Tests of the job's data paths must not use it.")
  config.addinivalue_line(
      "markers", "tpu_interpreter: the test runs a Pallas TPU kernel in "
      "Pallas's TPU interpreter, whose simulated memory moves through host "
      "callbacks; the host-to-device transfer guard is off for it.")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
  with _guard_for(item):
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  with _guard_for(item):
    return (yield)


def _guard_for(item):
  if item.get_closest_marker("tpu_interpreter"):
    return _no_guard_in_any_thread()
  level = "allow" if item.get_closest_marker("host_inputs") else "disallow"
  return jax.transfer_guard_host_to_device(level)


@contextlib.contextmanager
def _no_guard_in_any_thread():
  # The interpreter's callbacks run on XLA's threads, which see only the
  # global setting.
  jax.config.update("jax_transfer_guard_host_to_device", "allow")
  try:
    with jax.transfer_guard_host_to_device("allow"):  # this thread too
      yield
  finally:
    jax.config.update("jax_transfer_guard_host_to_device", "disallow")
