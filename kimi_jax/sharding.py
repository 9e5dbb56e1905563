"""Device mesh and logical-axis sharding rules.

Every parameter and the main activations are named with a small logical-axis
vocabulary (batch, length, act_length, embed, act_embed, mlp, heads, kv_heads,
head_dim, vocab, layers, norm, experts, expert_mlp). A short rule list maps
each logical name to mesh axes (`data`, `fsdp`, `context`, `tensor`,
`expert`).

`context` splits the sequence of activations (`act_length`) for the longest
rows: context parallelism (kimi_jax/model/attention.py gathers keys and
values along it). Parameters are sharded over it like over `fsdp`, so its
chips add memory for the weights too. `length` (the sampler's cache) is
never split. `expert` splits a mixture-of-experts model's experts (the E
of its E x D x F expert weights; kimi_jax/model/moe.py): expert
parallelism, which like `tensor` leaves the batch whole along it. Parameters
whose shape does not divide as the rules say raise `ShardingError` naming the parameter: nothing is silently
replicated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")

# (logical name, mesh axes or None). Activations use `batch`/`act_length`;
# the activation embedding dimension is never sharded (fsdp already splits
# batch).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_length", "context"),
    ("embed", ("fsdp", "context")),
    ("act_embed", None),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("layers", None),
    ("norm", None),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
)


class ShardingError(ValueError):
  """A tensor cannot be sharded as the rules say."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the mesh axes; one of them may be -1 for "the rest"."""

  data: int = -1
  fsdp: int = 1
  context: int = 1
  tensor: int = 1
  expert: int = 1

  def resolve(self, n_devices: int) -> dict[str, int]:
    sizes = {a: getattr(self, a) for a in MESH_AXES}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
      raise ValueError(f"mesh: at most one axis may be -1, got {free}")
    for k, v in sizes.items():
      if v == 0 or v < -1:
        raise ValueError(f"mesh.{k} must be positive or -1, got {v}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
      if n_devices % fixed:
        raise ValueError(f"mesh: {n_devices} devices do not divide by the "
                         f"fixed axes' product {fixed} ({sizes})")
      sizes[free[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
      raise ValueError(f"mesh: axes {sizes} use {math.prod(sizes.values())} "
                       f"devices but {n_devices} are available")
    return sizes


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None
              ) -> Mesh:
  """Builds a (data, fsdp, context, tensor, expert) mesh over `devices`
  (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = cfg.resolve(len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  try:
    from jax.experimental import mesh_utils  # topology-aware on TPU
    grid = mesh_utils.create_device_mesh(shape, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, MESH_AXES)


def _as_tuple(axes: Any) -> tuple[str, ...]:
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  return tuple(axes)


@dataclasses.dataclass(frozen=True)
class Sharder:
  """Maps logical axis names to shardings on one mesh."""

  mesh: Mesh
  rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES

  def __post_init__(self):
    names = [n for n, _ in self.rules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
      raise ValueError(f"sharding rules: logical names listed twice: {dup}")
    for name, axes in self.rules:
      for a in _as_tuple(axes):
        if a not in self.mesh.axis_names:
          raise ValueError(f"sharding rule {name!r} -> {axes!r}: mesh has no "
                           f"axis {a!r} (axes: {self.mesh.axis_names})")

  @property
  def rule_map(self) -> Mapping[str, tuple[str, ...]]:
    return {n: _as_tuple(a) for n, a in self.rules}

  def mesh_axes(self, logical: Iterable[str | None]) -> list[tuple[str, ...]]:
    rules = self.rule_map
    out = []
    for name in logical:
      if name is None:
        out.append(())
      elif name not in rules:
        raise ShardingError(f"logical axis {name!r} has no sharding rule "
                            f"(rules: {sorted(rules)})")
      else:
        out.append(rules[name])
    used = [a for axes in out for a in axes]
    if len(used) != len(set(used)):
      raise ShardingError(f"logical axes {tuple(logical)} map mesh axes "
                          f"{used} more than once")
    return out

  def spec(self, logical: Sequence[str | None]) -> PartitionSpec:
    return PartitionSpec(*[(a if len(a) > 1 else a[0]) if a else None
                           for a in self.mesh_axes(logical)])

  def axis_size(self, axes: tuple[str, ...]) -> int:
    return math.prod(self.mesh.shape[a] for a in axes)

  def param_sharding(self, what: str, shape: Sequence[int],
                     logical: Sequence[str | None]) -> NamedSharding:
    """Sharding for a parameter; raises naming `what` if it cannot divide."""
    if len(shape) != len(logical):
      raise ShardingError(f"{what}: shape {tuple(shape)} has {len(shape)} dims "
                          f"but logical axes {tuple(logical)} name "
                          f"{len(logical)}")
    for dim, name, axes in zip(shape, logical, self.mesh_axes(logical)):
      size = self.axis_size(axes)
      if dim % size:
        raise ShardingError(
            f"{what}: dimension {name!r} of size {dim} does not divide over "
            f"mesh axes {axes} of size {size}; change the mesh or the "
            f"sharding rule for {name!r}")
    return NamedSharding(self.mesh, self.spec(logical))

  def activation_spec(self, shape: Sequence[int],
                      logical: Sequence[str | None]) -> PartitionSpec:
    # A batch smaller than the data axes (one prompt in a prefill) cannot be
    # split; those dims stay whole. Parameters never take this path.
    parts = []
    for dim, axes in zip(shape, self.mesh_axes(logical)):
      keep = axes if axes and dim % self.axis_size(axes) == 0 else ()
      parts.append((keep if len(keep) > 1 else keep[0]) if keep else None)
    return PartitionSpec(*parts)

  def constrain(self, x: jax.Array, logical: Sequence[str | None]
                ) -> jax.Array:
    spec = self.activation_spec(x.shape, logical)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def data_sharding(self, shape: Sequence[int],
                    logical: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(self.mesh, self.activation_spec(shape, logical))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())


def host_to_global(x: np.ndarray, sharding: jax.sharding.Sharding
                   ) -> jax.Array:
  """A global array from a host array that every process holds in full.

  Each process places only the shards its own devices hold (one explicit
  transfer per shard), so this works the same in one process and across the
  hosts of a pod.
  """
  x = np.asarray(x)
  index_map = sharding.addressable_devices_indices_map(x.shape)
  shards = [jax.device_put(x[index], device)
            for device, index in index_map.items()]
  return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def tree_bytes_per_device(abstract_tree: Any, sharding_tree: Any) -> int:
  """Bytes one device holds of a sharded pytree (ShapeDtypeStruct leaves)."""
  sizes = jax.tree.map(
      lambda leaf, sh: math.prod(sh.shard_shape(leaf.shape)) *
      np.dtype(leaf.dtype).itemsize, abstract_tree, sharding_tree)
  return int(sum(jax.tree.leaves(sizes)))


def abstract_arrays(tree: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `tree`'s leaves (arrays or ShapeDtypeStructs)
  placed with `shardings` (a matching tree, or one sharding for all): the
  arguments of an ahead-of-time compile."""
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), x.dtype, sharding=shardings), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      np.shape(x), x.dtype, sharding=s), tree, shardings)


