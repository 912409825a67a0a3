"""Tests for tf_dct.compression.DEFT against the numpy reference."""

import json
import os
import subprocess
import sys

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import tf_dct
from tf_dct import compression
from tf_dct.compression import deft
from tests import conservation
from tests import util
from tests.compression import density_script
from tests.compression import harness
from tests.compression import reference_baselines
from tests.compression import reference_deft as reference

DEFT = harness.compress_all(compression.DEFT)


def setUpModule():
  util.setup_cpus()


# n_g = 3204, a few layers of a few thousand entries. At density 0.03,
# k_total = 96; on 4 replicas the two kernels split into 4 pieces each, so
# P = 10 and sum_x k_x <= k_total + P - 1 = 105 (+9.4%): the density band holds
# whatever the gradients. The last variable is full of ties.
SHAPES = [(48, 40), (40, 24), (24,), (30, 10)]
SCALES = [1.0, 3.0, 0.5, 1.0]
DENSITY = 0.03


def _gradients(steps, replicas, seed=0, shapes=SHAPES):
  """grads[t][r][v]: per-variable scales differ so local k differs."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    per_replica = []
    for _ in range(replicas):
      gs = [(rng.normal(size=s) * c).astype(np.float32)
            for s, c in zip(shapes[:-1], SCALES)]
      gs.append((np.round(rng.normal(size=shapes[-1]) * 2) / 2).astype(np.float32))
      per_replica.append(gs)
    out.append(per_replica)
  return out


class DEFTReferenceTest(tf.test.TestCase, parameterized.TestCase):

  def _compare(self, replicas, kwargs, steps=8, jit_compile=False,
               autograph=True):
    grads = _gradients(steps, replicas, seed=replicas)
    repl, step_fn, _, history = harness.run(DEFT(**kwargs), grads, replicas,
                                            jit_compile=jit_compile,
                                            shapes=SHAPES, autograph=autograph)
    ref = reference.deft_reference(grads, **kwargs)
    comp = [v for v, st in enumerate(history[0][1]) if st]
    n_g = sum(int(np.prod(SHAPES[v])) for v in comp)
    for t, (ref_step, (out, states)) in enumerate(zip(ref, history)):
      # A velocity grows to ~10x the gradients, and the float32 sum of the
      # replicas' velocities rounds at 1e-6 of their size.
      scales = [max(1.0, float(np.abs(u).max())) if kwargs.get("momentum")
                else 1.0 for u in ref_step.update]
      for r in range(replicas):
        for v in range(len(SHAPES)):
          # Every replica applies the same update: the reference's sum.
          self.assertAllClose(out[r][v], ref_step.update[v],
                              atol=1e-6 * scales[v], rtol=1e-6,
                              msg=f"update var {v} step {t} replica {r}")
        for i, v in enumerate(comp):
          st = states[v]
          self.assertAllEqual(st["residual"][r], ref_step.residuals[r][i],
                              msg=f"residual var {v} step {t} replica {r}")
          self.assertEqual(st["sent"][r], ref_step.sent[i])
          self.assertEqual(st["selected"][r], ref_step.selected_count[r][i],
                           msg=f"selected var {v} step {t} replica {r}")
          self.assertEqual(st["step"][r], t + 1)
          if kwargs.get("momentum"):
            self.assertAllClose(st["velocity"][r], ref_step.velocities[r][i],
                                atol=1e-6, rtol=1e-6,
                                msg=f"velocity var {v} step {t} replica {r}")
      if t >= kwargs.get("warmup_steps", 0):
        # Selections are disjoint: the union has exactly sum_x k_x entries,
        # and the achieved density stays within 10% of the set one.
        union = sum(states[v]["sent"][0] for v in comp)
        self.assertEqual(union, sum(ref_step.k))
        self.assertEqual(union, ref_step.union.sum())
        self.assertEqual(sum(len(c) for c in ref_step.selected), union)
        if kwargs.get("min_count", 8) <= 1:  # the paper's floor of 1
          self.assertBetween(union / n_g, 0.9 * kwargs["density"],
                             1.1 * kwargs["density"])
        else:  # every partition takes at least min(size, min_count)
          parts = deft.partition([int(np.prod(SHAPES[v])) for v in comp],
                                 replicas)
          floors = [min(p.size, kwargs.get("min_count", 8)) for p in parts]
          self.assertAllGreaterEqual(np.asarray(ref_step.k) - floors, 0)
          self.assertLessEqual(union, deft.union_capacity(
              n_g, deft.total_k(n_g, kwargs["density"]), len(parts),
              kwargs.get("min_count", 8), [p.size for p in parts]))
    return repl, step_fn, ref

  @parameterized.named_parameters(
      ("1_replica", 1, {"min_count": 1}),
      ("2_replicas", 2, {"min_count": 1}),
      ("4_replicas", 4, {"min_count": 1}),
      ("2_replicas_warmup_min_size", 2, {"warmup_steps": 2, "min_size": 25,
                                         "min_count": 1}),
      ("4_replicas_min_count_default", 4, {"min_count": 8}),
      ("2_replicas_min_count_40", 2, {"min_count": 40}),
      ("2_replicas_residual_decay", 2, {"min_count": 1, "residual_decay": 0.75}),
      ("4_replicas_norm_budget", 4, {"min_count": 1, "budget": "norm"}),
      ("4_replicas_norm_budget_min_count_default", 4, {"min_count": 8,
                                                       "budget": "norm"}),
      ("2_replicas_momentum", 2, {"min_count": 1, "momentum": 0.9}),
      ("4_replicas_momentum_masking", 4, {"min_count": 8, "momentum": 0.9,
                                          "momentum_masking": True}),
      ("2_replicas_momentum_masking_warmup_min_size_decay", 2, {
          "warmup_steps": 2, "min_size": 25, "min_count": 1, "momentum": 0.9,
          "momentum_masking": True, "residual_decay": 0.75}),
      ("2_replicas_norm_budget_warmup_min_size", 2, {
          "warmup_steps": 2, "min_size": 25, "min_count": 1, "budget": "norm"}),
  )
  def test_matches_reference(self, replicas, extra):
    kwargs = dict(density=DENSITY, **extra)
    # Traced without autograph, as `wrap_optimizer` runs DEFT (a quarter less
    # tracing); test_compiles_with_xla compares the converted step.
    _, _, ref = self._compare(replicas, kwargs, autograph=False)
    # The run exercised what it is meant to: k differs between partitions,
    # owners rotate, and with n > 1 every replica selected something.
    # (With a floor of 8 most small partitions take exactly the floor; under
    # the "size" budget k follows the partition sizes, which take 2-3 values.)
    by_norm = kwargs.get("budget") == "norm" and kwargs["min_count"] <= 1
    self.assertGreater(len(set(ref[-1].k)), 2 if by_norm else 1)
    if kwargs.get("budget", "size") == "size":  # the default
      k_total = deft.total_k(ref[-1].union.size, DENSITY)
      self.assertEqual(ref[-1].k, deft.size_k(
          [p[2] for p in ref[-1].parts], k_total, kwargs["min_count"]))
    if replicas > 1:
      self.assertNotEqual(ref[-1].owners, ref[-2].owners)
      for r in range(replicas):
        self.assertNotEmpty(ref[-1].selected[r])

  def test_compiles_with_xla(self):
    kwargs = dict(density=DENSITY, warmup_steps=1, min_size=25, min_count=8)
    # jit_compile=True turns any op XLA cannot compile into an error, so the
    # run itself proves the step (dense, warmup and sparse paths) compiles.
    repl, step_fn, _ = self._compare(1, kwargs, steps=4, jit_compile=True)
    step = repl._steps[(step_fn, next(iter(repl._inputs)))]  # pylint: disable=protected-access
    self.assertTrue(step.replicated_step._jit_compile)  # pylint: disable=protected-access


class PlanTest(tf.test.TestCase):
  """Partition, local k, packing and owners: TF == reference."""

  def test_partition(self):
    # n_g = 15, n = 4: only 10 > 3.75 splits, remainder to the first pieces.
    self.assertEqual([(p.variable, p.start, p.size)
                      for p in deft.partition([10, 3, 2], 4)],
                     [(0, 0, 3), (0, 3, 3), (0, 6, 2), (0, 8, 2), (1, 10, 3),
                      (2, 13, 2)])
    # Variables smaller than n split into fewer non-empty pieces.
    self.assertEqual([(p.variable, p.start, p.size)
                      for p in deft.partition([2, 1], 4)],
                     [(0, 0, 1), (0, 1, 1), (1, 2, 1)])
    self.assertLen(deft.partition([7, 9], 1), 2)  # one replica: no split
    rng = np.random.default_rng(0)
    for n in (2, 4, 8):
      sizes = [int(s) for s in rng.integers(1, 3000, size=6)]
      self.assertEqual([(p.variable, p.start, p.size)
                        for p in deft.partition(sizes, n)],
                       reference.partition(sizes, n))

  def test_conventions(self):
    self.assertEqual(deft.total_k(100, 0.29), 29)   # not 28
    self.assertEqual(deft.total_k(50, 0.01), 1)     # at least one
    self.assertEqual(deft.total_k(7, 1.0), 7)
    self.assertEqual(deft.union_capacity(1000, 10, 5), 14)
    self.assertEqual(deft.union_capacity(12, 10, 5), 12)
    # A floor of min(size, min_count) per partition: k_total + sum of floors.
    self.assertEqual(deft.union_capacity(1000, 10, 3, 8, [100, 5, 50]), 31)
    self.assertEqual(deft.union_capacity(1000, 10, 3, 1, [100, 5, 50]), 12)

  def test_local_k_pack_owners(self):
    rng = np.random.default_rng(1)
    for n, sizes, k_total in [(4, [300, 300, 299, 299, 50, 7, 1], 40),
                              (8, [int(s) for s in rng.integers(1, 400, 20)], 120),
                              (3, [5, 9, 2], 400)]:
      plan = tf.function(lambda norms, step, n=n, sizes=sizes, k_total=k_total: (
          lambda k: (k, deft.owners(deft.pack(k, sizes, n), step, n)))(
              deft.local_k(norms, sizes, k_total)))
      for trial in range(12):
        norms = rng.exponential(size=len(sizes)).astype(np.float32)
        if trial % 4 == 1:   # tied norms
          norms[::2] = norms[1]
        if trial % 4 == 2:   # one dominant partition: budget runs out
          norms[0] *= 1e4
        if trial == 3:
          norms[:] = 0
        k, own = [t.numpy().tolist() for t in plan(norms, np.int64(trial))]
        want_k = reference.local_k(norms, sizes, k_total)
        self.assertEqual(k, want_k, msg=f"{sizes} {norms}")
        self.assertEqual(own, reference.owners(
            reference.pack(want_k, sizes, n), trial, n))
        self.assertTrue(all(1 <= kx <= s for kx, s in zip(k, sizes)))
        low = len(sizes) if trial == 3 else min(k_total, sum(sizes)) - len(sizes)
        self.assertBetween(sum(k), low, k_total + len(sizes) - 1)

  def test_local_k_with_min_count(self):
    rng = np.random.default_rng(2)
    for sizes, k_total, min_count in [([300, 300, 50, 7, 1], 40, 8),
                                      ([int(s) for s in rng.integers(1, 400, 20)],
                                       30, 16),
                                      ([5, 9, 2], 400, 8)]:
      plan = tf.function(lambda norms, sizes=sizes, k_total=k_total, c=min_count:
                         deft.local_k(norms, sizes, k_total, c))
      for trial in range(8):
        norms = rng.exponential(size=len(sizes)).astype(np.float32)
        if trial % 4 == 2:   # one dominant partition: budget runs out
          norms[0] *= 1e4
        if trial == 3:
          norms[:] = 0
        k = plan(norms).numpy().tolist()
        self.assertEqual(k, reference.local_k(norms, sizes, k_total, min_count))
        floors = [min(s, min_count) for s in sizes]
        self.assertTrue(all(f <= kx <= s for kx, f, s in zip(k, floors, sizes)),
                        msg=f"{k} {sizes}")
        self.assertLessEqual(sum(k), deft.union_capacity(
            10**6, k_total, len(sizes), min_count, sizes))


  def test_size_k(self):
    # n_g = 658, k_total = 40: floor(40 * size / 658) is 18, 18, 3, 0, 0.
    self.assertEqual(deft.size_k([300, 300, 50, 7, 1], 40), [18, 18, 3, 1, 1])
    self.assertEqual(deft.size_k([300, 300, 50, 7, 1], 40, 8), [18, 18, 8, 7, 1])
    self.assertEqual(deft.size_k([5, 9, 2], 400), [5, 9, 2])  # whole partitions
    rng = np.random.default_rng(3)
    for trial in range(20):
      sizes = [int(s) for s in rng.integers(1, 400, int(rng.integers(1, 25)))]
      k_total = int(rng.integers(1, sum(sizes) + 1))
      min_count = int(rng.choice([0, 1, 8, 64]))
      k = deft.size_k(sizes, k_total, min_count)
      self.assertEqual(k, reference.size_k(sizes, k_total, min_count))
      floors = [min(s, max(1, min_count)) for s in sizes]
      self.assertTrue(all(f <= kx <= s for kx, f, s in zip(k, floors, sizes)))
      self.assertLessEqual(sum(k), deft.union_capacity(
          sum(sizes), k_total, len(sizes), min_count, sizes), msg=f"trial {trial}")
      # The same density everywhere: no partition above its share but for
      # its floor.
      n_g = sum(sizes)
      self.assertTrue(all(kx <= max(f, k_total * s / n_g)
                          for kx, f, s in zip(k, floors, sizes)))


class OwnedTopKTest(tf.test.TestCase, parameterized.TestCase):
  """The top-k size ladder keeps exactly the positions one top-k of K_x keeps."""

  def test_ladder(self):
    self.assertEqual(deft.top_k_sizes(64), [64])
    self.assertEqual(deft.top_k_sizes(10), [10])
    self.assertEqual(deft.top_k_sizes(300), [64, 128, 256, 300])

  @parameterized.named_parameters(
      ("exact_k", "owned_top_k", False),   # outside XLA: top-k of k itself
      ("xla", "owned_top_k", True),        # under XLA: the ladder
      ("ladder", "ladder_top_k", False))
  def test_matches_sorted_numpy_prefix(self, fn, jit):
    n, bound = 700, 300
    rng = np.random.default_rng(5)
    # Quantized magnitudes: many ties, which must go to the lower position.
    magnitude = np.round(rng.uniform(0, 1, n) * 50).astype(np.float32)
    expected = np.argsort(-magnitude, kind="stable")
    select = tf.function(getattr(deft, fn), jit_compile=jit)
    x = tf.constant(magnitude)
    # Every rung of [64, 128, 256, 300], both sides of each boundary.
    for k in (1, 63, 64, 65, 128, 129, 256, 257, 299, 300):
      got = select(x, tf.constant(k), bound, tf.constant(True)).numpy()
      self.assertEqual(got.shape, (bound,))
      self.assertAllEqual(got[:k], expected[:k], msg=f"k={k}")
    self.assertAllEqual(select(x, tf.constant(5), bound, tf.constant(False)),
                        np.zeros(bound, np.int32))
    if not jit:  # which selection the graph holds: a switch over sizes or not
      graph = select.get_concrete_function(
          x, tf.constant(5), bound, tf.constant(True)).graph
      ops = {op.type for op in graph.get_operations()}
      self.assertEqual(bool(ops & {"Case", "StatelessCase"}), fn == "ladder_top_k")


class DensityTest(tf.test.TestCase):
  """Achieved density at 2, 4 and 8 replicas: the numpy simulation of the
  plan, and tf_dct's DEFT on 8 real replicas against TopK's numpy reference
  on the same gradients (DEFTReferenceTest checks DEFT's density on 2 and 4;
  TopK matches that reference on 1, 2 and 4 replicas in test_topk.py and
  builds up on 2 and 4 real ones in test_cltk.py)."""

  def test_density_band_without_build_up(self):
    # n_g = 20800, density 0.01: k_total = 208; at 8 replicas the two largest
    # kernels split into 8 pieces, P = 18, so sum_x k_x <= 225 (+8.2%).
    shapes = [(128, 96), (96, 64), (64, 32), (32, 10)]
    scales = [0.2, 1.0, 3.0, 0.5]
    rng = np.random.default_rng(7)
    density = 0.01
    for n in (2, 4, 8):
      grads = []
      for _ in range(6):
        common = [rng.normal(size=s) * c for s, c in zip(shapes, scales)]
        grads.append([[(g + rng.normal(size=g.shape) * c).astype(np.float32)
                       for g, c in zip(common, scales)] for _ in range(n)])
      deft_density, topk_density = reference.simulate_density(grads, density)
      for d in deft_density:
        self.assertBetween(d, 0.9 * density, 1.1 * density, msg=f"n={n}")
      if n == 8:  # whole-model top-k per replica builds up; DEFT does not
        self.assertGreater(min(topk_density), 2 * density)

  @pytest.mark.slow(seconds=20)
  def test_eight_real_replicas(self):
    # tf_dct's own DEFT on 8 replicas (a subprocess: this process has 4
    # logical CPUs); 2 and 4 replicas are checked in process.
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "density_script.py")
    proc = subprocess.run([sys.executable, script], capture_output=True,
                          text=True, timeout=600, check=False)
    self.assertEqual(proc.returncode, 0, msg=proc.stderr[-3000:])
    density = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("last", "mean"):
      self.assertLen(density["deft"][key], 8)
      for d in density["deft"][key]:  # no build-up: within 10% of 0.01
        self.assertBetween(d, 0.009, 0.011, msg=key)
    # TopK (per-variable top-k, its default floor) on the same gradients: the
    # union of the 8 replicas' selections builds up, in the last step and
    # over the steps.
    n = density_script.REPLICAS
    grads = density_script.gradients(n, seed=n)
    min_count = compression.TopK(density=density_script.DENSITY).min_count
    union = np.zeros(density_script.STEPS)
    for v in range(len(density_script.SHAPES)):
      steps = reference_baselines.topk_reference(
          [[g[v] for g in step] for step in grads], density_script.DENSITY,
          min_count=min_count)
      union += [np.logical_or.reduce(step.masks).sum() for step in steps]
    topk = union / sum(int(np.prod(s)) for s in density_script.SHAPES)
    for key, d in (("last", topk[-1]), ("mean", topk.mean())):
      self.assertGreater(d, 4 * 0.01, msg=key)


class AccountingTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.parameters("norm", "size")
  def test_reported_bytes_are_what_the_collectives_move(self, budget):
    replicas = 4
    compressor = DEFT(density=DENSITY, budget=budget)
    harness.run(compressor, _gradients(2, replicas, seed=4), replicas,
                shapes=SHAPES)
    sizes = [int(np.prod(shape)) for shape in SHAPES]
    n_g = sum(sizes)
    parts = deft.partition(sizes, replicas)
    cap = deft.union_capacity(n_g, deft.total_k(n_g, DENSITY), len(parts),
                              compressor.min_count, [p.size for p in parts])
    # One all-reduce of P float32 norms (budget "norm" only), of the "ef"
    # words of U positions (b low bits each, then a bitmap of
    # ((n_g - 1) >> b) + U bits), of U values.
    b = int(np.floor(np.log2(n_g / cap)))
    words = -(-(cap * b + ((n_g - 1) >> b) + cap) // 32)
    norms = 4 * len(parts) if budget == "norm" else 0
    moved = norms + 4 * words + 4 * cap
    stats = compressor.communication_stats()
    self.assertEqual(stats["last"]["payload_bytes"], [moved] * replicas)
    ring = 2 * (replicas - 1) / replicas
    self.assertAllClose(stats["last"]["bytes_sent"], [ring * moved] * replicas)
    self.assertAllClose(stats["last"]["dense_bytes"], [ring * 4 * n_g] * replicas)
    # The union never exceeds the k_total budget + (P - 1) one-entry floors.
    self.assertLessEqual(max(stats["last"]["density"]), cap / n_g)
    self.assertGreater(min(stats["last"]["density"]), 0.0)

  def test_variables_below_min_size_are_charged_as_all_reduced(self):
    replicas = 4
    compressor = DEFT(density=DENSITY, min_size=25)  # the (24,) bias is dense
    harness.run(compressor, _gradients(2, replicas, seed=4), replicas,
                shapes=SHAPES)
    stats = compressor.communication_stats()
    bias = stats["variables"]["w2"]
    self.assertEqual(bias["size"], 24)
    self.assertEqual(bias["last"]["payload_bytes"], [4 * 24] * replicas)
    ring = 2 * (replicas - 1) / replicas
    self.assertAllClose(bias["last"]["dense_bytes"], [ring * 4 * 24] * replicas)
    # The whole step's dense reference covers every variable.
    n = sum(int(np.prod(shape)) for shape in SHAPES)
    self.assertAllClose(stats["last"]["dense_bytes"], [ring * 4 * n] * replicas)


class ConservationTest(tf.test.TestCase):
  """SGD(lr=1): w0 - w_T + sum_r E_T == sum_t sum_r g_t (nothing is lost)."""

  def test_conservation_with_checkpoint(self):
    compressor = DEFT(density=0.1, min_count=1)  # the paper's floor
    residuals = harness.check_conservation(self, compressor,
                                           layers=conservation.TWO_LAYERS)
    # Replicas held back different errors (per-replica state), and the union
    # is about k_total = floor(49 * 0.1) = 4 entries (P = 7 partitions).
    self.assertNotAllClose(residuals[0][0], residuals[0][1])
    variables = [ref.deref() for ref in compressor._keys]  # pylint: disable=protected-access
    sent = sum(int(compressor.state_values(v)["sent"][0])
               for v in variables if compressor.state_for(v))
    self.assertBetween(sent, 4, 4 + 6)


class ArgumentTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("density_zero", {"density": 0.0}, "density must be a number in \\(0, 1\\]"),
      ("density_above_one", {"density": 1.5}, "density must be a number in \\(0, 1\\]"),
      ("density_negative", {"density": -0.1}, "density"),
      ("density_nan", {"density": float("nan")}, "density"),
      ("density_str", {"density": "0.1"}, "density"),
      ("density_bool", {"density": True}, "density"),
      ("min_size_negative", {"min_size": -1}, "min_size must be an int >= 0"),
      ("min_size_float", {"min_size": 1.5}, "min_size"),
      ("warmup_negative", {"warmup_steps": -2}, "warmup_steps must be an int >= 0"),
      ("warmup_none", {"warmup_steps": None}, "warmup_steps"),
      ("whole_below_negative", {"whole_below": -1},
       "whole_below must be an int >= 0"),
      ("whole_below_float", {"whole_below": 2048.0}, "whole_below"),
      ("residual_decay_zero", {"residual_decay": 0},
       "DEFT: residual_decay must be a number in \\(0, 1\\], got 0"),
      ("residual_decay_nan", {"residual_decay": float("nan")}, "residual_decay"),
      ("budget_unknown", {"budget": "l2"},
       "budget must be one of \\('norm', 'size'\\), got 'l2'"),
  )
  def test_bad_argument(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      DEFT(**kwargs)

  def test_density_one_is_dense(self):
    self.assertEqual(DEFT(density=1).density, 1.0)

  def test_non_float_variable(self):
    repl = tf_dct.Replicator(["/cpu:0"])
    compressor = DEFT()
    compressor.bind(repl)
    with repl.scope():
      counter = tf.Variable(tf.zeros([3], tf.int32), name="counter")
    with self.assertRaisesRegex(TypeError, "counter.*int32"):
      compressor.state_for(counter)

  def test_non_finite_gradient_leaves_state_alone(self):
    # Step 2: one Inf in the last variable of replica 1 only.
    shapes = [(20, 10), (30,)]
    grads = _gradients(4, 2, seed=4, shapes=shapes)
    grads[2][1][1][3] = np.inf
    harness.check_non_finite(self, DEFT(density=0.1),
                             "DEFT: non-finite gradient for variable",
                             grads=grads, shapes=shapes)

  def test_non_finite_gradient_under_xla_is_undone(self):
    harness.check_non_finite_xla(self, lambda: DEFT(density=0.2))


if __name__ == "__main__":
  tf.test.main()
