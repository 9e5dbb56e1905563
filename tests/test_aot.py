"""The TPU compiler, ahead of time, from this CPU host (needs libtpu, which
requirements-test.txt installs): a change that breaks TPU lowering of the
main job's functions fails here."""

import os

import jax
import pytest

from kimi_jax.infra import aot
from kimi_jax.infra.config import load_config, to_dataclass
from kimi_jax.job import plan
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh, rules_from_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "experiments", "tiny.py")


def test_accelerator_types_and_hbm_by_generation():
  assert aot.accelerator_type("v5p:4x4x4") == "v5p-128"
  assert aot.accelerator_type("v5e:2x2") == "v5litepod-4"
  assert aot.accelerator_type("v6e:8x8") == "v6e-64"
  assert aot.HBM_BYTES["TPU v5"] == 95 * 10**9
  assert aot.HBM_BYTES["TPU v5 lite"] == 16 * 10**9
  with pytest.raises(ValueError, match="v5p:4x4x4"):
    aot.topology_devices("v5p")


@pytest.mark.slow
def test_tiny_train_step_and_generate_compile_for_v5e_with_splash():
  devices = aot.topology_devices("v5e:2x2")
  assert len(devices) == 4 and devices[0].platform == "tpu"
  assert aot.hbm_bytes(devices) == 16 * 10**9
  config = load_config(TINY, ["model.attention=splash",
                              "rl.train_len_buckets=(48,)"])
  sharder = Sharder(make_mesh(to_dataclass(MeshConfig, config.mesh, "mesh"),
                              devices),
                    rules_from_config(config.sharding.rules))
  functions = plan.main_job_functions(config, sharder)
  assert set(functions) == {"rl_train_step_T48", "reference_logprobs_T48",
                            "sampler_prefill", "sampler_generate"}
  for name in ("rl_train_step_T48", "sampler_generate"):
    fn, args = functions[name]
    compiled = aot.compile_for_topology(fn, args)
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes > 0
    if name == "rl_train_step_T48":
      # The Pallas splash kernel (forward and both backward kernels) was
      # lowered by Mosaic for the TPU, not replaced by anything else.
      assert compiled.as_text().count("tpu_custom_call") >= 3
      # The donated state comes back in its own buffers.
      assert memory.alias_size_in_bytes > 0
  # The CPU backend of this process is untouched.
  assert jax.devices()[0].platform == "cpu"


def test_a_program_over_hbm_is_reported_with_the_compilers_figure():
  devices = aot.topology_devices("v5e:2x2")
  one = jax.sharding.SingleDeviceSharding(devices[0])
  # 24 GiB of output on a 16 GB chip: the TPU compiler refuses it.
  fn = jax.jit(lambda x: jax.numpy.broadcast_to(x, (6 * 2**30,)) + 1.0,
               out_shardings=one)
  with pytest.raises(aot.CompileOutOfMemory) as info:
    aot.compile_memory(fn, (jax.ShapeDtypeStruct((), jax.numpy.float32,
                                                 sharding=one),))
  assert info.value.used_bytes > 24 * 2**30 * 0.99
  entry = aot.out_of_memory_json(info.value)
  assert entry["fits"] is False and entry["total_bytes"] == (
      info.value.used_bytes)


@pytest.mark.parametrize("name,topology", [
    ("qwen2_5_1_5b.py", "v5p:4x4x4"), ("qwen2_5_1_5b.py", "v5e:16x16"),
    ("qwen2_5_7b.py", "v5p:4x4x4"), ("qwen2_5_7b.py", "v5e:16x16"),
    ("qwen2_5_7b.py:128k", "v5p:4x4x8"),
    ("qwen2_5_32b.py", "v5p:4x8x8"), ("qwen2_5_32b.py", "v5e:16x16"),
    ("qwen3_8b.py", "v5p:4x4x4"), ("qwen3_8b.py:128k", "v5p:4x4x8"),
    ("gemma3_4b.py", "v5e:16x16")])
def test_every_documented_experiment_builds_its_aot_programs(
    name, topology):
  # The documented check runs on the experiment as shipped, before any data
  # path is chosen (the task's paths are empty): building the programs must
  # not need them. Lowering and compiling are the slow test's business.
  devices = aot.topology_devices(topology)
  config = load_config(os.path.join(ROOT, "experiments", name), [])
  sharder = Sharder(make_mesh(to_dataclass(MeshConfig, config.mesh, "mesh"),
                              devices),
                    rules_from_config(config.sharding.rules))
  functions = plan.main_job_functions(config, sharder)
  buckets = config.rl.train_len_buckets or (config.model.max_seq_len,)
  longest = max(buckets)
  assert set(functions) == (
      {f"rl_train_step_T{b}" for b in buckets} |
      {f"reference_logprobs_T{longest}", "sampler_prefill",
       "sampler_generate"})
  assert longest == config.model.max_seq_len


def test_the_readme_table_is_the_json_of_the_aot_runs():
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "aot_table", os.path.join(ROOT, "benchmarks", "aot_table.py"))
  table = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(table)
  entry = lambda gb, fits=True: dict(total_bytes=int(gb * 1e9), fits=fits)
  report = dict(
      config="experiments/qwen2_5_7b.py:128k", topology="v5p:4x4x8",
      devices=128, hbm_bytes=95 * 10**9, seq_len=131072,
      mesh=dict(data=1, fsdp=8, context=4, tensor=4), fits=False,
      functions={"rl_train_step_T8192": entry(4.9),
                 "rl_train_step_T131072": entry(96.2, fits=False),
                 "reference_logprobs_T131072": entry(11.7),
                 "sampler_prefill": entry(18.6),
                 "sampler_generate": entry(67.35)})
  assert table.table_row(report) == (
      "| Qwen2.5-7B `:128k` | `v5p:4x4x8` (128 x 95 GB) | "
      "`data=1,fsdp=8,context=4,tensor=4` | 131072 | "
      "4.9 / **96.2 (out of HBM)** | 11.7 | 18.6 | 67.3 | **does not fit** |")


@pytest.mark.slow
def test_a_vision_models_train_step_compiles_for_a_tpu_with_its_images():
  devices = aot.topology_devices("v5e:2x2")
  config = load_config(os.path.join(ROOT, "experiments", "vision_tiny.py"),
                       ["model.attention=splash", "rl.train_len_buckets=(64,)",
                        "rl.minibatch_prompts=4"])
  sharder = Sharder(make_mesh(to_dataclass(MeshConfig, config.mesh, "mesh"),
                              devices),
                    rules_from_config(config.sharding.rules))
  fn, args = plan.main_job_functions(config, sharder)["rl_train_step_T64"]
  images = args[1][0].rows.images  # (state, (minibatch, flag))
  v = config.model.vision
  assert images.pixels_BxIxHxWxC.shape[1:] == (
      v.max_images, v.image_size, v.image_size, v.channels)
  memory = aot.compile_for_topology(fn, args).memory_analysis()
  # The pixels are an argument of the step on every chip.
  assert memory.argument_size_in_bytes > (
      images.pixels_BxIxHxWxC.size * 4 // len(devices))
