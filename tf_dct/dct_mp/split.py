"""The Keras-free core of the DCT-MP split layer, and the layer around it.

`SplitCore` holds the configuration, validates it, creates the layer state
through a callback the Keras wrapper provides, and applies one of three modes:

* "dct": DCT-MP (Algorithm 2), `tf_dct.dct_mp.op` / `dct_mp_transfer`.
* "gaussian_sketch": forward sketch, dense backward (Appendix A).
* "xgrad_topk": dense forward, top-k + error feedback backward (Appendix A).

By default "dct" also masks at inference: the layers after the split were
trained on rows with k non-zeros, and a dense row would shift their input.
With `warmup_steps` the first training calls keep more entries per row (the
count is layer state, so a restored model resumes the schedule). With
rescale="l1" the kept entries of a row and their gradient are scaled by the
row's L1 norm over theirs, with "l1_backward" the gradient only
(`tf_dct.dct_mp.rescale`; nothing more crosses). With
`target_device` or `target_logical_device` only the compressed form crosses
to that device; outside a tf_dct replica the layer runs the same mask in
place, bit for bit. "xgrad_topk" keeps its residual as per-replica state of
the replicator it is built under. Per call the layer accounts the bytes that
cross (`bytes_stats`, `tf_dct_mp/<name>/...` summaries). docs/dct_mp.md has
each of these in full.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

import tensorflow as tf

from tf_dct.dct_mp.gaussian_sketch import gaussian_sketch
from tf_dct.dct_mp.op import check_input
from tf_dct.dct_mp.op import check_sparsity
from tf_dct.dct_mp.op import WARMUPS
from tf_dct.dct_mp.op import dct_mp
from tf_dct.dct_mp.op import dct_mp_kept
from tf_dct.dct_mp.op import kept_at
from tf_dct.dct_mp.op import num_kept
from tf_dct.dct_mp.rescale import check_rescale
from tf_dct.dct_mp.transfer import compact_bytes
from tf_dct.dct_mp.transfer import dct_mp_transfer
from tf_dct.dct_mp.transfer import device_scope
from tf_dct.dct_mp.xgrad_topk import xgrad_topk
from tf_dct.distribute.per_replica_state import PerReplicaState
from tf_dct.distribute.replicator import ReplicatorMixin

MODES = ("dct", "gaussian_sketch", "xgrad_topk")
STAT_NAMES = ("forward_bytes", "backward_bytes", "dense_bytes",
              "total_forward_bytes", "total_backward_bytes",
              "total_dense_bytes", "calls")

# The TensorBoard group of the split layers' scalars.
SUMMARY_GROUP = "tf_dct_mp"
_SCALAR_METADATA = tf.compat.v1.SummaryMetadata(
    plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))

# add_variable(name, shape, dtype) -> a non-trainable, zero-initialised
# variable whose value is kept per replica.
AddVariable = Callable[[str, list, tf.DType], Any]


def current_replicator() -> ReplicatorMixin | None:
  """The tf_dct replicator whose replica context this is, else None."""
  if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
    return None
  strategy = tf.distribute.get_replica_context().strategy
  return strategy if isinstance(strategy, ReplicatorMixin) else None


class SplitCore:
  """Configuration, state and forward of a DCT-MP split (no Keras here).

  Args:
    sparsity: eta in [0, 1), the fraction of each row dropped.
    mode: "dct", "gaussian_sketch" or "xgrad_topk".
    apply_at_inference: apply the mode when training is false; None: only
      for mode "dct" (see the module docstring).
    target_device: device string the output is produced on, or None.
    target_logical_device: index of the current tf_dct Replicator's
      `logical_device` the output is produced on, or None; outside a replica
      context of a tf_dct replicator the layer runs in place (same values).
    sketch_seed: seed of the fixed Gaussian sketch ("gaussian_sketch").
    feedback_rows: rows of the error-feedback residual ("xgrad_topk"); default:
      the product of the static leading dimensions of the first input.
    warmup_steps: training calls (>= 0) before the full sparsity ("dct"
      only); see the module docstring.
    warmup: "linear" (sparsity rising from 0) or "dense" (unmasked) during
      the warm-up.
    rescale: "none"; "l1" to scale each row's kept entries (and their
      gradient) to the row's L1 norm; "l1_backward" to scale the gradient
      only ("dct" only; `tf_dct.dct_mp.rescale`).
    name: the layer's name; its summary scalars are `tf_dct_mp/<name>/...`.
  """

  def __init__(self, sparsity: float = 0.9, mode: str = "dct",
               apply_at_inference: bool | None = None,
               target_device: str | None = None,
               target_logical_device: int | None = None,
               sketch_seed: int = 0, feedback_rows: int | None = None,
               warmup_steps: int = 0, warmup: str = "linear",
               rescale: str = "none", name: str = "dct_split"):
    self.sparsity = check_sparsity(sparsity, "DCTSplit")
    if mode not in MODES:
      raise ValueError(f"DCTSplit: mode must be one of {MODES}, got {mode!r}")
    if apply_at_inference is not None and not isinstance(apply_at_inference,
                                                          bool):
      raise ValueError("DCTSplit: apply_at_inference must be None or a bool, got "
                       f"{apply_at_inference!r}")
    if target_device is not None and not isinstance(target_device, str):
      raise ValueError("DCTSplit: target_device must be a device string or "
                       f"None, got {target_device!r}")
    if target_device is not None and target_logical_device is not None:
      raise ValueError("DCTSplit: give target_device or target_logical_device, "
                       "not both")
    for arg, value, lo in (("target_logical_device", target_logical_device, 0),
                           ("feedback_rows", feedback_rows, 1)):
      if value is not None and (isinstance(value, bool) or
                                not isinstance(value, numbers.Integral) or
                                value < lo):
        raise ValueError(f"DCTSplit: {arg} must be None or an int >= {lo}, "
                         f"got {value!r}")
    if isinstance(sketch_seed, bool) or not isinstance(sketch_seed, numbers.Integral):
      raise ValueError(f"DCTSplit: sketch_seed must be an int, got {sketch_seed!r}")
    if (isinstance(warmup_steps, bool) or
        not isinstance(warmup_steps, numbers.Integral) or warmup_steps < 0):
      raise ValueError("DCTSplit: warmup_steps must be an int >= 0, got "
                       f"{warmup_steps!r}")
    if warmup not in WARMUPS:
      raise ValueError(f"DCTSplit: warmup must be one of {WARMUPS}, got "
                       f"{warmup!r}")
    if warmup_steps and mode != "dct":
      raise ValueError("DCTSplit: warmup_steps > 0 needs mode='dct', got "
                       f"mode={mode!r}")
    check_rescale(rescale, "DCTSplit")
    if rescale != "none" and mode != "dct":
      raise ValueError(f"DCTSplit: rescale={rescale!r} needs mode='dct', got "
                       f"mode={mode!r}")
    self.mode = mode
    self.apply_at_inference = apply_at_inference
    self.target_device = target_device
    self.target_logical_device = (None if target_logical_device is None
                                  else int(target_logical_device))
    self.sketch_seed = int(sketch_seed)
    self.feedback_rows = None if feedback_rows is None else int(feedback_rows)
    self.warmup_steps = int(warmup_steps)
    self.warmup = warmup
    self.rescale = rescale
    self.step = None  # training calls so far (a variable when warmup_steps > 0)
    self.name = name
    self.stats: dict[str, Any] = {}
    self.residual = None
    self._residual_owner = None  # the replicator of a per-replica residual
    self.d = None

  def config(self) -> dict:
    """The constructor arguments (without `name`), JSON-serializable."""
    return {"sparsity": self.sparsity, "mode": self.mode,
            "apply_at_inference": self.apply_at_inference,
            "target_device": self.target_device,
            "target_logical_device": self.target_logical_device,
            "sketch_seed": self.sketch_seed,
            "feedback_rows": self.feedback_rows,
            "warmup_steps": self.warmup_steps, "warmup": self.warmup,
            "rescale": self.rescale}

  def build(self, shape, add_variable: AddVariable) -> None:
    """Validates the input shape and creates the state."""
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank < 2:
      raise ValueError(f"DCTSplit: inputs must have rank >= 2 ([batch, ..., d]), "
                       f"got shape {shape}")
    d = shape[-1]
    if d is None:
      raise ValueError(f"DCTSplit: the last axis (d) must be known, got {shape}")
    k = num_kept(d, self.sparsity)
    if k < 1:
      raise ValueError(f"DCTSplit: k = d - floor(d * sparsity) must be >= 1, got "
                       f"k = {k} for d = {d}, sparsity = {self.sparsity}")
    rows = self.feedback_rows
    if self.mode == "xgrad_topk" and rows is None:
      lead = shape[:-1]
      if not lead.is_fully_defined():
        raise ValueError(
            "DCTSplit(mode='xgrad_topk'): the error-feedback residual needs a "
            f"static number of rows; the input shape is {shape}: pass "
            "feedback_rows (per-replica batch times middle axes) or a static "
            "batch size")
      rows = lead.num_elements()
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, ReplicatorMixin):
      self._check_logical_device(strategy)
    elif (self.mode == "xgrad_topk" and tf.distribute.has_strategy() and
          strategy.num_replicas_in_sync > 1):
      raise ValueError(
          "DCTSplit(mode='xgrad_topk') keeps its error-feedback residual per "
          "replica, which needs a tf_dct replicator (build the layer in its "
          f"scope) or no strategy; got {type(strategy).__name__} with "
          f"{strategy.num_replicas_in_sync} replicas")
    self.d = d
    self.stats = {n: add_variable(n, [], tf.int64) for n in STAT_NAMES}
    if self.warmup_steps:
      self.step = add_variable("warmup_step", [], tf.int64)
    if self.mode == "xgrad_topk":
      self.feedback_rows = rows
      if isinstance(strategy, ReplicatorMixin):
        self.residual = strategy.per_replica_state(
            tf.zeros([rows, d], tf.float32), name=f"{self.name}/residual")
        self._residual_owner = strategy
      else:
        # On the target device, where the backward reads and updates it.
        with device_scope(self.target_device):
          self.residual = add_variable("residual", [rows, d], tf.float32)

  def _check_logical_device(self, replicator: ReplicatorMixin) -> None:
    index, k = self.target_logical_device, replicator.num_devices_per_replica
    if index is not None and index >= k:
      raise ValueError(
          f"DCTSplit: target_logical_device must be in [0, {k}) for a "
          f"replicator with num_devices_per_replica={k}, got {index}")

  def _residual_variable(self):
    """The residual variable of the current replica ("xgrad_topk")."""
    replicator = current_replicator()
    if isinstance(self.residual, PerReplicaState):
      if replicator is not self._residual_owner:
        raise ValueError(
            "DCTSplit(mode='xgrad_topk'): the residual is kept per replica of "
            "the tf_dct replicator the layer was built under; call the layer "
            "with training=True inside that replicator's run(...) (or Keras "
            "fit)")
      return self.residual.local()
    if replicator is not None and replicator.num_replicas_in_sync > 1:
      raise ValueError(
          "DCTSplit(mode='xgrad_topk'): the layer was built outside a tf_dct "
          "replicator's scope, so its residual is one variable, but it runs "
          f"on {replicator.num_replicas_in_sync} replicas; build it in "
          "replicator.scope()")
    return self.residual

  def _target(self):
    """The target device, or None to run in place (see the module docstring)."""
    if self.target_device is not None:
      return self.target_device
    if self.target_logical_device is None:
      return None
    replicator = current_replicator()
    if replicator is None:  # no replica of a tf_dct replicator: in place
      return None
    self._check_logical_device(replicator)
    index = self.target_logical_device
    return lambda: replicator.logical_device(index)

  def __call__(self, x, training: bool) -> tf.Tensor:
    """Applies the split; identity when inactive (see the module docstring)."""
    at_inference = (self.mode == "dct" if self.apply_at_inference is None
                    else self.apply_at_inference)
    if not (training or at_inference):
      return x
    x, d, k = check_input(x, self.sparsity, "DCTSplit")
    if d != self.d:
      raise ValueError(f"DCTSplit: built for d = {self.d}, got input {x.shape}")
    target = self._target()
    warm = None
    if self.mode == "dct" and self.warmup_steps:
      y, warm = self._dct_with_warmup(x, d, k, target, bool(training))
    elif self.mode == "dct":
      y = (dct_mp(x, self.sparsity, self.rescale) if target is None else
           dct_mp_transfer(x, self.sparsity, target, rescale=self.rescale))
    elif self.mode == "gaussian_sketch":
      y = gaussian_sketch(x, self.sparsity, self.sketch_seed, target)
    else:
      y = xgrad_topk(x, self.sparsity, self._residual_variable(), target)
    self._account(x, d, k, bool(training), warm)
    return y

  def _dct_with_warmup(self, x, d: int, k: int, target, training: bool):
    """DCT-MP under the warm-up schedule; returns (y, in the warm-up)."""
    step = tf.convert_to_tensor(self.step)
    warm = step < self.warmup_steps
    sparsity, rescale = self.sparsity, self.rescale

    def warming():
      y = dct_mp_kept(x, kept_at(step, d, k, self.warmup_steps, self.warmup),
                      rescale)
      with device_scope(target):  # the activation crosses dense
        return tf.identity(y)

    def full():
      return (dct_mp(x, sparsity, rescale) if target is None
              else dct_mp_transfer(x, sparsity, target, rescale=rescale))

    y = tf.cond(warm, warming, full)
    if training:
      with tf.control_dependencies([y]):
        self.step.assign_add(1)
    return y, warm

  def message_bytes(self, rows, d: int, k: int, dtype: tf.DType,
                    training: bool) -> tuple[Any, Any, Any]:
    """(forward, backward, dense per direction) bytes for `rows` rows."""
    val = tf.as_dtype(dtype).size
    dense = rows * d * val
    compact = compact_bytes(rows, d, k, dtype)  # values + encoded indices
    # "dct" backward: values only; both sides kept the forward's indices.
    forward, backward = {"dct": (compact, rows * k * val),
                         "gaussian_sketch": (rows * k * val, dense),
                         "xgrad_topk": (dense, compact)}[self.mode]
    return forward, backward if training else 0 * backward, dense

  def _account(self, x, d: int, k: int, training: bool, warm=None) -> None:
    rows = tf.cast(tf.reduce_prod(tf.shape(x)[:-1]), tf.int64)
    fwd, bwd, dense = self.message_bytes(rows, d, k, x.dtype, training)
    if warm is not None:  # the warm-up sends the dense activation both ways
      fwd = tf.where(warm, dense, fwd)
      bwd = tf.where(warm, dense if training else 0 * dense, bwd)
    s = self.stats
    s["forward_bytes"].assign(fwd)
    s["backward_bytes"].assign(bwd)
    s["dense_bytes"].assign(dense)
    s["total_forward_bytes"].assign_add(fwd)
    s["total_backward_bytes"].assign_add(bwd)
    s["total_dense_bytes"].assign_add(dense * (2 if training else 1))
    calls = s["calls"].assign_add(1)
    self._summarize(fwd, bwd, dense, calls)

  def _summarize(self, fwd, bwd, dense, calls) -> None:
    ctx = tf.distribute.get_replica_context()
    if ctx is not None:
      replica = tf.get_static_value(ctx.replica_id_in_sync_group)
      if replica is not None and int(replica) != 0:
        return
    step = tf.summary.experimental.get_step()
    step = calls if step is None else step
    for tag, value in (("forward_bytes", fwd), ("backward_bytes", bwd),
                       ("dense_bytes", dense)):
      # tf.summary.write with the "scalars" plugin tag is what
      # tf.summary.scalar writes; it works without TensorBoard installed and
      # is a no-op without a default writer.
      tf.summary.write(f"{SUMMARY_GROUP}/{self.name}/{tag}", tf.cast(value, tf.float32),
                       step=step, metadata=_SCALAR_METADATA)

  def read_stats(self) -> dict[str, int]:
    """The accounting variables as Python ints (first replica's values)."""
    return {n: int(tf.convert_to_tensor(v).numpy()) for n, v in self.stats.items()}


class SplitLayerMixin:
  """The Keras layer around a `SplitCore`, for both Keras flavours.

  A flavour is `class DCTSplit(SplitLayerMixin, <Keras Layer>)` defining
  `_add_state(name, shape, dtype)`: a non-trainable, zero-initialised
  variable synchronised on read that only the first replica's value
  aggregates (the accounting; without a strategy, a plain variable).

  Args:
    sparsity, mode, apply_at_inference, target_device, target_logical_device,
    sketch_seed, feedback_rows, warmup_steps, warmup, rescale: see
      `SplitCore`.
    **kwargs: passed to the Keras layer (`name`, ...). Inputs are not
      autocast by default: the op runs in the input's dtype.
  """

  def __init__(self, sparsity: float = 0.9, mode: str = "dct",
               apply_at_inference: bool | None = None,
               target_device: str | None = None,
               target_logical_device: int | None = None,
               sketch_seed: int = 0, feedback_rows: int | None = None,
               warmup_steps: int = 0, warmup: str = "linear",
               rescale: str = "none", **kwargs):
    # Validate before the Keras layer exists (Keras 3 allows no attribute
    # before its __init__).
    core = SplitCore(sparsity, mode, apply_at_inference, target_device,
                     target_logical_device, sketch_seed, feedback_rows,
                     warmup_steps, warmup, rescale)
    kwargs.setdefault("autocast", False)
    super().__init__(**kwargs)
    core.name = self.name
    self._core = core

  def _add_state(self, name: str, shape: list, dtype: tf.DType):
    raise NotImplementedError("a DCTSplit flavour defines _add_state")

  def build(self, input_shape):
    self._core.build(input_shape, self._add_state)
    if isinstance(self._core.residual, PerReplicaState):
      # Tracked, so a checkpoint of the layer holds every replica's residual.
      self.residual_per_replica = self._core.residual
    super().build(input_shape)

  def call(self, inputs, training=None):
    return self._core(inputs, training=bool(training))

  def compute_output_shape(self, input_shape):
    return input_shape

  @property
  def sparsity(self) -> float:
    return self._core.sparsity

  @property
  def mode(self) -> str:
    return self._core.mode

  @property
  def residual(self):
    """The error-feedback residual ("xgrad_topk"), else None.

    A `tf_dct.PerReplicaState` when built under a tf_dct replicator, else a
    variable.
    """
    return self._core.residual

  def bytes_stats(self) -> dict[str, int]:
    """Accounting (last active call and totals, first replica) as ints."""
    return self._core.read_stats()

  def get_config(self):
    return {**super().get_config(), **self._core.config()}
