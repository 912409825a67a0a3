"""MultiWorkerReplicator: synchronous replicas on many machines (Table 1)."""

from __future__ import annotations

import contextlib
import errno
import json
import numbers
import os
import re
import socket

import tensorflow as tf

from tf_dct import _private
from tf_dct import validation
from tf_dct.distribute.replicator import PER_WORKER, ReplicatorMixin, check_positive_int


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
  seen = {}
  for job, addresses in cluster.items():
    if (not isinstance(addresses, list) or
        not all(isinstance(a, str) and ":" in a for a in addresses)):
      raise ValueError(f'TF_CONFIG["cluster"]["{job}"] must be a list of '
                       f'"host:port" strings, got {addresses!r}')
    for i, address in enumerate(addresses):
      if address in seen:
        raise ValueError(
            f'TF_CONFIG["cluster"] lists "{address}" twice ({seen[address]} '
            f"and {job} {i}); every task needs an address of its own")
      seen[address] = f"{job} {i}"
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
# How gRPC words a lost connection (the peer's process is gone).
_CONNECTION_TEXT = ("connection reset", "connection refused", "socket closed",
                    "failed to connect", "connection closed", "broken pipe")


def peer_failure_reason(error: BaseException) -> str | None:
  """Why a collective failed, if `error` is how it reports a lost peer.

  Returns:
    "timeout" (a deadline passed: `DeadlineExceededError`, or a message
    saying it timed out), "connection" (`UnavailableError`, or a connection
    reset, refused or closed: the peer probably died), "aborted" (aborted or
    cancelled, e.g. by TF's health check or after an earlier collective
    failed), or None when `error` is not a peer failure.
  """
  if not isinstance(error, tf.errors.OpError):
    return None
  text = str(error).lower()
  if not (isinstance(error, _PEER_ERRORS) or "collective ops is aborted" in text
          or "timed out" in text):
    return None
  if isinstance(error, tf.errors.DeadlineExceededError):
    return "timeout"
  if (isinstance(error, tf.errors.UnavailableError) or
      any(t in text for t in _CONNECTION_TEXT)):
    return "connection"
  if "timed out" in text or "deadline exceeded" in text:
    return "timeout"
  return "aborted"


def is_peer_failure(error: BaseException) -> bool:
  """Whether `error` is how a collective reports a lost or stalled peer."""
  return peer_failure_reason(error) is not None


class PeerFailureError(RuntimeError):
  """A peer died, stalled or is unreachable: a collective or start-up failed.

  Attributes:
    timeout_seconds: the timeout in force (None: TensorFlow's).
    original: the TensorFlow error the collective raised.
    reason: "timeout", "connection" or "aborted" (`peer_failure_reason` of
      `original`).
  """

  def __init__(self, message: str, timeout_seconds, original: Exception):
    super().__init__(message)
    self.timeout_seconds = timeout_seconds
    self.original = original
    self.reason = peer_failure_reason(original)


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0][:300] if text else type(error).__name__


def _said(error: BaseException) -> str:
  return f"TensorFlow said: {type(error).__name__}: {_first_line(error)}"


def collective_failure(error: BaseException, timeout_seconds, worker_index: int,
                       cluster: dict) -> PeerFailureError | None:
  """`error` of a collective as a `PeerFailureError` saying what happened.

  Returns None when `error` is not a peer failure (`peer_failure_reason`).
  The message says whether the collective timed out, lost its connection
  or was aborted, names `cluster` and ends with TF's error (type, first
  line).
  """
  reason = peer_failure_reason(error)
  if reason is None:
    return None
  if reason == "connection":
    what = ("lost the connection to a peer (connection reset/refused): the "
            "peer probably died")
  elif reason == "timeout":
    bound = (f"within collective_timeout_seconds={timeout_seconds:g}"
             if timeout_seconds else "within TensorFlow's own deadline")
    what = (f"did not complete {bound}: a peer worker probably died, stalled "
            "or is unreachable")
  else:
    what = ("was aborted (by TensorFlow's health check, or because an earlier "
            "collective failed): a peer worker probably died or stalled")
  return PeerFailureError(
      f"MultiWorkerReplicator (worker {worker_index}): a collective {what} "
      f"(cluster: {cluster}). Collectives cannot recover in this process; "
      "restart every worker, e.g. from the last checkpoint. " + _said(error),
      timeout_seconds, error)


def _check_timeout(name: str, value) -> float | None:
  """`value` as a float if it is a finite number > 0; None stays None."""
  if value is None:
    return None
  try:
    return float(validation.check_number("MultiWorkerReplicator", name, value,
                                         numbers.Real, 0, True))
  except ValueError as e:
    raise ValueError(f"{e} (or None: no timeout)") from None


_TASK_NAME = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def _task_address(cluster_spec, job: str, index: int) -> str | None:
  try:
    return cluster_spec.task_address(job, index)
  except ValueError:
    return None


