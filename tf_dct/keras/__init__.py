"""Thin adapters that route each Keras flavour's gradient aggregation to a Compressor.

tf-keras exposes a public hook, `Optimizer.aggregate_gradients`; Keras 3 (TF
backend) aggregates in the private `TFOptimizer._all_reduce_sum_gradients`
(pinned in `tf_dct._private`). Either way the optimizer instance gets a
subclass of its own class that overrides that one method, so its state,
hyper-parameters, serialization and checkpoint layout stay as they were. The
mixins also add `communication_stats()`, a passthrough to the compressor,
and extend `build(variables)` to create the compressor's state as well (and
to create the optimizer's slots in the replicator's scope, wherever `build`
is called). The tf-keras mixin also applies plain SGD to the variables whose
momentum, Adam or Adagrad update the compressor runs itself
(`Compressor.corrects_optimizer`). Both wrap the public `apply_gradients`
(tf-keras) or `apply` (Keras 3) so that the optimizer's writes after the
aggregation, `iterations` included, wait for it
(`updates_wait_for_aggregation`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

from absl import logging
import tensorflow as tf

from tf_dct.compression import error_feedback
from tf_dct.compression.base import Compressor

_WRAPPED_CLASSES = {}
_WRAP_COUNTS = weakref.WeakKeyDictionary()  # replicator -> optimizers wrapped
_APPLYING = threading.local()  # per replica thread: (graph, ExitStack) of `apply`


def in_replicator_scope(replicator):
  """The replicator's scope when no strategy is active, else nothing.

  An optimizer creates its slots (momentum, Adam's moments) in `build`;
  built outside the strategy's scope (e.g. `opt.build(model.variables)`
  after the `with` block) they would be one ordinary variable instead of
  one per replica, and every replica's update would write it in turn.
  """
  if replicator is None or tf.distribute.has_strategy():
    return contextlib.nullcontext()
  return replicator.scope()


def aggregate(optimizer, grads_and_vars, var_key) -> list:
  """The wrapped optimizer's compressor aggregates `grads_and_vars`; the
  variables it sent as they are (decided at their first gradient) leave the
  optimizer's plain-SGD set, so they keep the optimizer's own update.
  `var_key(optimizer, variable)`: the flavour's key of that set."""
  compressor = optimizer._tf_dct_compressor  # pylint: disable=protected-access
  out = compressor.aggregate(grads_and_vars)
  _rest_waits_for(out)
  optimizer._tf_dct_plain = getattr(optimizer, "_tf_dct_plain", set()) - {  # pylint: disable=protected-access
      var_key(optimizer, v) for _, v in out if compressor.sends_as_is(v)}
  return out


@contextlib.contextmanager
def updates_wait_for_aggregation():
  """Makes the ops an optimizer step builds after its aggregation wait for it.

  The mixins wrap the public `apply_gradients` (tf-keras) and `apply`
  (Keras 3) in this. The optimizer's own writes, its `iterations` counter
  above all, have no data dependency on the aggregate; when the compressor
  rejects a step (a NaN/Inf or misshapen gradient) they would still run,
  and e.g. Adam's bias correction would count a step that never happened.
  `aggregate` enters a control dependency on the aggregate for the rest of
  the block, so a rejected step moves nothing. Only in the graph the block
  started in (not in a `tf.cond` branch, as Keras 3's gradient
  accumulation builds).
  """
  outer = getattr(_APPLYING, "frame", None)
  with contextlib.ExitStack() as stack:
    _APPLYING.frame = (None if tf.executing_eagerly()
                       else (tf.compat.v1.get_default_graph(), stack))
    try:
      yield
    finally:
      _APPLYING.frame = outer


def _rest_waits_for(grads_and_vars) -> None:
  """The rest of the `updates_wait_for_aggregation` block waits for these."""
  frame = getattr(_APPLYING, "frame", None)
  if frame is None or tf.compat.v1.get_default_graph() is not frame[0]:
    return
  deps = error_feedback.gate([g for g, _ in grads_and_vars])
  if deps:
    frame[1].enter_context(tf.control_dependencies(deps))
    _APPLYING.frame = None  # once per step