def batch_shardings(sharder: Sharder, tree: Any) -> Any:
  """Every leaf of a batch pytree sharded on its leading (batch) axis."""
  return jax.tree.map(
      lambda x: sharder.data_sharding(np.shape(x), ("batch",) + (None,) * (
          np.ndim(x) - 1)), tree)


def place_batch(sharder: Sharder, tree: Any) -> Any:
  """A host batch pytree (held in full by every process) as global arrays,
  each leaf sharded on its leading axis."""
  return jax.tree.map(host_to_global, tree, batch_shardings(sharder, tree))


def process_rows(sharding: jax.sharding.Sharding, shape: Sequence[int]
                 ) -> range:
  """The leading-axis rows that this process's devices hold."""
  starts, stops = [], []
  for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
    rows = index[0] if index else slice(None)
    starts.append(rows.start or 0)
    stops.append(shape[0] if rows.stop is None else rows.stop)
  return range(min(starts), max(stops))


def constrain(sharder: Sharder | None, x: jax.Array,
              logical: Sequence[str | None]) -> jax.Array:
  """Sharding constraint, or identity when running without a mesh."""
  return x if sharder is None else sharder.constrain(x, logical)


def tree_param_shardings(sharder: Sharder, abstract_tree: Any,
                         logical_tree: Any) -> Any:
  """Shardings for a parameter pytree, validating every leaf by path."""
  paths_and_leaves = jax.tree_util.tree_flatten_with_path(abstract_tree)[0]
  logical_leaves = jax.tree_util.tree_flatten(
      logical_tree, is_leaf=lambda x: isinstance(x, tuple))[0]
  if len(paths_and_leaves) != len(logical_leaves):
    raise ShardingError(f"{len(paths_and_leaves)} parameters but "
                        f"{len(logical_leaves)} logical-axis annotations")
  shardings = [
      sharder.param_sharding(jax.tree_util.keystr(path), leaf.shape, logical)
      for (path, leaf), logical in zip(paths_and_leaves, logical_leaves)
  ]
  return jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(abstract_tree), shardings)


def init_shardings(init_fn: Callable[[jax.Array], Any], logical_tree: Any,
                   sharder: Sharder) -> Any:
  """The shardings of what `init_fn(key)` creates (a parameter pytree with
  `logical_tree`'s axis names), from its shapes alone."""
  abstract = jax.eval_shape(lambda: init_fn(jax.random.key(0)))
  return tree_param_shardings(sharder, abstract, logical_tree)


def init_sharded(init_fn: Callable[[jax.Array], Any], logical_tree: Any,
                 sharder: Sharder, seed: int) -> Any:
  """`init_fn(jax.random.key(seed))` with every parameter created directly
  in its sharding, the key made inside the jitted init: no device ever
  holds all of it."""
  shardings = init_shardings(init_fn, logical_tree, sharder)
  seed_array = jax.device_put(np.asarray(seed, np.uint32),
                              sharder.replicated())
  return jax.jit(lambda s: init_fn(jax.random.key(s)),
                 out_shardings=shardings)(seed_array)


def rules_from_config(rules: Iterable[Sequence[Any]]) -> tuple:
  """Normalises rules given in a config (lists of [name, axes])."""
  out = []
  for i, rule in enumerate(rules):
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(f"sharding.rules[{i}] must be (logical_name, axes), "
                       f"got {rule!r}")
    axes = rule[1]
    out.append((rule[0], None if axes is None else
                (axes if isinstance(axes, str) else tuple(axes))))
  return tuple(out)
