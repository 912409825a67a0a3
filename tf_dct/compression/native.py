"""Native CPU kernels for the compressors' hot loops, built on first use.

DCT-DP with stock TensorFlow ops passes over every entry of a variable about
a dozen times per step (add, abs, two compares, a prefix count, a compaction,
a select, the finite check), each pass an op with its own dispatch, and runs
a few dozen more small ops per variable for its threshold schedule. `select`
does DCT Algorithm 1 lines 2-11 of all of a replica's variables in one op
(the finite check, the schedule's refreshes in O(n), the density guard, the
mask, the compaction and the new residuals). For line 12, `encode` lays a
replica's packed vectors into one all-gather payload and `gather_sum` turns
the gathered payloads into the dense sums with their non-zero counts, which
the accounting needs, instead of a dozen stock ops per vector
(kernels/sparse_kernels.cc). bfloat16 value words of float32 variables
(`sparse_wire.round_values`) are rounded by `select` and packed and widened
by the wire kernels. Results are bit-identical to the stock ops.

No wheel ships it: the source is compiled the first time it is needed, with
the C++ compiler of the machine (`$CXX`, else `g++`) and the flags of the
installed TensorFlow (`tf.sysconfig`), for the machine's own CPU on x86
(`-march=native`), into a cache directory (`$TF_DCT_CACHE`, else
`~/.cache/tf_dct`), keyed by the source, the TensorFlow version, the flags
and the CPU's instruction-set flags. That takes about 10 s once per machine.
Without a compiler, or when the build fails, `library()` logs one warning
and returns None and the callers use stock ops, as they do on GPU, TPU and
under XLA (only CPU kernels exist); `TF_DCT_NATIVE=0` turns them off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

from absl import logging
import tensorflow as tf

from tf_dct import _private

ENV_SWITCH = "TF_DCT_NATIVE"   # "0": never build or use the native kernels
ENV_CACHE = "TF_DCT_CACHE"     # where the built library is kept
_SOURCE = os.path.join(os.path.dirname(__file__), "kernels",
                       "sparse_kernels.cc")
_BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_loaded = {}  # "lib" -> the loaded module, or None after a failed build


def switched_off() -> bool:
  """Whether `TF_DCT_NATIVE=0` (or "false", "no", "off") is set."""
  return os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no",
                                                            "off")


def _x86() -> bool:
  return platform.machine().lower() in ("x86_64", "amd64")


def _cpu_features() -> str:
  """The instruction-set flags of this CPU (Linux), else "".

  The library is built for the machine's own x86 CPU (`-march=native`), so
  the cache keeps one build per instruction set: a cache directory shared
  by different machines never hands one a build it cannot run.
  """
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("flags"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def _flags() -> list[str]:
  return (["-std=c++17", "-shared", "-fPIC",
           # -O3 vectorizes the accumulate pass (exact: no fast-math).
           "-O3",
           # Keep a + b a separate rounding, as TensorFlow's add kernel does
           # (this also keeps -march=native from fusing into FMA).
           "-ffp-contract=off", "-Wno-deprecated-declarations"]
          # The machine's widest vectors: the one-pass select took 0.40
          # instead of 0.47 ms per call on the benchmark's DLRM with AVX-512.
          + (["-march=native"] if _x86() else [])
          # TensorFlow's Eigen headers do not compile with AVX512-FP16
          # enabled (g++ 12: "expected initializer before '<'" in
          # PacketMathFP16.h); the kernels use no float16 (bfloat16 only).
          + (["-mno-avx512fp16"] if _x86() and "avx512_fp16" in
             _cpu_features().split() else [])
          + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags())


def library_path() -> str:
  """Where the library for this source, TensorFlow and flags is cached."""
  key = hashlib.sha256()
  with open(_SOURCE, "rb") as f:
    key.update(f.read())
  key.update(tf.__version__.encode())
  key.update(" ".join(_flags()).encode())
  key.update(platform.machine().encode())
  if _x86():
    key.update(_cpu_features().encode())
  cache = os.environ.get(ENV_CACHE) or os.path.join(
      os.path.expanduser("~"), ".cache", "tf_dct")
  return os.path.join(cache, f"sparse_kernels-{key.hexdigest()[:16]}.so")


def build(path: str) -> None:
  """Compiles the kernels into `path` (atomically: a temp file, then rename).

  Raises:
    RuntimeError: no compiler, or the compiler failed (its output included).
  """
  compiler = shutil.which(os.environ.get("CXX", "g++"))
  if compiler is None:
    raise RuntimeError(f"no C++ compiler found (looked for "
                       f"{os.environ.get('CXX', 'g++')!r}; set $CXX)")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
  os.close(fd)
  try:
    done = subprocess.run([compiler, _SOURCE, "-o", tmp] + _flags(),
                          capture_output=True, text=True,
                          timeout=_BUILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
      raise RuntimeError(f"{compiler} failed ({done.returncode}):\n"
                         f"{done.stderr[-4000:]}")
    os.replace(tmp, path)  # concurrent builders: the last complete one wins
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def library():
  """The loaded native op library, or None (switched off, or no build).

  Builds it on the first call when the cache has none. A failure is logged
  once and remembered for the process.
  """
  if switched_off():
    return None
  with _lock:
    if "lib" not in _loaded:
      _loaded["lib"] = None
      try:
        path = library_path()
        if not os.path.exists(path):
          logging.info("tf_dct: building native kernels into %s", path)
          build(path)
        _loaded["lib"] = tf.load_op_library(path)
      except (OSError, RuntimeError, subprocess.SubprocessError,
              tf.errors.OpError) as e:
        logging.warning("tf_dct: native kernels unavailable, using stock "
                        "TensorFlow ops (slower on CPU): %s", e)
    return _loaded["lib"]


def available() -> bool:
  """Whether the kernels can run (builds the library if needed)."""
  return library() is not None


def usable(dtype: tf.DType, device: str | None) -> bool:
  """Whether ops of `dtype` placed on `device` can use the kernels now.

  float32/float64 (and bfloat16, the value words of `encode` and
  `gather_sum`) on a CPU (or an unplaced op), outside XLA, with the library
  available (built here if needed).
  """
  if dtype not in (tf.float32, tf.float64, tf.bfloat16):
    return False
  if tf.DeviceSpec.from_string(device or "").device_type not in (None, "CPU"):
    return False
  return not _private.in_xla_context() and available()


def _lib():
  lib = library()
  if lib is None:
    raise RuntimeError("tf_dct native kernels are unavailable (see the "
                       "warning logged by tf_dct.compression.native.library)")
  return lib


# Modes of `select`, per variable.
GUARDED, REFRESH, FIXED = 0, 1, 2


def select(grads, residuals, taus: tf.Tensor, modes: tf.Tensor,
           capacities, below, lowest, highest, messages, value_dtype=None):
  """DCT Algorithm 1 lines 2-11 of several variables in one CPU op.

  Per variable v, with acc = grads[v] + residuals[v] (line 2), n entries:
  by `modes[v]`, REFRESH takes tau = w_m (the m-th smallest magnitude of acc,
  0-based, m = below[v]; 0 when m = 0; lines 4-5, the value
  `dct_dp.order_statistic_threshold` finds with `top_k`, in O(n)); FIXED
  keeps taus[v] (line 7); GUARDED keeps taus[v] unless it selects fewer than
  lowest[v] or more than highest[v] entries, and then refreshes as REFRESH
  does (the density guard of `DCTDP`). The mask |acc| >= tau, acc != 0
  (line 9) is packed into capacities[v] slots in position order (line 10)
  and the packed entries leave the residual (line 11).

  Args:
    grads: rank-1 float32/float64 gradients, n_v < 2^31 - 1 entries each.
    residuals: per variable its n_v residual entries, or a scalar added to
      every entry (0 when the gradient is the accumulator already).
    taus: [V] thresholds of the last step.
    modes: int32[V] of GUARDED, REFRESH, FIXED.
    capacities, below, lowest, highest: per variable, Python ints: wire
      slots (>= 1), m (0 <= m < n_v), the guard's band on the selected count.
    messages: per variable, the error when an entry of its gradient is not
      finite (InvalidArgumentError, as `tf.debugging.check_numerics` raises).
    value_dtype: the dtype of the packed values, None or the gradients'
      dtype, or tf.bfloat16 for float32 gradients: each packed value is
      rounded and what rounding took off stays in the new residual, bit for
      bit `sparse_wire.round_values`.

  Returns:
    `(idx, val, new_residuals, new_taus, selected, early, seconds)`: per
    variable int32[capacity] positions (padding n) and values (padding 0),
    exactly what `sparse_wire.compact` gives, and acc with the packed
    entries zeroed; then [V] taus used, int32[V] entries selected before the
    capacity cut, bool[V] whether the guard refreshed; and the op's own run
    time (float64 seconds), the selection time without `tf.timestamp` ops
    (which TensorFlow would run in program order, one replica's selection
    after another's).

  Raises:
    RuntimeError: the native library is unavailable (see `library`).
  """
  grads = list(grads)
  value_dtype = tf.as_dtype(value_dtype or grads[0].dtype)
  if value_dtype not in (grads[0].dtype, tf.bfloat16) or (
      value_dtype == tf.bfloat16 and grads[0].dtype != tf.float32):
    raise ValueError(f"select: value_dtype must be None, the gradients' dtype "
                     f"or bfloat16 (float32 gradients only), got "
                     f"{value_dtype.name} for {grads[0].dtype.name}")
  return _lib().tf_dct_select(
      grads, list(residuals), taus, modes, V=value_dtype,
      capacities=list(capacities), below=list(below), lowest=list(lowest),
      highest=list(highest), messages=list(messages))


def _layouts(encodings):
  """The per-vector attributes of the wire kernels, from `sparse_wire`
  encodings (anything with name, n, chunk, count_bytes, offset_bytes and
  low_bits); low_bits is -1 for every layout but "ef"."""
  return dict(ns=[e.n for e in encodings], chunks=[e.chunk for e in encodings],
              count_bytes=[e.count_bytes for e in encodings],
              offset_bytes=[e.offset_bytes for e in encodings],
              low_bits=[e.low_bits if e.name == "ef" else -1
                        for e in encodings])


def encode(idxs, vals, encodings, exact: bool = False) -> tf.Tensor:
  """One replica's packed vectors as one int32 all-gather payload.

  Args:
    idxs: per vector int32[capacity] positions, padding n; non-decreasing
      with the padding last for a chunked encoding (else
      InvalidArgumentError).
    vals: per vector [capacity] values, all float32, all float64 or all
      bfloat16 (two to a word, `sparse_wire._pack_halves`).
    encodings: per vector its `sparse_wire.Encoding`.
    exact: lay each "ef" vector out for its used slots (the exact-size
      exchange, `sparse_wire._EliasFanoExact`) instead of its capacity.

  Returns:
    int32[sum of words + sum of value_bytes(capacity) / 4]: every vector's
    index words (`sparse_wire.encode_indices`, bit for bit, or with `exact`
    `sparse_wire._EliasFanoExact.encode`), then every vector's values.

  Raises:
    RuntimeError: the native library is unavailable (see `library`).
  """
  return _lib().tf_dct_encode(list(idxs), list(vals), exact=exact,
                              **_layouts(encodings))


def gather_sum(payload: tf.Tensor, encodings, dtype, counts=None):
  """Sums every replica's vectors from the gathered `encode` payloads.

  Args:
    payload: int32[replicas, length], one `encode` output per replica.
    encodings: per vector its `sparse_wire.Encoding` (as given to `encode`).
    dtype: tf.float32, tf.float64 or tf.bfloat16, the values' dtype on the
      wire (bfloat16 is widened to float32 and summed in float32).
    counts: None for payloads of `encode` at capacity; for those of
      `encode(..., exact=True)` int32[replicas, vectors], each row's used
      slots per vector (each in [0, capacity], else InvalidArgumentError),
      which give the layout of its "ef" vectors.

  Returns:
    `(sums, nnz)`: per vector the dense [n] sum (float32 for bfloat16
    values), bit for bit
    `sparse_wire.scatter_sum` of the decoded positions and values over the
    replicas in order (each position sums in slot order from +0); and
    int64[vectors] non-zero entries of each sum.

  Raises:
    RuntimeError: the native library is unavailable (see `library`).
  """
  encodings = list(encodings)
  exact = counts is not None
  if not exact:
    counts = tf.zeros([0, len(encodings)], tf.int32)
  sums, nnz = _lib().tf_dct_gather_sum(
      payload, counts, T=tf.float32 if dtype == tf.bfloat16 else dtype,
      V=dtype, N=len(encodings), exact=exact,
      capacities=[e.capacity for e in encodings], **_layouts(encodings))
  return list(sums), nnz
