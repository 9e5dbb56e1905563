"""Per-device memory of an experiment, from the TPU compiler or a quick plan.

  python launch/plan.py --config experiments/qwen2_5_7b.py --aot v5p:4x4x4 \\
      --json plan.json
  python launch/plan.py --config experiments/qwen2_5_7b.py \\
      --mesh data=4,fsdp=16,tensor=4 --device_memory_gb 16

With --aot TOPOLOGY (e.g. v5p:4x4x4, v5e:16x16, v6e:8x8) the TPU compiler
itself compiles every jitted function of the main job for that slice, on
this host, over the experiment's own mesh (an axis of -1 takes the rest of
the chips), and reports its per-device argument / output / temp bytes
against the chip's HBM (needs libtpu: requirements-test.txt). Without it, a
quick analytic plan on a mesh of any size (--mesh, abstract devices, nothing
is allocated) warns when it exceeds --device_memory_gb. --json writes either
as JSON. `--config.x.y=v` overrides apply as in launch/tpu_run.py.
"""

import json
import os
import sys

from absl import app, flags

from kimi_jax.infra import quiet
from kimi_jax.infra.config import define_config_flag, parse_flags

_CONFIG = define_config_flag()
_AOT = flags.DEFINE_string("aot", "", "compile every jitted function of the "
                           "main job for this TPU slice, e.g. v5p:4x4x4")
_MESH = flags.DEFINE_string("mesh", "", "analytic plan: axis sizes, e.g. "
                            "data=4,fsdp=16,tensor=4 (default: the config's "
                            "mesh section)")
_NUM_DEVICES = flags.DEFINE_integer("num_devices", None, "analytic plan: "
                                    "device count, to resolve a -1 mesh axis")
_MEMORY_GB = flags.DEFINE_float("device_memory_gb", None, "analytic plan: "
                                "per-device memory (GB = 1e9 bytes) to warn "
                                "above")
_JSON = flags.DEFINE_string("json", "", "write the report here")


def main(argv):
  del argv
  # Before any backend starts: nothing here runs on an accelerator (the
  # analytic plan uses abstract devices; with --aot the TPU runtime only
  # compiles), so no TPU runtime is started on a host that has one.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  quiet.start()
  if _AOT.value:
    from kimi_jax.infra import aot
    aot.prepare_environment(_AOT.value)
  from kimi_jax.infra import aot
  from kimi_jax.job import plan
  from ml_collections import config_flags
  config_name = config_flags.get_config_filename(flags.FLAGS["config"])
  overrides = sorted(f"{k}={v!r}" for k, v in
                     config_flags.get_override_values(flags.FLAGS["config"]).items())
  if _AOT.value:
    report = plan.aot_report(_CONFIG.value, _AOT.value)
    print(aot.format_report(report))
    out = dict(report, config=config_name, overrides=overrides)
  else:
    try:
      memory = plan.plan_for_config(_CONFIG.value,
                                    plan.parse_mesh(_MESH.value),
                                    _NUM_DEVICES.value)
    except ValueError as exc:
      sys.exit(f"plan: {exc}")
    print(plan.format_table(memory, _MEMORY_GB.value))
    out = dict(memory.to_json(), config=config_name, overrides=overrides,
               device_memory_gb=_MEMORY_GB.value)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(out, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main, flags_parser=parse_flags))