def _swap_class(optimizer, hook_mixin):
  base = type(optimizer)
  key = (base, hook_mixin)
  if key not in _WRAPPED_CLASSES:
    cls = type(base.__name__, (hook_mixin, base), {})
    # Keep the base's identity for Keras serialization (get_config round-trips
    # to the plain optimizer: compression is a runtime concern).
    cls.__qualname__ = base.__qualname__
    cls.__module__ = base.__module__
    _WRAPPED_CLASSES[key] = cls
  optimizer.__class__ = _WRAPPED_CLASSES[key]


def is_wrapped(optimizer) -> bool:
  return getattr(optimizer, "_tf_dct_compressor", None) is not None


def communication_stats(optimizer) -> dict:
  """`optimizer.communication_stats()` of a wrapped optimizer."""
  if not is_wrapped(optimizer):
    raise ValueError("optimizer is not wrapped by tf_dct.wrap_optimizer")
  return optimizer._tf_dct_compressor.communication_stats()  # pylint: disable=protected-access


@contextlib.contextmanager
def phase(optimizer):
  """Enters the wrapped compressor's phase for the optimizer's next step.

  Yields the phase's key (None when the compressor has one phase, or when
  called while tracing: then the step decides its phase in the graph). The
  step is `optimizer.iterations`, which checkpoints restore.
  """
  compressor = optimizer._tf_dct_compressor  # pylint: disable=protected-access
  if len(compressor.phase_starts()) == 1 or not tf.executing_eagerly():
    yield None
    return
  with compressor.in_phase(int(optimizer.iterations.numpy())) as key:
    yield key


def phase_callback(optimizer):
  """A Keras callback that makes `model.fit` run each phase's own step.

  `fit` traces its train function once; a compressor with phases (e.g.
  `warmup_steps > 0`) would then decide its phase in the graph and issue
  the dense all-reduce and its own exchange on every step. With this
  callback in `fit(callbacks=[...])` the train function is traced again at
  each phase boundary (at most once per phase and callback), so a dense
  step sends only the dense all-reduce and a compressed step only the
  exchange. `optimizer` is the wrapped optimizer; tf-keras or Keras 3.
  """
  if not is_wrapped(optimizer):
    raise ValueError("phase_callback: optimizer is not wrapped by "
                     "tf_dct.wrap_optimizer")
  from tf_dct.keras import tf_keras_optimizer  # pylint: disable=g-import-not-at-top
  if tf_keras_optimizer.accepts(optimizer):
    import tf_keras as flavour  # pylint: disable=g-import-not-at-top
  else:
    import keras as flavour  # pylint: disable=g-import-not-at-top
  compressor = optimizer._tf_dct_compressor  # pylint: disable=protected-access

  class PhaseCallback(flavour.callbacks.Callback):
    """Retraces `fit`'s train function when the compressor's phase changes."""

    def __init__(self):
      super().__init__()
      self._built = (None, None)  # (train function, the phase it was traced in)

    def on_train_batch_begin(self, batch, logs=None):
      del batch, logs
      if len(compressor.phase_starts()) == 1:
        return
      phase = compressor.phase_for(int(optimizer.iterations.numpy()))
      compressor.phase = phase
      if self._built != (self.model.train_function, phase):
        self.model.make_train_function(force=True)
        self._built = (self.model.train_function, phase)

    def on_train_end(self, logs=None):
      del logs
      compressor.phase = None

  return PhaseCallback()


def _sgd_momentum(optimizer):
  """(momentum, nesterov) of a tf-keras or Keras 3 SGD optimizer, else None."""
  if type(optimizer).__name__ != "SGD" or not hasattr(optimizer, "momentum"):
    return None
  return float(optimizer.momentum), bool(getattr(optimizer, "nesterov", False))