def _check_port_free(cluster_spec, task_type: str, task_id: int) -> None:
  """Raises if another process listens on this task's port.

  gRPC servers share ports (SO_REUSEPORT): a TF server of another run on
  this task's port would not make ours fail, but take some of its
  connections, and start-up would hang. Probed where TF binds, 0.0.0.0.
  """
  address = _task_address(cluster_spec, task_type, task_id)
  port = address.rsplit(":", 1)[-1] if address else ""
  if not port.isdigit() or int(port) == 0:
    return
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      probe.bind(("0.0.0.0", int(port)))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        return  # e.g. no IPv4: left to TF
      raise RuntimeError(
          f"MultiWorkerReplicator ({task_type} {task_id}): port {port} of this "
          f"task's address {address} is already in use by another process. "
          "Is a worker of an earlier run still running, or was another task "
          "given the same address? Stop it, or give this task a free port.") from None


def _startup_failure(error, cluster_spec, task_type, task_id, leader: str,
                     timeout: float) -> PeerFailureError:
  """The error for a cluster that did not start within `timeout`.

  The coordination service's barrier error names the tasks that did not
  register ("timed out task names: /job:worker/replica:0/task:1"); a task
  whose registration got no answer at all waited for the service's leader.
  """
  text = str(error)
  marker = text.find("timed out task names:")
  stragglers = set()
  if marker >= 0:
    stragglers = {(job, int(i)) for job, i in _TASK_NAME.findall(
        text[marker:].split("\n\n")[0])}
  me = (task_type, task_id)
  stragglers.discard(me)
  if not stragglers:
    match = _TASK_NAME.search(leader)
    stragglers = {(match[1], int(match[2]))} if match else set()
    stragglers.discard(me)
  if not stragglers:  # not found: any other coordinated task
    stragglers = {(job, i) for job in ("chief", "worker") if job in cluster_spec.jobs
                  for i in cluster_spec.task_indices(job)} - {me}
  peers = ", ".join(f"{job} {i} ({_task_address(cluster_spec, job, i)})"
                    for job, i in sorted(stragglers))
  return PeerFailureError(
      f"MultiWorkerReplicator ({task_type} {task_id}, "
      f"{_task_address(cluster_spec, task_type, task_id)}): the cluster did "
      f"not start within startup_timeout_seconds={timeout:g}: no answer from "
      f"{peers}. Check that every worker was started with the same TF_CONFIG "
      "cluster (and its own task index), that the workers reach each other at "
      "these addresses, and that their ports are free. " + _said(error),
      timeout, error)


