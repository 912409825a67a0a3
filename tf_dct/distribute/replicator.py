"""The Replicator API (TF-Replicator §3) on top of TensorFlow's own strategies.

`ReplicatorMixin` holds everything the replicator kinds share: the
`run(step_fn, input_fn)` form, the communication primitives, `logical_device`,
per-replica state and `wrap_optimizer`. Each concrete replicator is a thin
subclass of one built-in strategy plus this mixin, so tf.distribute, tf-keras
and Keras 3 see the built-in class they extend.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Callable, Sequence

import tensorflow as tf

from tf_dct import _private
from tf_dct.distribute import input_pipeline
from tf_dct.distribute import primitives
from tf_dct.distribute.per_replica_state import PerReplicaState

PER_WORKER = input_pipeline.PER_WORKER
PER_REPLICA = input_pipeline.PER_REPLICA


def check_positive_int(name: str, value) -> int:
  """Returns `value` if it is an int >= 1, else raises naming `name`."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")
  return value


def check_devices(devices) -> list[str]:
  """Returns `devices` as a list if every name is a local logical device.

  A name TensorFlow does not know (e.g. "/cpu:99", or "/gpu:0" on a machine
  without GPUs) would otherwise be placed silently on another device. Names
  of remote jobs, and names without a device type, are left to TensorFlow.

  Raises:
    TypeError: `devices` is a string, not a list of device names.
    ValueError: a name is not a local logical device (the message lists the
      available ones).
  """
  if isinstance(devices, (str, bytes)):
    raise TypeError(f"devices must be a list of device names, e.g. "
                    f"[{devices!r}], got the string {devices!r}")
  devices = list(devices)
  available = tf.config.list_logical_devices()
  known = set()
  for d in available:
    spec = tf.DeviceSpec.from_string(d.name)
    known.add((spec.device_type.upper(), spec.device_index))
  for name in devices:
    if not isinstance(name, str):
      raise TypeError(f"devices must hold device names (strings), got {name!r}")
    spec = tf.DeviceSpec.from_string(name)
    if spec.device_type is None or spec.job not in (None, "localhost"):
      continue
    if (spec.device_type.upper(), spec.device_index or 0) not in known:
      raise ValueError(
          f"devices: {name!r} is not a logical device of this process; "
          f"available: {', '.join(d.name for d in available)}")
  return devices


def group_devices(devices: Sequence[str], num_devices_per_replica: int
                 ) -> list[list[str]]:
  """Cuts `devices` into consecutive groups, one group per replica."""
  check_positive_int("num_devices_per_replica", num_devices_per_replica)
  devices = list(devices)
  if not devices:
    raise ValueError("devices must not be empty")
  if len(devices) % num_devices_per_replica:
    raise ValueError(
        f"the number of devices ({len(devices)}) must be divisible by "
        f"num_devices_per_replica ({num_devices_per_replica})")
  k = num_devices_per_replica
  return [devices[i:i + k] for i in range(0, len(devices), k)]


class _ReadThenCompute:
  """One `run(step_fn, input_fn)` step: `read()` every replica's element, then
  `compute(pieces)` (two calls; see `input_pipeline.ReplicatedInput.read`).

  `replicated_step` is what runs step_fn on the replicas (XLA-compiled under
  `jit_compile=True`).
  """

  def __init__(self, read, compute, replicated_step):
    self.read, self.compute, self.replicated_step = read, compute, replicated_step

  def __call__(self):
    return self.compute(self.read())

  def get_concrete_function(self):
    return self.compute.get_concrete_function()


