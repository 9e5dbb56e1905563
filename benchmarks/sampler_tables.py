"""The sampler benchmark's Markdown tables, one per part, printed from its
JSON report."""

from __future__ import annotations


def print_peer(report: dict) -> None:
  print(f"\nsampler, fixed Qwen2-shaped workload ({report['device']}; "
        f"matmul peak {report['matmul_peak_flops'] / 1e9:.1f} GFLOP/s, "
        f"ceiling {report['ceiling_tok_s']:.0f} tok/s; "
        f"{report['workload']['steps_per_call']} steps per call; load "
        f"{report['loadavg_before'][0]:.2f} -> "
        f"{report['loadavg_after'][0]:.2f})")
  print("| batch | tokens/s | ceiling fraction | wall s (median) | runs s | "
        "Tunix tokens/s | vs Tunix |")
  print("|---|---|---|---|---|---|---|")
  for r in report["rows"]:
    tunix = r.get("tunix")  # absent without Tunix installed
    theirs = ("- | -" if tunix is None else
              f"{tunix['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / tunix['tokens_per_s']:.2f}x")
    print(f"| {r['batch']} | {r['tokens_per_s']:.0f} | "
          f"{r['ceiling_fraction']:.3f} | {r['seconds']:.3f} | "
          f"{', '.join(f'{x:.3f}' for x in r['runs_s'])} | {theirs} |")
  low = [r for r in report["rows"] if "low_matmuls" in r]
  if low:
    print(f"\nweight matmuls with {low[0]['low_matmuls']['matmul_dtype']} "
          f"inputs, float32 accumulation (sampler.matmul_dtype)")
    print("| batch | tokens/s | vs float32 | Tunix bfloat16 tokens/s | vs "
          "Tunix's faster | log-prob gap, mean abs / k3 KL (float32's) | "
          "requests with float32's tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in low:
      m = r["low_matmuls"]
      tunix = [r[k]["tokens_per_s"] for k in ("tunix", "tunix_bf16")
               if k in r]
      vs = "-" if not tunix else f"{m['tokens_per_s'] / max(tunix):.2f}x"
      theirs = "-" if "tunix_bf16" not in r else (
          f"{r['tunix_bf16']['tokens_per_s']:.0f}")
      print(f"| {r['batch']} | {m['tokens_per_s']:.0f} | "
            f"{m['tokens_per_s'] / r['tokens_per_s']:.2f}x | {theirs} | {vs} | "
            f"{m['logprob_gap_abs']:.1e} / {m['logprob_gap_kl']:.1e} "
            f"({r['logprob_gap_abs']:.1e} / {r['logprob_gap_kl']:.1e}) | "
            f"{m['requests_same_tokens']} of {r['batch']} |")
  split = [r["devices"] for r in report["rows"] if "devices" in r]
  if split:  # a process with several devices: the slots split over them
    print(f"\nthe slots split over {split[0]['n']} devices, each stepping "
          f"its own in its own loop")
    print("| batch | tokens/s | vs one device | vs Tunix |")
    print("|---|---|---|---|")
    for r in report["rows"]:
      d, tunix = r["devices"], r.get("tunix")
      vs = "-" if tunix is None else (
          f"{d['tokens_per_s'] / tunix['tokens_per_s']:.2f}x")
      print(f"| {r['batch']} | {d['tokens_per_s']:.0f} | "
            f"{d['tokens_per_s'] / r['tokens_per_s']:.2f}x | {vs} |")


def print_table(report: dict) -> None:
  print(f"\nsampler benchmark ({report['device']}, prompt "
        f"{report['prompt_len']}, {report['new_tokens']} new tokens, "
        f"{report['steps_per_call']} steps per call)")
  print("| config | batch | tokens/s | wall s | compile s | compilations |")
  print("|---|---|---|---|---|---|")
  for name, entry in report["configs"].items():
    for r in entry["throughput"]:
      print(f"| {name} | {r['batch']} | {r['tokens_per_s']:.0f} | "
            f"{r['seconds']:.2f} | {r['compile_s']:.1f} | "
            f"{sum(r['compile_count'].values())} |")
  print("\n| config | measure | value | detail |")
  print("|---|---|---|---|")
  for name, entry in report["configs"].items():
    c = entry["cached_vs_recompute"]
    print(f"| {name} | cached_vs_recompute_speedup | "
          f"{c['cached_vs_recompute_speedup']:.1f}x | batch {c['batch']}: "
          f"cached {c['cached_s']:.2f}s, recompute {c['recompute_s']:.2f}s, "
          f"outputs equal: {c['outputs_equal']} |")
    if "continuous_vs_static" in entry:
      s = entry["continuous_vs_static"]
      print(f"| {name} | continuous_vs_static_speedup | "
            f"{s['continuous_vs_static_speedup']:.1f}x | {s['requests']} "
            f"requests, {s['slots']} slots: continuous {s['continuous_s']:.2f}s"
            f" / {s['continuous_steps']} steps, static {s['static_s']:.2f}s / "
            f"{s['static_steps']} steps, same outputs: {s['same_outputs']} |")
  print_admission(report, header=False)


def print_admission(report: dict, header: bool = True) -> None:
  if header:
    print("| config | measure | value | detail |")
    print("|---|---|---|---|")
  for name, entry in report["configs"].items():
    if "admission" not in entry:
      continue
    a = entry["admission"]
    one, batched = a["one_at_a_time"], a["batched"]
    print(f"| {name} | admission_batched_vs_one_at_a_time | "
          f"{a['batched_vs_one_at_a_time_speedup']:.1f}x | {a['requests']} "
          f"requests, {a['slots']} slots: one at a time "
          f"{one['requests_per_s']:.0f} req/s ({one['ms_per_request']:.2f} "
          f"ms/req), batched {batched['requests_per_s']:.0f} req/s "
          f"({batched['ms_per_request']:.3f} ms/req), same first tokens: "
          f"{a['same_first_tokens']} |")


def print_handoff(report: dict) -> None:
  for name in ("shared", "resharded", "checkpoint"):
    print(f"| {name} | {report['handoff'][name]['seconds'] * 1e3:.2f} ms |"
          f" {report['handoff'][name]} |")
  print(f"params: {report['handoff']['param_bytes'] / 2**20:.1f} MiB, "
        f"mesh {report['handoff']['mesh']}")


def print_budget(report: dict) -> None:
  print(f"\nsampler, peer workload at {report['batch']} requests, call by "
        f"call ({report['device']}; {report['steps_per_call']} steps per "
        f"call; the clocked run of median wall time)")
  print("| call | view | steps | ms per step |")
  print("|---|---|---|---|")
  for i, c in enumerate(report["calls"]):
    print(f"| {i} | {c['view']} | {c['steps']} | {c['step_ms']:.2f} |")
  print("\n| measure | seconds |")
  print("|---|---|")
  for key in ("plain_s", "wall_s", "prefill_s", "generate_s", "host_s",
              "best_case_s", "tunix_s"):
    if key in report:
      print(f"| {key} | {report[key]:.3f} |")
  if "tunix_s" in report:
    print(f"\nvs Tunix: {report['vs_tunix_plain']:.2f}x plain, "
          f"{report['vs_tunix_clocked']:.2f}x clocked, "
          f"{report['vs_tunix_best_case']:.2f}x if every step cost the "
          f"cheapest call's {report['step_ms_cheapest']:.2f} ms; "
          f"{report['target']:.0f}x needs {report['step_ms_for_target']:.2f} "
          f"ms per step (mean now {report['step_ms_mean']:.2f})")


def print_cores(report: dict) -> None:
  print(f"\nsampler, peer workload at {report['batch']} requests: a process "
        f"on CPU {report['one_core']} against one on all {report['cpus']} "
        f"allowed ({report['device']}; median of {report['repeats']}, "
        f"taking turns)")
  print("| sampler | tokens/s on one core | tokens/s on all | all / one |")
  print("|---|---|---|---|")
  for name in report["runs_s"]:
    print(f"| {name} | {report[f'{name}_tok_s_one']:.0f} | "
          f"{report[f'{name}_tok_s_all']:.0f} | "
          f"{report[f'{name}_cores_gain']:.2f}x |")
  if "vs_tunix_one" in report:
    print(f"\nkimi_jax / Tunix: {report['vs_tunix_one']:.2f}x on one core, "
          f"{report['vs_tunix_all']:.2f}x on all")
  print(f"kimi_jax drew the same results in every round of both processes: "
        f"{report['same_results']}")


def print_profile(report: dict) -> None:
  one, every = report["one"], report["all"]
  print(f"\nsampler, peer workload at {report['batch']} requests, one traced "
        f"call: thread ms per decode step by kind of operation (CPUs "
        f"{one['cpus']} / {every['cpus']})")
  print("| operations | one core | all cores |")
  print("|---|---|---|")
  for name in one["thread_ms_per_step"]:
    print(f"| {name} | {one['thread_ms_per_step'][name]:.2f} | "
          f"{every['thread_ms_per_step'][name]:.2f} |")
  for key, label in (("thread_ms_per_step_total", "all operations"),
                     ("busy_ms_per_step", "time any thread was busy")):
    print(f"| {label} | {one[key]:.2f} | {every[key]:.2f} |")
  print(f"| threads at once, on average | {one['parallelism']:.2f} | "
        f"{every['parallelism']:.2f} |")


def print_matmul(report: dict) -> None:
  print(f"\nthe decode step's MLP products ({report['device']}; "
        f"{report['steps']} per jitted loop, median of 5)")
  print("| product | float32 ms | bfloat16 inputs ms | float32 GFLOP/s | "
        "bfloat16 GFLOP/s | bfloat16 speedup |")
  print("|---|---|---|---|---|---|")
  for r in report["rows"]:
    print(f"| {r['shape']} | {r['ms_float32']:.3f} | {r['ms_bfloat16']:.3f} "
          f"| {r['gflop_s_float32']:.1f} | {r['gflop_s_bfloat16']:.1f} | "
          f"{r['bf16_speedup']:.2f}x |")
