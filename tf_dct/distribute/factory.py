"""`create_replicator`: pick a replicator kind by name, like the paper's Table 1."""

from __future__ import annotations

import tensorflow as tf

from tf_dct.distribute.async_replicator import AsyncReplicator
from tf_dct.distribute.multi_worker import MultiWorkerReplicator, validate_tf_config
from tf_dct.distribute.replicator import Replicator, check_positive_int
from tf_dct.distribute.tpu import TpuReplicator

KINDS = ("auto", "cpu", "gpu", "multi_worker", "async", "tpu")


def split_cpu(num_devices: int) -> list[str]:
  """Splits the physical CPU into `num_devices` logical devices.

  Must run before TensorFlow initializes its devices (before any op). If it
  already did, the existing split is accepted only when it has exactly
  `num_devices` CPUs.
  """
  check_positive_int("num_devices", num_devices)
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
  except RuntimeError:
    have = len(tf.config.list_logical_devices("CPU"))
    if have != num_devices:
      raise RuntimeError(
          f"need {num_devices} logical CPU devices but TensorFlow is already "
          f"initialized with {have}; call create_replicator (or "
          "tf_dct.split_cpu) before any TensorFlow op runs, or ask for "
          f"{have} devices") from None
  return [d.name for d in tf.config.list_logical_devices("CPU")]


def create_replicator(kind: str = "auto", num_replicas: int | None = None,
                      num_devices_per_replica: int = 1, tpu: str | None = None,
                      **kwargs):
  """Builds a replicator.

  Args:
    kind: "cpu" (logical CPU devices), "gpu" (local GPUs), "multi_worker"
      (TF_CONFIG cluster, synchronous), "async" (TF_CONFIG cluster with
      parameter servers; run in the chief), "tpu", or "auto": tpu if `tpu` is
      given, else multi_worker if TF_CONFIG is set, else gpu if any GPU, else
      cpu.
    num_replicas: replicas on this machine (cpu: default 1; gpu: default all
      GPUs / num_devices_per_replica). Not used by multi_worker and tpu, which
      take every device they are given.
    num_devices_per_replica: devices per model-parallel replica.
    tpu: TPU name or "local", for kind="tpu".
    **kwargs: passed to the replicator (input_replication, input_split_fn, ...).
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  if num_replicas is not None:
    check_positive_int("num_replicas", num_replicas)
  check_positive_int("num_devices_per_replica", num_devices_per_replica)
  if kind == "auto":
    if tpu is not None:
      kind = "tpu"
    elif validate_tf_config() is not None:
      kind = "multi_worker"
    elif tf.config.list_physical_devices("GPU"):
      kind = "gpu"
    else:
      kind = "cpu"
  if kind == "cpu":
    n = (num_replicas or 1) * num_devices_per_replica
    return Replicator(split_cpu(n), num_devices_per_replica, **kwargs)
  if kind == "gpu":
    # Physical devices first: listing them leaves TensorFlow uninitialized, so
    # the advice below (kind='cpu', which splits the CPU) still works.
    if not tf.config.list_physical_devices("GPU"):
      raise RuntimeError("kind='gpu' but TensorFlow sees no GPU; use kind='cpu' "
                         "(in this process too: nothing was initialized)")
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    n = (num_replicas or len(gpus) // num_devices_per_replica) * num_devices_per_replica
    if n == 0 or n > len(gpus):
      raise ValueError(f"num_replicas={num_replicas} x num_devices_per_replica="
                       f"{num_devices_per_replica} needs {n} GPUs, have {len(gpus)}")
    return Replicator(gpus[:n], num_devices_per_replica, **kwargs)
  if num_replicas is not None:
    raise ValueError(f"num_replicas is not used by kind={kind!r} (it takes every "
                     "device of the cluster); leave it None")
  if kind == "multi_worker":
    return MultiWorkerReplicator(num_devices_per_replica=num_devices_per_replica,
                                 **kwargs)
  if kind == "async":
    if num_devices_per_replica != 1:
      raise ValueError("kind='async' supports num_devices_per_replica=1 only, "
                       f"got {num_devices_per_replica}")
    return AsyncReplicator(**kwargs)
  return TpuReplicator(tpu=tpu or "local",
                       num_devices_per_replica=num_devices_per_replica, **kwargs)