class ReplicatorMixin:
  """The TF-Replicator API shared by every replicator kind."""

  def _init_replicator(self, device_groups: Sequence[Sequence[str]] | None,
                       input_replication, input_split_fn, jit_compile: bool):
    if not isinstance(input_replication, input_pipeline.InputReplication):
      raise ValueError("input_replication must be tf_dct.PER_WORKER or "
                       f"tf_dct.PER_REPLICA, got {input_replication!r}")
    if input_split_fn is not None and not callable(input_split_fn):
      raise TypeError(f"input_split_fn must be callable, got {input_split_fn!r}")
    self._device_groups = [list(g) for g in device_groups] if device_groups else None
    self._input_replication = input_replication
    self._input_split_fn = input_split_fn
    self._jit_compile = bool(jit_compile)
    self._inputs = {}
    self._steps = {}
    self._trace_hooks = []
    self._cache_lock = threading.Lock()

  # --- topology ---------------------------------------------------------------

  @property
  def num_replicas(self) -> int:
    """Replicas in sync across all workers (the paper's `num_replicas`)."""
    return self.num_replicas_in_sync

  @property
  def num_devices_per_replica(self) -> int:
    return len(self._device_groups[0]) if self._device_groups else 1

  @property
  def replica_devices(self) -> list[str]:
    """The (first) device of each local replica, in local replica order."""
    return list(self.extended.worker_devices)

  @property
  def first_local_replica_id(self) -> int:
    return _private.first_local_replica_id(self)

  def local_replica_index(self, caller: str = "local_replica_index") -> int:
    """Index among this worker's replicas of the replica tracing step_fn."""
    ctx = primitives.replica_context(caller, self)
    replica_id = _private.static_replica_id(ctx)
    if replica_id is None:
      raise NotImplementedError(
          f"{caller}() needs a static replica id, which this strategy does "
          "not provide (TPU replicas share one program)")
    return int(replica_id) - self.first_local_replica_id

  @contextlib.contextmanager
  def logical_device(self, index: int):
    """Places the ops built inside on logical device `index` of this replica.

    Model parallelism (TF-Replicator §3.3): with `num_devices_per_replica=k`
    every replica owns k devices; `logical_device(0)` is where step_fn runs by
    default, `logical_device(i)` the i-th device of the same replica.
    """
    k = self.num_devices_per_replica
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < k:
      raise ValueError(f"logical_device index must be an int in [0, {k}) "
                       f"(num_devices_per_replica={k}), got {index!r}")
    local = self.local_replica_index("logical_device")
    groups = self._device_groups or [[d] for d in self.replica_devices]
    with tf.device(groups[local][index]):
      yield

  # --- run --------------------------------------------------------------------

  def run(self, fn, args=(), kwargs=None, options=None, *, input_fn=None):
    """Runs `fn` on every replica.

    Two forms:

    * `run(step_fn, input_fn)`: the TF-Replicator form. The input of `input_fn`
      is built once (cached per `input_fn` object); every call takes the next
      element for each replica and runs `step_fn(element)` on every replica in
      a `tf.function` cached per (step_fn, input_fn). Returns per-replica
      outputs (use `experimental_local_results` to unpack them).
    * `run(fn, args=(), kwargs=None, options=None)`: the `tf.distribute`
      form, unchanged (Keras calls this one).
    """
    input_fn, args = self._run_form(fn, args, kwargs, options, input_fn)
    if input_fn is None:
      return super().run(fn, args=args, kwargs=kwargs, options=options)
    with contextlib.ExitStack() as stack:
      keys = tuple(stack.enter_context(hook()) for hook in self._trace_hooks)
      if all(key is None for key in keys):
        keys = ()
      return self._replicated_step(fn, input_fn, keys)()

  @staticmethod
  def _run_form(fn, args, kwargs, options, input_fn) -> tuple:
    """Tells the two forms of `run` apart and checks their arguments.

    Returns (input_fn, args): input_fn None for the `tf.distribute` form
    `run(fn, args, kwargs, options)`, else the TF-Replicator form
    `run(step_fn, input_fn)`, which takes nothing else (input_fn may come
    positionally, as `args`).
    """
    if not callable(fn):
      raise TypeError(f"run: step_fn must be callable, got {type(fn).__name__}")
    if input_fn is None and callable(args) and not isinstance(args, (tuple, list)):
      input_fn, args = args, ()
    if input_fn is None:
      if isinstance(args, tf.data.Dataset):
        raise TypeError("run: input_fn must be a callable returning a Dataset, "
                        "got a Dataset; pass `lambda ctx: dataset`")
      return None, args
    if not callable(input_fn):
      raise TypeError(
          f"run: input_fn must be callable, got {type(input_fn).__name__}")
    if args or kwargs or options:
      raise ValueError("run(step_fn, input_fn) takes no args/kwargs/options")
    return input_fn, args

  def add_trace_hook(self, hook: Callable[[], contextlib.AbstractContextManager]
                     ) -> None:
    """Makes `run(step_fn, input_fn)` trace one step function per phase.

    `hook()` returns a context manager whose value is a hashable key. Every
    call of `run(step_fn, input_fn)` enters every hook, calls the step
    function cached for the tuple of their keys (tracing it when new), and
    leaves them. A hook that yields None adds no key. `wrap_optimizer` adds one for the compressor's phases
    (`tf_dct.compression.Compressor.in_phase`).
    """
    if not callable(hook):
      raise TypeError(f"add_trace_hook: hook must be callable, got {hook!r}")
    self._trace_hooks.append(hook)

  def _replicated_input(self, input_fn) -> input_pipeline.ReplicatedInput:
    with self._cache_lock:
      if input_fn not in self._inputs:
        code = getattr(input_fn, "__code__", None)
        if code is not None and any(
            getattr(f, "__code__", None) is code for f in self._inputs):
          warnings.warn(
              "run(step_fn, input_fn): this input_fn is a new object with the "
              "same code as one used before, so its input starts again from "
              "the beginning and the step is traced again. Pass the same "
              "function object on every step.", stacklevel=4)
        self._inputs[input_fn] = input_pipeline.ReplicatedInput(
            input_fn, self._input_replication, self._input_split_fn,
            num_local_replicas=len(self.replica_devices),
            first_replica_id=self.first_local_replica_id,
            input_context=_private.input_context(self))
      return self._inputs[input_fn]

  def _replicated_step(self, step_fn, input_fn, phase=()
                       ) -> Callable[[], object]:
    key = (step_fn, input_fn) + ((phase,) if phase else ())
    with self._cache_lock:
      if key in self._steps:
        return self._steps[key]
    source = self._replicated_input(input_fn)
    first = self.first_local_replica_id
    base_run = super().run

    replicated = lambda inputs: base_run(step_fn, args=(inputs,))
    if self._jit_compile:  # XLA takes the step; the input pipeline stays outside
      replicated = tf.function(replicated, jit_compile=True)

    def one_step(pieces):
      # An argument has no device of its own; MultiWorkerMirrored's all_reduce
      # needs one on its inputs. Put them where read() left them.
      with tf.device(input_pipeline.INPUT_DEVICE):
        pieces = tf.nest.map_structure(tf.identity, pieces)
      inputs = self.experimental_distribute_values_from_function(
          lambda ctx: pieces[ctx.replica_id_in_sync_group - first])
      return replicated(inputs)

    step = _ReadThenCompute(source.read, tf.function(
        one_step, input_signature=[source.spec]), replicated)
    with self._cache_lock:
      return self._steps.setdefault(key, step)

  # --- primitives (TF-Replicator §3.4; semantics in tf_dct.distribute.primitives) -----------

  def all_reduce(self, x, op="sum"):
    return primitives.all_reduce(x, op, strategy=self)

  def all_sum(self, x):
    return primitives.all_sum(x, strategy=self)

  def all_gather(self, x, axis: int = 0):
    return primitives.all_gather(x, axis, strategy=self)

  def broadcast(self, x, source_replica: int = 0):
    return primitives.broadcast(x, source_replica, strategy=self)

  def map_reduce(self, fn, x, op="sum"):
    return primitives.map_reduce(fn, x, op, strategy=self)

  def map_gather(self, fn, x):
    return primitives.map_gather(fn, x, strategy=self)

  # --- state and optimizers ----------------------------------------------------

  def per_replica_state(self, initial_value, name: str = "per_replica_state"
                       ) -> PerReplicaState:
    """Variables whose value differs per replica; see `PerReplicaState`."""
    return PerReplicaState(self, initial_value, name=name)

  def wrap_optimizer(self, optimizer, compression=None):
    """Shorthand for `tf_dct.wrap_optimizer(optimizer, self, compression)`."""
    from tf_dct import keras  # pylint: disable=g-import-not-at-top
    return keras.wrap_optimizer(optimizer, self, compression)

  @property
  def jit_compile(self) -> bool:
    """Whether `run` compiles each step's replica function with XLA."""
    return self._jit_compile

  def agree(self, topic: str, config: dict) -> None:
    """Raises unless every worker passes the same `config` for `topic`.

    One process holds every replica, so there is nothing to compare here;
    `MultiWorkerReplicator` compares across workers.
    """
    del topic, config


