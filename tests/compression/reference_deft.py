"""Plain numpy/Python reference of DEFT (DEFT Algorithms 1-5).

Written from the algorithms with the conventions documented in
tf_dct/compression/deft.py, sharing no code with it: integer size test for
the split, max(1, floor(n_g * d)) budget on the decimal density, norms summed
over replicas, visit by decreasing norm (ties: lower index), suffix sums of the
norms accumulated one by one in float32, k = min(size, max(1, floor(k_remain
* (norm / rest)))), integer Mitchell-log2 costs with a floor of one octave,
greedy packing (ties: lower index, lower bin), replica r taking bin
(step % n + r) % n, stable top-k (ties: lower position), union-wide exchange.
Under momentum correction (DGC §3.2) the accumulator is each replica's
velocity plus its residual, and factor masking zeroes the velocity at the
union every replica sent.
"""

from __future__ import annotations

import dataclasses
from decimal import Decimal
import math

import numpy as np


def partition(sizes, n):
  """[(variable, start, size)] of the two-stage partition."""
  total, start, out = sum(sizes), 0, []
  for v, size in enumerate(sizes):
    if size > total / n:
      pieces = [size // n + (1 if i < size % n else 0) for i in range(n)]
    else:
      pieces = [size]
    for piece in pieces:
      if piece > 0:
        out.append((v, start, piece))
      start += piece
  return out


def total_k(n_g, density):
  return max(1, math.floor(Decimal(repr(float(density))) * n_g))


def local_k(norms, sizes, k_total, min_count=1):
  """Algorithm 3 on float32 norms, each partition taking at least
  min(size, max(1, min_count)); returns a list of ints."""
  norms = np.asarray(norms, np.float32)
  order = sorted(range(len(sizes)), key=lambda x: (-norms[x], x))
  rest = [np.float32(0)] * len(order)
  running = np.float32(0)
  for j in reversed(range(len(order))):
    running = np.float32(running + norms[order[j]])
    rest[j] = running
  k = [0] * len(sizes)
  k_remain = k_total
  for j, x in enumerate(order):
    ratio = np.float32(norms[x] / rest[j]) if rest[j] > 0 else np.float32(0)
    k_temp = np.float32(np.float32(k_remain) * ratio)
    k[x] = min(sizes[x], max(1, min_count, int(math.floor(k_temp))))
    k_remain -= k[x]
  return k


def size_k(sizes, k_total, min_count=1):
  """The "size" budget: min(size, max(1, min_count, floor(k_total * size /
  n_g))) per partition, exact integers."""
  n_g = sum(sizes)
  return [min(s, max(1, min_count, (k_total * s) // n_g)) for s in sizes]


def mitchell_log2(k):
  """Fixed point (2^23 per octave) Mitchell log2 of the float32 of k."""
  return int(np.array(k, np.float32).view(np.int32)) - (127 << 23)


def pack(k, sizes, n):
  """Algorithm 4 greedy: list of bins."""
  cost = [s * max(mitchell_log2(kx), 1 << 23) for s, kx in zip(sizes, k)]
  loads = [0] * n
  bins = [0] * len(sizes)
  for x in sorted(range(len(sizes)), key=lambda x: (-cost[x], x)):
    b = loads.index(min(loads))
    bins[x] = b
    loads[b] += cost[x]
  return bins


def owners(bins, step, n):
  return [(b - step % n) % n for b in bins]


@dataclasses.dataclass
class ReferenceStep:
  parts: list          # [(variable, start, size)]
  k: list              # per partition
  bins: list           # per partition
  owners: list         # per partition
  selected: list       # per replica: sorted global positions it chose
  union: np.ndarray    # bool[n_g]
  update: list         # per variable: sum over replicas (float64)
  residuals: list      # residuals[r][v] after this step
  sent: list           # per variable: union entries (or size when dense)
  selected_count: list  # selected_count[r][v]
  velocities: list = None  # velocities[r][v] kept after this step (momentum)


def deft_reference(grads, density, min_size=0, warmup_steps=0, min_count=1,
                   budget="size", residual_decay=1.0, momentum=None,
                   momentum_masking=False):
  """Runs DEFT on grads[t][r][v] (numpy arrays, one float dtype).

  Variables below `min_size` are summed densely; `budget` as DEFT's ("size"
  or "norm", Algorithm 3); every residual is multiplied by `residual_decay`
  after a step. With `momentum`, each replica compresses u + E with its
  velocity u = momentum * u + g (the dense variables' gradients are summed
  as they are: the optimizer keeps their momentum); `momentum_masking`
  zeroes u wherever the union sent. Returns one ReferenceStep per step.
  """
  first = grads[0][0]
  replicas = len(grads[0])
  shapes = [np.shape(g) for g in first]
  dtype = np.asarray(first[0]).dtype
  comp = [v for v, s in enumerate(shapes)
          if 0 < int(np.prod(s)) and int(np.prod(s)) >= min_size]
  sizes = [int(np.prod(shapes[v])) for v in comp]
  n_g = sum(sizes)
  parts = partition(sizes, replicas)
  p_sizes = [p[2] for p in parts]
  k_total = total_k(n_g, density)
  residual = [np.zeros(n_g, dtype) for _ in range(replicas)]
  velocity = [np.zeros(n_g, dtype) for _ in range(replicas)]
  out = []
  for t, step_grads in enumerate(grads):
    flat = [np.concatenate([np.asarray(step_grads[r][v], dtype).reshape(-1)
                            for v in comp]) for r in range(replicas)]
    if momentum:                                           # u = m u + g
      velocity = [dtype.type(momentum) * velocity[r] + flat[r]
                  for r in range(replicas)]
      flat = velocity
    acc = [flat[r] + residual[r] for r in range(replicas)]
    norms = np.zeros(len(parts), np.float32)
    for r in range(replicas):
      for x, (_, start, size) in enumerate(parts):
        piece = acc[r][start:start + size].astype(np.float32)
        norms[x] = np.float32(norms[x] + np.sqrt(np.sum(np.square(piece))))
    if budget == "norm":
      k = local_k(norms, p_sizes, k_total, min_count)
    else:
      k = size_k(p_sizes, k_total, min_count)
    bins = pack(k, p_sizes, replicas)
    own = owners(bins, t, replicas)
    warm = t < warmup_steps
    union = np.zeros(n_g, bool)
    chosen = [[] for _ in range(replicas)]
    counts = [[0] * len(comp) for _ in range(replicas)]
    if warm:
      union[:] = True
    else:
      for x, (v, start, size) in enumerate(parts):
        r = own[x]
        mag = np.abs(acc[r][start:start + size])
        top = np.argsort(-mag, kind="stable")[:k[x]]
        chosen[r].extend(int(i) + start for i in top)
        counts[r][v] += k[x]
      for r in range(replicas):
        union[chosen[r]] = True
    total = np.zeros(n_g, np.float64)
    for r in range(replicas):
      total += np.where(union, acc[r], 0)
      residual[r] = np.where(union, np.zeros_like(acc[r]), acc[r])
      if residual_decay != 1:                              # what stays fades
        residual[r] = residual[r] * dtype.type(residual_decay)
      if momentum and momentum_masking:                    # factor masking
        velocity[r] = np.where(union, np.zeros_like(velocity[r]), velocity[r])
    update, residuals = [None] * len(shapes), []
    bounds = np.cumsum([0] + sizes)
    for i, v in enumerate(comp):
      update[v] = total[bounds[i]:bounds[i + 1]].reshape(shapes[v])
    for v in range(len(shapes)):
      if v not in comp:
        update[v] = sum(np.asarray(step_grads[r][v], np.float64)
                        for r in range(replicas))
    for r in range(replicas):
      residuals.append([residual[r][bounds[i]:bounds[i + 1]].reshape(shapes[v])
                        for i, v in enumerate(comp)])
    sent = [int(union[bounds[i]:bounds[i + 1]].sum()) for i in range(len(comp))]
    velocities = None
    if momentum:
      velocities = [[velocity[r][bounds[i]:bounds[i + 1]].reshape(shapes[v])
                     for i, v in enumerate(comp)] for r in range(replicas)]
    out.append(ReferenceStep(parts, k, bins, own,
                             [sorted(c) for c in chosen], union, update,
                             residuals, sent, counts, velocities))
  return out


def simulate_density(grads, density):
  """Achieved density (union / n_g) per step of DEFT and of plain TopK.

  TopK here is every replica taking its own whole-model top-k_total; its union
  grows with the replica count (build-up). grads[t][r] are flat vectors of the
  concatenated variables whose sizes are given by the caller through
  `deft_reference`-compatible lists: grads[t][r][v].
  """
  steps = deft_reference(grads, density)
  deft = [s.union.mean() for s in steps]
  replicas = len(grads[0])
  n_g = steps[0].union.size
  k_total = total_k(n_g, density)
  residual = [np.zeros(n_g, np.float32) for _ in range(replicas)]
  topk = []
  for step_grads in grads:
    acc = [np.concatenate([np.asarray(g, np.float32).reshape(-1)
                           for g in step_grads[r]]) + residual[r]
           for r in range(replicas)]
    union = np.zeros(n_g, bool)
    for r in range(replicas):
      union[np.argsort(-np.abs(acc[r]), kind="stable")[:k_total]] = True
    for r in range(replicas):
      residual[r] = np.where(union, 0, acc[r]).astype(np.float32)
    topk.append(union.mean())
  return deft, topk
