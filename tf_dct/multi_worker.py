"""MultiWorkerReplicator: synchronous replicas on many machines (Table 1)."""

from __future__ import annotations

import contextlib
import json
import os

import tensorflow as tf

from tf_dct import _private
from tf_dct.replicator import PER_WORKER, ReplicatorMixin, check_positive_int


def validate_tf_config(raw: str | None = None) -> dict | None:
  """Parses TF_CONFIG and checks its shape; returns None when it is unset.

  Raises:
    ValueError: naming TF_CONFIG and what is wrong with it.
  """
  raw = os.environ.get("TF_CONFIG") if raw is None else raw
  if not raw:
    return None
  try:
    config = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f"TF_CONFIG is not valid JSON ({e.msg} at char {e.pos})") from None
  if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
    raise ValueError('TF_CONFIG must be a JSON object with a "cluster" object, '
                     'e.g. {"cluster": {"worker": ["host:port", ...]}, '
                     '"task": {"type": "worker", "index": 0}}')
  cluster = config["cluster"]
  if not cluster.get("worker") and not cluster.get("chief"):
    raise ValueError('TF_CONFIG["cluster"] must list "worker" (or "chief") addresses')
  for job, addresses in cluster.items():
    if (not isinstance(addresses, list) or
        not all(isinstance(a, str) and ":" in a for a in addresses)):
      raise ValueError(f'TF_CONFIG["cluster"]["{job}"] must be a list of '
                       f'"host:port" strings, got {addresses!r}')
  task = config.get("task")
  if not isinstance(task, dict):
    raise ValueError('TF_CONFIG must have a "task" object with "type" and "index"')
  task_type, index = task.get("type"), task.get("index")
  # A side-car evaluator may be absent from the cluster (as TF allows).
  if task_type not in cluster and task_type != "evaluator":
    raise ValueError(f'TF_CONFIG["task"]["type"] must be one of {sorted(cluster)}, '
                     f"got {task_type!r}")
  num_tasks = len(cluster[task_type]) if task_type in cluster else 1
  if (isinstance(index, bool) or not isinstance(index, int) or
      not 0 <= index < num_tasks):
    raise ValueError(f'TF_CONFIG["task"]["index"] must be an int in '
                     f"[0, {num_tasks}), got {index!r}")
  return config


# Errors a collective raises when a peer died, stalled or was unreachable.
_PEER_ERRORS = (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
                tf.errors.AbortedError, tf.errors.CancelledError)


class PeerFailureError(RuntimeError):
  """A collective failed because a peer worker died, stalled or is unreachable.

  Attributes:
    timeout_seconds: the collective timeout in force (None: TensorFlow's).
    original: the TensorFlow error the collective raised.
  """

  def __init__(self, message: str, timeout_seconds, original: Exception):
    super().__init__(message)
    self.timeout_seconds = timeout_seconds
    self.original = original


def is_peer_failure(error: BaseException) -> bool:
  """Whether `error` is how a collective reports a lost or stalled peer."""
  text = str(error)
  return isinstance(error, _PEER_ERRORS) or (
      isinstance(error, tf.errors.OpError) and (
          "Collective ops is aborted" in text or "timed out" in text.lower()))


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0][:300] if text else type(error).__name__