class MultiWorkerReplicator(ReplicatorMixin,
                            tf.distribute.MultiWorkerMirroredStrategy):
  """One replica per local device on every worker; collectives over gRPC.

  The cluster comes from TF_CONFIG (validated first, with a clear error) or a
  `cluster_resolver`. Every worker runs the same program, and must create its
  replicators in the same order: collective keys are derived from that order.

  Start-up. The first replicator of a process starts this task's gRPC server
  and registers with TensorFlow's coordination service (hosted by the chief,
  else worker 0), which waits for every worker. So that a worker that never
  starts, or an unreachable one, fails the others instead of hanging them,
  registration is bounded by `startup_timeout_seconds`: then the constructor
  raises a `PeerFailureError` naming the tasks (host:port) that did not
  answer. Before that it checks that no other process listens on this
  task's port (a worker of an earlier run would otherwise take some of its
  connections).

  Peer failures. With `collective_timeout_seconds=T`, every collective
  (all-reduce, all-gather, ...) that does not complete within T seconds fails
  with `DeadlineExceededError`; a peer whose process died may make it fail
  sooner (connection reset or refused). `run(step_fn, input_fn)` turns such
  errors into a `PeerFailureError` that says which it was (its `reason`);
  wrap other training loops (e.g. `model.fit`) in
  `with replicator.peer_failure_errors():` for the same message. Collectives
  cannot recover in-process: restart every worker (from the last
  checkpoint). T must exceed the longest wait a healthy peer can cause,
  including the first step's tracing on the slowest worker. Without a
  timeout, TensorFlow's health check aborts collectives once a peer stops
  answering.

  Args:
    cluster_resolver: optional; default reads TF_CONFIG.
    communication_options: `tf.distribute.experimental.CommunicationOptions`.
    num_devices_per_replica: only 1 is supported on this kind.
    input_replication, input_split_fn, jit_compile: as for `Replicator`.
    collective_timeout_seconds: optional timeout T (> 0) of every collective;
      shorthand for `CommunicationOptions(timeout_seconds=T)` (give one or
      the other a timeout, not both).
    startup_timeout_seconds: how long (> 0) start-up waits for every worker
      to register; None waits for ever. Raise it where workers start far
      apart (e.g. queued by a scheduler).
  """

  # Default start-up bound: peers may still be importing or being scheduled.
  STARTUP_TIMEOUT_SECONDS = 120.0

  def __init__(self, cluster_resolver=None, communication_options=None,
               num_devices_per_replica: int = 1, input_replication=PER_WORKER,
               input_split_fn=None, jit_compile: bool = False,
               collective_timeout_seconds: float | None = None,
               startup_timeout_seconds: float | None = STARTUP_TIMEOUT_SECONDS):
    check_positive_int("num_devices_per_replica", num_devices_per_replica)
    collective_timeout_seconds = _check_timeout("collective_timeout_seconds",
                                                collective_timeout_seconds)
    startup_timeout_seconds = _check_timeout("startup_timeout_seconds",
                                             startup_timeout_seconds)
    if collective_timeout_seconds is not None:
      if communication_options is None:
        communication_options = tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=collective_timeout_seconds)
      elif communication_options.timeout_seconds is not None:
        raise ValueError(
            "give the collective timeout once: collective_timeout_seconds="
            f"{collective_timeout_seconds:g} and communication_options."
            f"timeout_seconds={communication_options.timeout_seconds}")
      else:
        communication_options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=communication_options.bytes_per_pack,
            timeout_seconds=collective_timeout_seconds,
            implementation=communication_options.implementation)
    self.collective_timeout_seconds = (
        communication_options.timeout_seconds if communication_options else None)
    self.startup_timeout_seconds = startup_timeout_seconds
    if num_devices_per_replica != 1:
      raise NotImplementedError(
          "MultiWorkerReplicator supports num_devices_per_replica=1 only "
          f"(got {num_devices_per_replica}); use Replicator for model-parallel "
          "replicas on one machine")
    if cluster_resolver is None:
      validate_tf_config()
      cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = cluster_resolver.cluster_spec()
    task = (cluster_resolver.task_type, cluster_resolver.task_id)
    leader = None
    # The first multi-worker strategy of a process starts its server.
    if spec.as_dict() and not _private.coordination_service_configured():
      _check_port_free(spec, *task)
      if startup_timeout_seconds is not None:
        leader = _private.configure_bounded_coordination_service(
            spec, task[0], startup_timeout_seconds)
    self._init_replicator(None, input_replication, input_split_fn, jit_compile)
    self._tf_dct_key_base = _private.next_collective_key_base()
    _private.set_collective_key_base(self, self._tf_dct_key_base)
    try:
      super().__init__(cluster_resolver=cluster_resolver,
                       communication_options=communication_options)
    except tf.errors.OpError as e:
      if leader is None or not is_peer_failure(e):
        raise
      raise _startup_failure(e, spec, *task, leader,
                             startup_timeout_seconds) from e
    self.agree("replicator", {
        "replicas_per_worker": len(self.replica_devices),
        "num_replicas": self.num_replicas,
        "num_devices_per_replica": num_devices_per_replica,
        "input_replication": str(input_replication),
        "jit_compile": bool(jit_compile)})

  # Seconds to wait for a peer's configuration (it may still be importing).
  AGREE_TIMEOUT_SECONDS = 120.0

  def agree(self, topic: str, config: dict) -> None:
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
    # Compare what was sent, not `config`: JSON turns tuples into lists.
    config = json.loads(mine)
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

  def reduce(self, reduce_op, value, axis):
    """`tf.distribute.Strategy.reduce` of one per-replica value.

    TensorFlow's `MultiWorkerMirroredStrategy` cannot reduce a nested
    structure of per-replica values; such a call raises a
    `NotImplementedError` that says so, and what to use instead, since
    Keras 3's `fit`, `evaluate` and `predict` make exactly this call.
    """
    flat = tf.nest.flatten(value)
    if (len(flat) > 1 or (flat and flat[0] is not value)) and any(
        isinstance(v, tf.distribute.DistributedValues) for v in flat):
      raise NotImplementedError(
          "MultiWorkerReplicator.reduce: value is a nested structure of "
          "per-replica values, which TensorFlow's MultiWorkerMirroredStrategy "
          "cannot reduce; reduce each value on its own. Keras 3's model.fit, "
          "evaluate and predict make this call: they do not support "
          "MultiWorkerMirroredStrategy (upstream keras#20585). Train with a "
          "custom loop (repl.run(step_fn, input_fn)), which works with Keras "
          "3, or with tf-keras model.fit (TF_USE_LEGACY_KERAS=1 before "
          "TensorFlow is imported)")
    return super().reduce(reduce_op, value, axis)

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
      resolver = self.cluster_resolver
      failure = collective_failure(
          e, self.collective_timeout_seconds, self.worker_index,
          resolver.cluster_spec().as_dict() if resolver else {})
      if failure is None:
        raise
      raise failure from e