def _resolve_momentum(optimizer, compressor: Compressor) -> None:
  """Settles the compressor's momentum correction for this optimizer.

  `momentum=None` (the default of the sparsifying compressors) takes a
  momentum SGD's momentum (tf-keras or Keras 3, without nesterov), so its
  corrected variables are applied as plain SGD (the adapters'
  `update_step`); with any other optimizer it becomes 0. An explicit
  momentum > 0 needs an SGD whose own momentum is 0 or the same value.
  """
  owner = type(compressor).__name__
  sgd = _sgd_momentum(optimizer)
  wanted = compressor.momentum
  if wanted is None:
    usable = sgd is not None and sgd[0] > 0 and not sgd[1]
    if sgd is not None and sgd[0] > 0 and not usable:
      logging.warning(
          "%s: momentum correction is off for %s (it needs an SGD without "
          "nesterov); sparsified momentum SGD may train worse than dense",
          owner, type(optimizer).__module__)
    compressor.set_momentum(sgd[0] if usable else 0.0)
    return
  if not wanted:
    return
  if sgd is None:
    raise ValueError(
        f"{owner}: momentum={wanted} (momentum correction) needs an SGD "
        f"optimizer, got {type(optimizer).__module__}."
        f"{type(optimizer).__name__}; pass momentum=0 or None")
  if sgd[1] or sgd[0] not in (0.0, wanted):
    raise ValueError(
        f"{owner}: momentum={wanted} but the SGD optimizer has momentum="
        f"{sgd[0]}, nesterov={sgd[1]}; use an SGD with momentum 0 or "
        f"{wanted} and nesterov=False")


def _adam_hparams(optimizer):
  """(beta_1, beta_2, epsilon) of an Adam or AdamW optimizer without
  amsgrad, else None."""
  if type(optimizer).__name__ not in ("Adam", "AdamW"):
    return None
  if getattr(optimizer, "amsgrad", False):
    return None
  try:
    return tuple(float(getattr(optimizer, name))
                 for name in ("beta_1", "beta_2", "epsilon"))
  except (TypeError, ValueError, AttributeError):  # e.g. a callable beta
    return None


def _resolve_adam(optimizer, compressor: Compressor) -> None:
  """Settles the compressor's Adam correction for this optimizer.

  `adam=None` (the default of DCTDP, TopK and DEFT) turns it on with an Adam
  or AdamW optimizer without amsgrad (tf-keras or Keras 3): the compressor
  then runs Adam itself (`tf_dct.compression.adam_correction`) and the
  optimizer applies the corrected variables as plain SGD. `adam=True`
  requires such an optimizer.
  """
  if compressor.adam is False:
    return
  hparams = _adam_hparams(optimizer)
  if hparams is not None:
    compressor.set_adam(*hparams)
    return
  owner = type(compressor).__name__
  name = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
  if compressor.adam:
    raise ValueError(
        f"{owner}: adam=True (Adam correction) needs an Adam or AdamW "
        f"optimizer without amsgrad, got {name}; pass adam=None or False")
  if type(optimizer).__name__ in ("Adam", "AdamW"):
    logging.warning(
        "%s: Adam correction is off for %s (amsgrad, or a hyper-parameter "
        "that is not a number); sparsified Adam may train worse than dense",
        owner, name)


def _adagrad_hparams(optimizer):
  """(initial_accumulator_value, epsilon) of an Adagrad optimizer, else
  None."""
  if type(optimizer).__name__ != "Adagrad":
    return None
  try:
    return tuple(float(getattr(optimizer, name))
                 for name in ("initial_accumulator_value", "epsilon"))
  except (TypeError, ValueError, AttributeError):  # e.g. a callable value
    return None


def _resolve_adagrad(optimizer, compressor: Compressor) -> None:
  """Settles the compressor's Adagrad correction for this optimizer.

  `adagrad=None` turns it on with an Adagrad optimizer (tf-keras or Keras
  3): the compressor then runs Adagrad itself
  (`tf_dct.compression.adagrad_correction`) and the optimizer applies the
  corrected variables as plain SGD. `adagrad=True` requires one.
  """
  if compressor.adagrad is False:
    return
  hparams = _adagrad_hparams(optimizer)
  if hparams is not None:
    compressor.set_adagrad(*hparams)
    return
  if compressor.adagrad:
    raise ValueError(
        f"{type(compressor).__name__}: adagrad=True (Adagrad correction) needs "
        f"an Adagrad optimizer, got {type(optimizer).__module__}."
        f"{type(optimizer).__name__}; pass adagrad=None or False")