class MultiWorkerReplicator(ReplicatorMixin,
                            tf.distribute.MultiWorkerMirroredStrategy):
  """One replica per local device on every worker; collectives over gRPC.

  The cluster comes from TF_CONFIG (validated first, with a clear error) or a
  `cluster_resolver`. Every worker runs the same program, and must create its
  replicators in the same order: collective keys are derived from that order.

  Peer failures. With `collective_timeout_seconds=T`, every collective
  (all-reduce, all-gather, ...) that does not complete within T seconds fails
  with `DeadlineExceededError`; a peer whose process died usually makes it
  fail sooner (connection refused). `run(step_fn, input_fn)` turns such errors
  into a `PeerFailureError` that says so; wrap other training loops (e.g.
  `model.fit`) in `with replicator.peer_failure_errors():` for the same
  message. Collectives cannot recover in-process: restart every worker (from
  the last checkpoint). T must exceed the longest wait a healthy peer can
  cause, including the first step's tracing on the slowest worker. Without
  a timeout, TensorFlow's health check (every 30 s) aborts collectives once a
  peer stops answering.

  Args:
    cluster_resolver: optional; default reads TF_CONFIG.
    communication_options: `tf.distribute.experimental.CommunicationOptions`.
    num_devices_per_replica: only 1 is supported on this kind.
    input_replication, input_split_fn, jit_compile: as for `Replicator`.
    collective_timeout_seconds: optional timeout T (> 0) of every collective;
      shorthand for `CommunicationOptions(timeout_seconds=T)` (give one or
      the other a timeout, not both).
  """

  def __init__(self, cluster_resolver=None, communication_options=None,
               num_devices_per_replica: int = 1, input_replication=PER_WORKER,
               input_split_fn=None, jit_compile: bool = False,
               collective_timeout_seconds: float | None = None):
    check_positive_int("num_devices_per_replica", num_devices_per_replica)
    if collective_timeout_seconds is not None:
      if (isinstance(collective_timeout_seconds, bool) or
          not isinstance(collective_timeout_seconds, (int, float)) or
          not collective_timeout_seconds > 0):
        raise ValueError("collective_timeout_seconds must be a number > 0 or "
                         f"None, got {collective_timeout_seconds!r}")
      if communication_options is None:
        communication_options = tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=float(collective_timeout_seconds))
      elif communication_options.timeout_seconds is not None:
        raise ValueError(
            "give the collective timeout once: collective_timeout_seconds="
            f"{collective_timeout_seconds} and communication_options."
            f"timeout_seconds={communication_options.timeout_seconds}")
      else:
        communication_options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=communication_options.bytes_per_pack,
            timeout_seconds=float(collective_timeout_seconds),
            implementation=communication_options.implementation)
    self.collective_timeout_seconds = (
        communication_options.timeout_seconds if communication_options else None)
    if num_devices_per_replica != 1:
      raise NotImplementedError(
          "MultiWorkerReplicator supports num_devices_per_replica=1 only "
          f"(got {num_devices_per_replica}); use Replicator for model-parallel "
          "replicas on one machine")
    if cluster_resolver is None:
      validate_tf_config()
    self._init_replicator(None, input_replication, input_split_fn, jit_compile)
    self._tf_dct_key_base = _private.next_collective_key_base()
    _private.set_collective_key_base(self, self._tf_dct_key_base)
    super().__init__(cluster_resolver=cluster_resolver,
                     communication_options=communication_options)
    self._agree("replicator", {
        "replicas_per_worker": len(self.replica_devices),
        "num_replicas": self.num_replicas,
        "num_devices_per_replica": num_devices_per_replica,
        "input_replication": str(input_replication),
        "jit_compile": bool(jit_compile)})

  # Seconds to wait for a peer's configuration (it may still be importing).
  AGREE_TIMEOUT_SECONDS = 120.0

  def _agree(self, topic: str, config: dict) -> None:
    """Compares `config` with every worker's through the coordination service.

    Collectives of workers set up differently (other compressor settings,
    replica counts, XLA) would hang or mix unlike buffers; this fails fast
    instead, on every worker, naming the settings that differ. Keys are
    unique per replicator instance (its collective key base, the same on
    every worker) and topic.
    """
    store = _private.coordination_key_value_store()
    if store is None:
      return
    put, get = store
    base = self._tf_dct_key_base
    mine = json.dumps(config, sort_keys=True, default=str)
    put(f"tf_dct/agree/{base}/{topic}/{self.worker_index}", mine)
    num_workers = self.num_replicas // len(self.replica_devices)
    timeout = self.collective_timeout_seconds or self.AGREE_TIMEOUT_SECONDS
    theirs = {}
    for w in range(num_workers):
      key = f"tf_dct/agree/{base}/{topic}/{w}"
      try:
        theirs[w] = json.loads(get(key, int(timeout * 1000)))
      except tf.errors.DeadlineExceededError as e:
        raise PeerFailureError(
            f"MultiWorkerReplicator (worker {self.worker_index}): worker {w} "
            f"did not report its {topic} settings within {timeout:g} s; is it "
            "running the same program?", timeout, e) from e
      except tf.errors.UnavailableError as e:
        raise PeerFailureError(
            f"MultiWorkerReplicator (worker {self.worker_index}): could not "
            f"read worker {w}'s {topic} settings: the coordination service "
            "(hosted by worker 0) is unreachable; did worker 0 exit or die?",
            timeout, e) from e
    differ = sorted({k for c in theirs.values() for k in set(c) | set(config)
                     if any(c.get(k) != config.get(k) for c in theirs.values())})
    if differ:
      per_worker = "; ".join(
          f"worker {w}: " + ", ".join(f"{k}={c.get(k)!r}" for k in differ)
          for w, c in sorted(theirs.items()))
      raise ValueError(
          f"MultiWorkerReplicator: the workers disagree on {topic} settings "
          f"({', '.join(differ)}): {per_worker}. Every worker must run with "
          "the same settings.")

  @property
  def worker_index(self) -> int:
    return self.first_local_replica_id // len(self.replica_devices)

  @property
  def is_chief(self) -> bool:
    return self.extended.should_checkpoint

  # --- peer failures -----------------------------------------------------------

  def run(self, fn, args=(), kwargs=None, options=None, *, input_fn=None):
    if input_fn is None and not (callable(args) and not isinstance(args, (tuple, list))):
      return super().run(fn, args=args, kwargs=kwargs, options=options)
    with self.peer_failure_errors():
      return super().run(fn, args=args, kwargs=kwargs, options=options,
                         input_fn=input_fn)

  run.__doc__ = ReplicatorMixin.run.__doc__

  @contextlib.contextmanager
  def peer_failure_errors(self):
    """Re-raises a collective's peer-failure error as `PeerFailureError`."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      if not is_peer_failure(e):
        raise
      timeout = self.collective_timeout_seconds
      bound = (f"within collective_timeout_seconds={timeout:g}" if timeout
               else "(no collective_timeout_seconds set; TensorFlow's health "
                    "check aborted it)")
      peers = self.cluster_resolver.cluster_spec().as_dict() if self.cluster_resolver else {}
      raise PeerFailureError(
          f"MultiWorkerReplicator (worker {self.worker_index}): a collective "
          f"did not complete {bound}: a peer worker probably died, stalled or "
          f"is unreachable (cluster: {peers}). Collectives cannot recover in "
          "this process; restart every worker, e.g. from the last checkpoint. "
          f"TensorFlow said: {type(e).__name__}: {_first_line(e)}",
          timeout, e) from e