class Replicator(ReplicatorMixin, tf.distribute.MirroredStrategy):
  """In-graph replicator on one machine: CPU or GPUs (Table 1 Multi-GPU/Non).

  Args:
    devices: every device used, e.g. `["/cpu:0", ..., "/cpu:3"]`. Default: all
      logical GPUs, or all logical CPUs when there is no GPU.
    num_devices_per_replica: devices per (model-parallel) replica; the devices
      are cut into consecutive groups of this size, one replica per group.
    input_replication: `PER_WORKER` (default) or `PER_REPLICA`.
    input_split_fn: `(element, n) -> list of n elements` for PER_WORKER input;
      default splits the leading (batch) dimension evenly.
    jit_compile: compile `run(step_fn, input_fn)` steps with XLA; needs a
      single device (XLA compiles a step for one device).
    cross_device_ops: passed to `MirroredStrategy`.
  """

  def __init__(self, devices: Sequence[str] | None = None,
               num_devices_per_replica: int = 1,
               input_replication=PER_WORKER, input_split_fn=None,
               jit_compile: bool = False, cross_device_ops=None):
    if devices is None:
      devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
          d.name for d in tf.config.list_logical_devices("CPU")]
    devices = check_devices(devices)
    groups = group_devices(devices, num_devices_per_replica)
    if jit_compile and len(devices) > 1:
      # XLA compiles the step for one device; a step over several devices
      # reads variables on each of them, which XLA refuses only at run time.
      raise ValueError(
          f"Replicator: jit_compile=True needs exactly one device, got "
          f"{len(devices)} ({', '.join(devices)}). XLA compiles a step for a "
          "single device; compile with XLA on TPU (TPUReplicator) or with one "
          "device per process (MultiWorkerReplicator), or pass "
          "jit_compile=False")
    self._init_replicator(groups, input_replication, input_split_fn, jit_compile)
    _private.set_collective_key_base(self, _private.next_collective_key_base())
    super().__init__(devices=[g[0] for g in groups],
                     cross_device_ops=cross_device_ops)