def check_optimizer(optimizer) -> None:
  """Raises for an optimizer that only delegates to another one.

  A `LossScaleOptimizer` (tf-keras or Keras 3) unscales the gradients and
  hands them to its inner optimizer, which aggregates them: wrapping the
  outer one would leave the aggregation uncompressed (tf-keras) or fail at
  the first step (Keras 3). The inner optimizer is the one to wrap.
  """
  if any(c.__name__.startswith("LossScaleOptimizer")  # tf-keras: ...V3
         for c in type(optimizer).__mro__):
    raise TypeError(
        "optimizer is a LossScaleOptimizer, which hands its gradients to its "
        "inner optimizer; wrap the inner one and put the LossScaleOptimizer "
        "around it: LossScaleOptimizer(repl.wrap_optimizer(SGD(...)))")


def check_compression(compressor, replicator) -> None:
  """Raises unless `compressor` can serve one more optimizer of `replicator`.

  A compressor keeps per-variable state and statistics for the optimizer it
  serves, so it must be an instance (not the class), bound to no other
  replicator, and not already wrapping another optimizer (its statistics
  would count both).
  """
  if isinstance(compressor, type) and issubclass(compressor, Compressor):
    raise TypeError(
        f"compression must be a Compressor instance, e.g. "
        f"{compressor.__name__}(), got the class {compressor.__name__}")
  if not isinstance(compressor, Compressor):
    raise TypeError("compression must be a tf_dct.compression.Compressor, got "
                    f"{type(compressor).__name__}")
  if compressor.replicator is not None and compressor.replicator is not replicator:
    raise ValueError("this compressor is already bound to another replicator; "
                     "create one compressor per wrapped optimizer")
  if getattr(compressor, "_tf_dct_wraps", False):
    name = type(compressor).__name__
    raise ValueError(
        f"compression: this {name} already aggregates for another optimizer; "
        f"create one compressor per wrapped optimizer (e.g. {name}() for each)")


def wrap_optimizer(optimizer, replicator, compression: Compressor | None = None):
  """Makes `optimizer` aggregate its gradients across replicas itself.

  Args:
    optimizer: a tf-keras or Keras 3 optimizer created in `replicator`'s
      scope. It is wrapped in place (its class gains the aggregation hook; its
      state and checkpoint layout stay) and returned.
    replicator: the `tf_dct` replicator whose replicas it aggregates over.
    compression: a `tf_dct.compression.Compressor` instance of its own (one
      per wrapped optimizer); None means dense SUM, exactly the built-in
      aggregation.

  Returns:
    The same optimizer object, now aggregating through `compression`.
  """
  from tf_dct.compression import Dense  # pylint: disable=g-import-not-at-top
  check_optimizer(optimizer)
  compressor = Dense() if compression is None else compression
  check_compression(compressor, replicator)
  if is_wrapped(optimizer):
    raise ValueError("optimizer is already wrapped by tf_dct.wrap_optimizer")
  from tf_dct.keras import keras3_optimizer, tf_keras_optimizer  # pylint: disable=g-import-not-at-top
  if tf_keras_optimizer.accepts(optimizer):
    mixin = tf_keras_optimizer.AggregateWithCompressor
  elif keras3_optimizer.accepts(optimizer):
    mixin = keras3_optimizer.AggregateWithCompressor
  else:
    raise TypeError(
        "optimizer must be a tf-keras (tf_keras.optimizers.Optimizer, not the "
        "legacy OptimizerV2) or Keras 3 optimizer, got "
        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
  if hasattr(compressor, "config"):  # workers must wrap with like settings
    count = _WRAP_COUNTS.get(replicator, 0) + 1
    _WRAP_COUNTS[replicator] = count
    replicator.agree(f"wrap_optimizer_{count}",
                     {"optimizer": type(optimizer).__name__, **compressor.config()})
  _resolve_momentum(optimizer, compressor)
  _resolve_adam(optimizer, compressor)
  _resolve_adagrad(optimizer, compressor)
  compressor.bind(replicator)
  compressor._tf_dct_wraps = True  # pylint: disable=protected-access
  _swap_class(optimizer, mixin)
  optimizer._tf_dct_compressor = compressor  # tracked: per-replica state is checkpointed
  replicator.add_trace_hook(lambda: phase(optimizer))
  return optimizer
