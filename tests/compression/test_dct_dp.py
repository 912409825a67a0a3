"""Tests for tf_dct.compression.DCTDP against the numpy reference."""

import contextlib
from unittest import mock

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import tf_dct
from tf_dct import compression
from tf_dct.compression import dct_dp
from tf_dct.compression import dct_dp_fast
from tf_dct.compression import sparse_wire
from tests import conservation
from tests import util
from tests.compression import harness
from tests.compression import reference
from tests.compression import test_native
from tf_dct.compression import native as native_ops

DCTDP = harness.compress_all(compression.DCTDP)


def setUpModule():
  util.setup_cpus()


@contextlib.contextmanager
def _fuse_size(size):
  """Traces DCTDP with `dct_dp_fast.FUSE_SIZE = size` (None: as it is)."""
  saved = dct_dp_fast.FUSE_SIZE
  dct_dp_fast.FUSE_SIZE = saved if size is None else size
  try:
    yield
  finally:
    dct_dp_fast.FUSE_SIZE = saved


SHAPES = harness.SHAPES


class DCTDPReferenceTest(tf.test.TestCase, parameterized.TestCase):

  def _compare(self, compressor, grads, replicas, kwargs, jit_compile=False):
    repl, step_fn, _, history = harness.run(compressor, grads, replicas,
                                            jit_compile=jit_compile)
    for v in range(len(SHAPES)):
      ref = reference.dct_dp_reference([[g[v] for g in step] for step in grads],
                                       **kwargs)
      for t, (ref_step, (out, states)) in enumerate(zip(ref, history)):
        st = states[v]
        for r in range(replicas):
          # Every replica applies the same update, the reference's sum.
          self.assertAllClose(out[r][v], ref_step.update, atol=1e-6, rtol=0,
                              msg=f"update var {v} step {t} replica {r}")
          if st:  # compressed variable: residual and threshold match exactly
            self.assertAllEqual(st["residual"][r], ref_step.residuals[r],
                                msg=f"residual var {v} step {t} replica {r}")
            self.assertEqual(st["threshold"][r], ref_step.next_taus[r],
                             msg=f"tau var {v} step {t} replica {r}")
            self.assertEqual(st["sent"][r], ref_step.masks[r].sum())
            self.assertEqual(st["overflow"][r],
                             ref_step.selected[r].sum() - ref_step.masks[r].sum())
            self.assertEqual(st["step"][r], t + 1)
          else:
            self.assertAllEqual(ref_step.residuals[r], np.zeros(SHAPES[v]))
    return repl, step_fn, history

  @parameterized.named_parameters(
      ("1_replica", 1, {}),
      ("2_replicas", 2, {}),
      ("4_replicas", 4, {}),
      ("2_replicas_warmup_min_size", 2, {"warmup_steps": 3, "min_size": 20}),
      # Stock ops (no native kernel), grouped and one by one.
      ("2_replicas_stock_grouped", 2, {}, None, False),
      ("2_replicas_stock_one_by_one", 2, {}, 0, False),
      ("2_replicas_warmup_stock_grouped", 2, {"warmup_steps": 3}, None, False),
      ("2_replicas_warmup_stock_one_by_one", 2, {"warmup_steps": 3}, 0, False),
      # A floor of 8 entries: both variables (30 and 17 entries)
      # select 8 instead of 6 and 4; native and stock.
      ("2_replicas_min_count", 2, {"min_count": 8}),
      ("2_replicas_min_count_stock", 2, {"min_count": 8}, None, False),
      # The per-step correction of tau, native, stock grouped and one by one.
      ("2_replicas_gain", 2, {"threshold_gain": 0.5}),
      ("2_replicas_gain_stock_grouped", 2,
       {"threshold_gain": 0.5, "threshold_max_factor": 1.5}, None, False),
      ("2_replicas_gain_stock_one_by_one", 2, {"threshold_gain": 1.0}, 0,
       False),
      # What stays in the residual fades, native and stock.
      ("2_replicas_decay", 2, {"residual_decay": 0.75}),
      ("2_replicas_decay_stock_grouped", 2, {"residual_decay": 0.75}, None,
       False),
  )
  def test_matches_reference(self, replicas, extra, fuse_size=None,
                             native=None):
    # min_count=0 unless given: Algorithm 1 as written; float32 values, as
    # the reference sends them (bfloat16 values: the test below).
    kwargs = dict(sparsity=0.8, threshold_life=5, capacity_factor=1.5,
                  **{"min_count": 0, **extra})
    grads = harness.gradients(12, replicas, seed=replicas)
    # density_band=None: Algorithm 1 as written, which the reference implements;
    # value_dtype=None: values travel in the variable's dtype, as in the
    # reference (bfloat16 words: test_bfloat16_values_match_reference).
    # On CPU the native kernel selects every variable (native=None); with
    # stock ops the variables are small, so they are selected as one group
    # unless fuse_size sends each through the selection on its own.
    with _fuse_size(fuse_size):
      _, _, history = self._compare(
          DCTDP(density_band=None, native=native, value_dtype=None, **kwargs),
          grads, replicas, kwargs)
    # The run exercised what it is meant to: sparse steps and, thanks to the
    # tied variable, threshold ties beyond capacity.
    sent = np.array([h[1][0]["sent"] for h in history])
    self.assertLess(sent[extra.get("warmup_steps", 0):].max(), 30)
    overflow = np.array([h[1][1].get("overflow", [0]) for h in history])
    if "min_size" not in extra:
      self.assertGreater(overflow.max(), 0)

  @parameterized.named_parameters(("native", None), ("stock", False))
  def test_bfloat16_values_match_reference(self, native):
    # The default value_dtype ("auto": bfloat16 value words). One step from
    # zero residuals: the selection is Algorithm 1's; each sent value
    # travels rounded to bfloat16 (nearest even), the update is the float32
    # sum of those in replica order, and the rounding error stays in the
    # residual where the value was sent.
    replicas = 2
    kwargs = dict(sparsity=0.8, threshold_life=5, capacity_factor=1.5,
                  min_count=0)
    grads = harness.gradients(1, replicas, seed=5)
    compressor = DCTDP(density_band=None, native=native, **kwargs)
    self.assertEqual(compressor.value_dtype, "bfloat16")
    *_, history = harness.run(compressor, grads, replicas)
    out, states = history[0]
    for v, shape in enumerate(SHAPES):
      ref = reference.dct_dp_reference([[g[v] for g in grads[0]]], **kwargs)[0]
      update = np.zeros(int(np.prod(shape)), np.float32)
      for r in range(replicas):
        acc = np.asarray(grads[0][r][v], np.float32).reshape(-1)
        mask = np.asarray(ref.masks[r]).reshape(-1)
        bits = acc.view(np.uint32).astype(np.uint64)
        up = ((bits & 0xFFFF) > 0x8000) | (((bits & 0xFFFF) == 0x8000)
                                            & ((bits >> 16) & 1 == 1))
        sent = (((bits >> 16) + up).astype(np.uint32) << 16).view(np.float32)
        update = update + np.where(mask, sent, np.float32(0))
        want = np.asarray(ref.residuals[r]).reshape(-1) + np.where(
            mask, acc - sent, np.float32(0))
        self.assertAllEqual(states[v]["residual"][r].reshape(-1), want)
        self.assertEqual(states[v]["sent"][r], mask.sum())
      self.assertGreater(np.count_nonzero(update), 0)
      for r in range(replicas):
        self.assertAllEqual(out[r][v].reshape(-1), update)

  def test_capacity_overflow_keeps_the_rest(self):
    # Step 0 sets tau from small gradients; tau is reused (life 100) when
    # step 1 brings gradients far above it everywhere.
    n, replicas = 40, 2
    kwargs = dict(sparsity=0.9, threshold_life=100, capacity_factor=1.0,
                  min_count=0)
    cap = dct_dp.capacity(n, 0.9, 1.0)
    self.assertEqual(cap, 4)  # m = 36, a fresh tau selects k = 40 - 36 = 4
    rng = np.random.default_rng(3)
    small = [[rng.normal(size=(n,)).astype(np.float32) * 1e-3]
             for _ in range(replicas)]
    big = [[rng.uniform(1.0, 2.0, size=(n,)).astype(np.float32)]
           for _ in range(replicas)]
    grads = [small, big]
    *_, history = harness.run(DCTDP(density_band=None, value_dtype=None,
                                    **kwargs), grads, replicas,
                              shapes=[(n,)], autograph=True)
    ref = reference.dct_dp_reference([[g[0] for g in s] for s in grads], **kwargs)
    (out0, st0), (out1, st1) = history
    state0, state1 = st0[0], st1[0]
    self.assertAllEqual(state1["threshold"], state0["threshold"])  # reused
    for r in range(replicas):
      self.assertEqual(state1["sent"][r], cap)
      self.assertEqual(state1["overflow"][r], n - cap)
      acc = big[r][0] + state0["residual"][r]
      # The first `cap` entries went out; everything else stayed behind.
      self.assertAllEqual(state1["residual"][r][:cap], np.zeros(cap))
      self.assertAllEqual(state1["residual"][r][cap:], acc[cap:])
      self.assertAllEqual(state1["residual"][r], ref[1].residuals[r])
    # Conservation: applied updates + residuals == all gradients fed in.
    total_grads = sum(g[r][0] for g in grads for r in range(replicas))
    applied = out0[0][0] + out1[0][0]
    self.assertAllClose(applied + sum(state1["residual"]), total_grads,
                        atol=1e-6, rtol=0)

  def test_compiles_with_xla(self):
    kwargs = dict(sparsity=0.8, threshold_life=5, capacity_factor=1.5,
                  warmup_steps=1, min_size=20, min_count=8)
    grads = harness.gradients(7, 1, seed=11)
    # jit_compile=True turns any op XLA cannot compile into an error, so the
    # run itself proves the step (dense, warmup and sparse paths) compiles.
    repl, step_fn, _ = self._compare(
        DCTDP(density_band=None, value_dtype=None, **kwargs), grads, 1, kwargs,
        jit_compile=True)
    step = repl._steps[(step_fn, next(iter(repl._inputs)))]  # pylint: disable=protected-access
    self.assertTrue(step.replicated_step._jit_compile)  # pylint: disable=protected-access


class ConservationTest(tf.test.TestCase):
  """SGD(lr=1): w0 - w_T + sum_r E_T == sum_t sum_r g_t (nothing is lost)."""

  def test_conservation_with_checkpoint(self):
    residuals = harness.check_conservation(
        self, DCTDP(sparsity=0.9, threshold_life=7, capacity_factor=1.5,
                    min_count=8, value_dtype=None),
        layers=conservation.TWO_LAYERS)
    # Replicas held back different errors (per-replica state). (The 1-entry
    # output bias has m = floor(0.9) = 0: always sent whole, residual 0.)
    self.assertNotAllClose(residuals[0][0], residuals[0][1])
    self.assertAllEqual(residuals[3], np.zeros((4, 1)))

  def test_conservation_with_bfloat16_values(self):
    # The default value_dtype: the rounding error of each bfloat16 value
    # stays in the residual, so nothing is lost; the restore brings the
    # residuals back exactly.
    compressor = DCTDP(sparsity=0.9, threshold_life=7, capacity_factor=1.5,
                       min_count=8)
    self.assertEqual(compressor.value_dtype, "bfloat16")
    residuals = harness.check_conservation(
        self, compressor,
        steps=40, layers=conservation.TWO_LAYERS)
    self.assertNotAllClose(residuals[0][0], residuals[0][1])


class ArgumentTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("sparsity_zero", {"sparsity": 0.0}, "sparsity must be a number in \\(0, 1\\)"),
      ("sparsity_one", {"sparsity": 1.0}, "sparsity must be a number in \\(0, 1\\)"),
      ("sparsity_str", {"sparsity": "0.9"}, "sparsity"),
      ("sparsity_nan", {"sparsity": float("nan")}, "sparsity"),
      ("life_zero", {"threshold_life": 0}, "threshold_life must be an int >= 1"),
      ("life_float", {"threshold_life": 5.0}, "threshold_life must be an int"),
      ("life_bool", {"threshold_life": True}, "threshold_life"),
      ("capacity_low", {"capacity_factor": 0.5}, "capacity_factor must be a number >= 1"),
      ("capacity_inf", {"capacity_factor": float("inf")}, "capacity_factor"),
      ("min_size_negative", {"min_size": -1}, "min_size must be an int >= 0"),
      ("min_size_float", {"min_size": 1.5}, "min_size"),
      ("warmup_negative", {"warmup_steps": -2}, "warmup_steps must be an int >= 0"),
      ("warmup_none", {"warmup_steps": None}, "warmup_steps"),
      ("fuse_size_negative", {"fuse_size": -1}, "fuse_size must be an int >= 0"),
      ("batch_capacity_float", {"batch_capacity": 1.5}, "batch_capacity must be an int"),
      ("gain_negative", {"threshold_gain": -0.1},
       "threshold_gain must be a number in \\[0, 1\\]"),
      ("gain_above_one", {"threshold_gain": 1.5}, "threshold_gain"),
      ("gain_nan", {"threshold_gain": float("nan")}, "threshold_gain"),
      ("decay_zero", {"residual_decay": 0},
       "residual_decay must be a number in \\(0, 1\\]"),
      ("decay_above_one", {"residual_decay": 1.5}, "residual_decay"),
      ("whole_below_negative", {"whole_below": -1},
       "DCTDP: whole_below must be an int >= 0, got -1"),
      ("whole_below_str", {"whole_below": "2048"}, "DCTDP: whole_below"),
      ("max_factor_one", {"threshold_max_factor": 1.0},
       "threshold_max_factor must be a number > 1"),
      ("max_factor_inf", {"threshold_max_factor": float("inf")},
       "threshold_max_factor"),
      ("value_dtype_float16", {"value_dtype": "float16"},
       "DCTDP: value_dtype must be 'auto', None \\(the variable's dtype\\) "
       "or 'bfloat16', got 'float16'"),
      ("value_dtype_masking", {"value_dtype": "bfloat16",
                               "momentum_masking": True},
       "DCTDP: value_dtype must be None with momentum_masking=True"),
  )
  def test_bad_argument(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      DCTDP(**kwargs)

  def test_value_dtype_auto(self):
    # "auto" (the default) is bfloat16 value words, or the variable's dtype
    # under momentum_masking; config() holds what it resolved to.
    for kwargs, want in (({}, "bfloat16"), ({"value_dtype": "auto"}, "bfloat16"),
                         ({"momentum": 0.9, "momentum_masking": True}, None),
                         ({"value_dtype": None}, None)):
      compressor = DCTDP(**kwargs)
      self.assertEqual(compressor.value_dtype, want, msg=kwargs)
      self.assertEqual(compressor.config()["value_dtype"], want, msg=kwargs)

  def test_fuse_size_groups_the_small_variables(self):
    # 30, 17, 40 and 700 entries, every one with state, stock selection.
    variables = [tf.Variable(tf.zeros(s)) for s in ((6, 5), (17,), (40,), (700,))]
    grads = [tf.zeros_like(v) for v in variables]
    groups = lambda size: dct_dp_fast.groups(grads, variables, [{"x": 1}] * 4, set(),
                                             fuse_size=size)
    self.assertEqual(groups(35), [(False, [0, 1]), (False, [2]), (False, [3])])
    self.assertEqual(groups(0), [(False, [0]), (False, [1]), (False, [2]), (False, [3])])
    self.assertEqual(groups(None), [(False, [0, 1, 2, 3])])  # FUSE_SIZE = 8192
    self.assertEqual(dct_dp_fast.FUSE_SIZE, 8192)
    compressor = DCTDP(fuse_size=35, batch_capacity=0)
    self.assertEqual((compressor.fuse_size, compressor.batch_capacity), (35, 0))
    self.assertEqual((DCTDP().fuse_size, DCTDP().batch_capacity), (None, None))

  def test_conventions(self):
    self.assertEqual(dct_dp.num_below(100, 0.29), 29)   # not 28
    self.assertEqual(dct_dp.capacity(100, 0.99, 2.0), 2)  # 2 * K, K = 100 - 99
    self.assertEqual(dct_dp.capacity(5, 0.1, 2.0), 5)     # m = 0: all of n
    self.assertEqual(dct_dp.capacity(10, 0.5, 1.1), 6)    # ceil(1.1 * 5)
    # A floor on k: m is lowered so that k >= min(n, min_count).
    self.assertEqual(dct_dp.num_below(100, 0.99, 8), 92)
    self.assertEqual(dct_dp.num_below(1000, 0.99, 8), 990)  # 10 >= 8 already
    self.assertEqual(dct_dp.num_below(5, 0.99, 8), 0)       # k = n
    self.assertEqual(dct_dp.capacity(100, 0.99, 2.0, 8), 16)

  def test_corrected_threshold_matches_numpy(self):
    # Counts below, at and above K = 10, a count of 0 and a tau of 0, in
    # float32 and float64: the rule against its numpy reference, exactly.
    selected = [0, 3, 9, 10, 11, 25, 40, 200]
    for dtype in (np.float32, np.float64):
      taus = np.asarray([0.3, 1e-3, 0.7, 2.5, 0.0, 0.11, 5.0, 1.0], dtype)
      for gain, bound in ((0.5, 2.0), (0.2, 1.25), (1.0, 4.0)):
        got = dct_dp.corrected_threshold(tf.constant(taus),
                                         tf.constant(selected, tf.int32),
                                         [10] * len(taus), gain, bound)
        want = [reference.reference_corrected_threshold(t, s, 10, gain, bound)
                for t, s in zip(taus, selected)]
        self.assertEqual(got.dtype, tf.as_dtype(dtype))
        self.assertAllEqual(got, np.asarray(want, dtype))
    # By hand: 30 of K = 10 with gain 0.5 doubles tau; 3 of 10 with gain 1
    # is bounded at 1 / 1.25; gain 0 returns tau itself.
    tau = tf.constant([1.5, 1.5])
    self.assertAllEqual(dct_dp.corrected_threshold(tau, [30, 10], [10, 10],
                                                   0.5, 4.0), [3.0, 1.5])
    self.assertAllClose(dct_dp.corrected_threshold(tau, [3, 3], [10, 10], 1.0,
                                                   1.25), [1.2, 1.2])
    self.assertIs(dct_dp.corrected_threshold(tau, [3, 3], [10, 10], 0.0, 2.0),
                  tau)

  def test_select_one_variable_by_hand(self):
    """`dct_dp.select`, Algorithm 1 lines 3-11, on a worked example."""
    acc = tf.constant([0.5, -3.0, 0.0, 2.0, 1.0, -2.0])
    # m = 3: sorted |acc| is 0, .5, 1, 2, 2, 3, so a fresh tau is w_3 = 2; the
    # tie -2 is selected too (3 entries), and capacity 2 sends the first two.
    fresh = dct_dp.select(acc, tf.constant(9.0), tf.constant(True), 3, 2)
    self.assertEqual(float(fresh.tau), 2.0)
    self.assertTrue(bool(fresh.refresh))
    self.assertIsNone(fresh.early)
    self.assertEqual(int(fresh.selected), 3)
    self.assertAllEqual(fresh.idx, [1, 3])
    self.assertAllEqual(fresh.val, [-3.0, 2.0])
    self.assertAllEqual(fresh.residual, [0.5, 0, 0, 0, 1, -2])  # -2 waits
    # Reused tau 1 (line 7): 1, 3, 4, 5 reach it; the zero never goes.
    kept = dct_dp.select(acc, tf.constant(1.0), tf.constant(False), 3, 4)
    self.assertEqual(float(kept.tau), 1.0)
    self.assertAllEqual(kept.idx, [1, 3, 4, 5])
    self.assertAllEqual(kept.residual, [0.5, 0, 0, 0, 0, 0])
    # The guard: tau 2.5 selects 1 < 0.5 * 3 entries, so it is refreshed;
    # tau 0.1 selects 5 <= 2 * 3 and stays.
    early = dct_dp.select(acc, tf.constant(2.5), tf.constant(False), 3, 2,
                          band=(0.5, 2.0))
    self.assertTrue(bool(early.early))
    self.assertEqual(float(early.tau), 2.0)
    calm = dct_dp.select(acc, tf.constant(0.1), tf.constant(False), 3, 6,
                         band=(0.5, 2.0))
    self.assertFalse(bool(calm.early))
    self.assertEqual(float(calm.tau), np.float32(0.1))
    self.assertEqual(int(calm.selected), 5)
    # A warm step selects nothing: everything stays for the dense sum.
    warm = dct_dp.select(acc, tf.constant(1.0), tf.constant(False), 3, 2,
                         band=(0.5, 2.0), warm=tf.constant(True))
    self.assertEqual(int(warm.selected), 0)
    self.assertFalse(bool(warm.early))
    self.assertAllEqual(warm.residual, acc)

  def test_non_float_variable(self):
    repl = tf_dct.Replicator(["/cpu:0"])
    compressor = DCTDP()
    compressor.bind(repl)
    with repl.scope():
      counter = tf.Variable(tf.zeros([3], tf.int32), name="counter")
    with self.assertRaisesRegex(TypeError, "counter.*int32"):
      compressor.state_for(counter)

  def test_non_finite_gradient_leaves_state_alone(self):
    harness.check_non_finite(
        self, DCTDP(sparsity=0.8, threshold_life=5, capacity_factor=1.5,
                    min_count=8),
        "DCTDP: non-finite gradient for variable")

  @parameterized.named_parameters(("inf", np.inf), ("nan", np.nan))
  def test_non_finite_gradient_under_xla_is_undone(self, bad):
    harness.check_non_finite_xla(
        self, lambda: DCTDP(sparsity=0.8, threshold_life=5, capacity_factor=1.5),
        bad)


def _guard_reference(grads, sparsity, life, factor, band):
  """numpy DCT-DP of one variable with the density guard; per replica."""
  n = grads[0][0].size
  m = dct_dp.num_below(n, sparsity)
  cap = dct_dp.capacity(n, sparsity, factor)
  expected = n - m
  replicas = len(grads[0])
  res = [np.zeros(n, np.float32) for _ in range(replicas)]
  tau = [np.float32(0)] * replicas
  early = [0] * replicas
  taus = []
  for k, step in enumerate(grads):
    for r in range(replicas):
      acc = step[r] + res[r]
      scheduled = k % life == 0
      count = np.sum((np.abs(acc) >= tau[r]) & (acc != 0))
      out = count < band[0] * expected or count > band[1] * expected
      if scheduled or out:
        early[r] += int(not scheduled)
        tau[r] = np.sort(np.abs(acc))[m]
      selected = (np.abs(acc) >= tau[r]) & (acc != 0)
      fits = selected & (np.cumsum(selected) - selected < cap)
      res[r] = np.where(fits, 0, acc).astype(np.float32)
    taus.append(list(tau))
  return taus, res, early


class ZeroThresholdTest(tf.test.TestCase):

  def test_few_non_zeros_are_all_sent_when_tau_is_zero(self):
    # An embedding-like gradient: 3 non-zero entries of 400, at the end of
    # the flat order. k = 4 > 3, so tau = w_396 = 0; zeros must not take the
    # 8 wire slots ahead of the non-zero entries.
    n = 400
    g = np.zeros(n, np.float32)
    g[-3:] = [0.5, -2.0, 1.0]
    grads = [[[g]], [[g * 0]]]
    *_, history = harness.run(
        DCTDP(sparsity=0.99, threshold_life=1000), grads, 1, shapes=[(n,)])
    (out, states) = history[0]
    self.assertEqual(states[0]["threshold"][0], 0.0)
    self.assertAllEqual(out[0][0], g)           # everything non-zero went out
    self.assertAllEqual(states[0]["residual"][0], np.zeros(n))
    self.assertEqual(states[0]["sent"][0], 3)
    self.assertEqual(states[0]["overflow"][0], 0)
    ref = reference.dct_dp_reference([[x[0] for x in step] for step in grads],
                                     sparsity=0.99, threshold_life=1000,
                                     capacity_factor=2.0)
    self.assertAllEqual(ref[0].update, g)


class StateTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(("stock", False), ("native", None))
  def test_scalars_share_one_variable_and_read_back_exactly(self, native):
    # tau, k, sent and overflow live in one float64[4] variable per replica;
    # a float64 tau that float32 would round (1 + 7e-12) comes back exactly.
    if native is None and not native_ops.available():
      self.skipTest("native kernels unavailable")
    g = 1.0 + 1e-12 * np.arange(10, dtype=np.float64)
    compressor = DCTDP(0.7, threshold_life=5, native=native, min_count=0)
    repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"],
                             input_replication=tf_dct.PER_REPLICA)
    compressor.bind(repl)
    with repl.scope():
      var = tf.Variable(tf.zeros([10], tf.float64), name="w")

    def step_fn():
      grad = tf.constant(g)
      return compressor.aggregate([(grad, var)])[0][0]

    for _ in range(2):
      repl.run(step_fn)
    self.assertEqual(set(compressor.state_for(var)), {"residual", "scalars"})
    values = compressor.state_values(var)
    self.assertEqual(set(values), {"residual"} | set(dct_dp.SCALARS))
    # m = 7. Step 0: tau = w_7 of g sends the 3 largest. Step 1: that tau
    # selects all 10 entries of g + E, more than the guard's 2 K = 6, so tau
    # is refreshed early to w_7 of g + E, which again sends 3.
    acc = g + np.where(g >= np.sort(g)[7], 0.0, g)
    tau = np.sort(acc)[7]
    self.assertNotEqual(np.float32(tau), tau)
    self.assertEqual(values["threshold"], [tau] * 2)
    self.assertIsInstance(values["threshold"][0], np.float64)
    self.assertEqual(values["step"], [2, 2])
    self.assertIsInstance(values["step"][0], np.int64)
    self.assertEqual(values["sent"], [3, 3])
    self.assertIsInstance(values["sent"][0], np.int32)
    self.assertEqual(values["overflow"], [0, 0])
    # The accounting's threshold is the state's.
    stats = compressor.communication_stats()["variables"]["w"]
    self.assertEqual(stats["last"]["threshold"], [tau] * 2)
    self.assertEqual(stats["counters"]["early_refreshes"], [1, 1])


class GroupingTest(tf.test.TestCase, parameterized.TestCase):
  """With stock ops, variables selected as one group behave exactly as one
  by one; the native kernel (one op per dtype) as well."""

  @parameterized.named_parameters(("eager", False, 2), ("xla", True, 1))
  def test_grouped_equals_one_by_one(self, jit, replicas):
    shapes = [(6, 5), (17,), (3,), (40,)]
    # Ties, warmup, a short life and the density guard: refreshes that are
    # due, early and absent in one group on the same step.
    grads = harness.gradients(9, replicas, seed=5, shapes=shapes)
    for t, step in enumerate(grads):  # a scale that drifts for one variable
      for g in step:
        g[3] *= 2.0**t
    kwargs = dict(sparsity=0.7, threshold_life=4, warmup_steps=2,
                  capacity_factor=1.2, min_count=8)
    runs = {}
    # 35: variables 1 and 2 grouped, 0 and 3 alone; 10**9: one group of all.
    for size in (0, 35, 10**9):
      compressor = DCTDP(native=False, **kwargs)  # grouping is a stock path
      # Traced as `wrap_optimizer` traces it, without autograph (less to
      # trace: the grouping, not the conversion, is under test).
      with _fuse_size(size):
        *_, history = harness.run(compressor, grads, replicas, shapes=shapes,
                                  jit_compile=jit, autograph=False)
      runs[size] = (history, compressor.communication_stats())
    base_history, base_stats = runs[0]
    counters = base_stats["variables"]["w3"]["counters"]
    self.assertGreater(sum(counters["early_refreshes"]), 0)
    for size in (35, 10**9):
      history, stats = runs[size]
      for t, ((out, states), (base_out, base_states)) in enumerate(
          zip(history, base_history)):
        for r in range(replicas):
          for v in range(len(shapes)):
            self.assertAllEqual(out[r][v], base_out[r][v],
                                msg=f"fuse {size} step {t} var {v}")
        for st, base_st in zip(states, base_states):
          for key in base_st:
            self.assertAllEqual(st[key], base_st[key],
                                msg=f"fuse {size} step {t} {key}")
      for name, var in base_stats["variables"].items():
        self.assertEqual(stats["variables"][name]["counters"], var["counters"])
        self.assertEqual(stats["variables"][name]["total"]["nnz"],
                         var["total"]["nnz"])
        self.assertEqual(stats["variables"][name]["last"]["threshold"],
                         var["last"]["threshold"])

  def test_mixed_dtypes_form_one_group_per_dtype(self):
    dtypes = [tf.float32, tf.float64, tf.float32, tf.float64]
    shapes = [(6, 5), (17,), (3,), (4,)]
    grads = harness.gradients(6, 2, seed=9, shapes=shapes)
    outs = {}
    # Stock one by one, stock grouped, and (where it builds) the native
    # kernel, one op per dtype.
    runs = [(0, False), (10**9, False)] + ([(0, True)] if native_ops.available()
                                          else [])
    for size, native in runs:
      compressor = DCTDP(0.7, threshold_life=3, native=native, min_count=8)
      repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"],
                               input_replication=tf_dct.PER_REPLICA)
      compressor.bind(repl)
      with repl.scope():
        variables = [tf.Variable(tf.zeros(s, d), name=f"w{i}")
                     for i, (s, d) in enumerate(zip(shapes, dtypes))]

      def input_fn(replica_id):
        return tf.data.Dataset.from_tensor_slices(tuple(  # pylint: disable=cell-var-from-loop
            np.stack([step[replica_id][v] for step in grads]).astype(
                dtypes[v].as_numpy_dtype) for v in range(len(shapes))))

      def step_fn(g):
        return [a for a, _ in compressor.aggregate(list(zip(g, variables)))]  # pylint: disable=cell-var-from-loop

      with _fuse_size(size):
        out = [[[t.numpy() for t in o] for o in
                repl.experimental_local_results(repl.run(step_fn, input_fn))]
               for _ in grads]
      self.assertEqual([o.dtype for o in out[-1][0]],
                       [d.as_numpy_dtype for d in dtypes])
      residuals = [compressor.state_for(v)["residual"].numpy() for v in variables]
      outs[(size, native)] = (out, residuals)
    alone, res_alone = outs[(0, False)]
    grouped, res_grouped = outs[(10**9, False)]
    for key, (other, res_other) in outs.items():
      for t, (a, b) in enumerate(zip(other, alone)):
        for r in range(2):
          for v in range(len(shapes)):
            self.assertAllEqual(a[r][v], b[r][v], msg=f"{key} step {t} var {v}")
      for a, b in zip(res_other, res_alone):
        self.assertAllEqual(a, b, msg=f"{key}")
    # Something was sent and something held back.
    self.assertGreater(np.abs(np.concatenate(
        [np.ravel(o) for o in grouped[-1][0]])).sum(), 0)
    self.assertGreater(sum(np.abs(r).sum() for r in res_grouped), 0)


class NativeTest(tf.test.TestCase, parameterized.TestCase):
  """The native kernel (tf_dct.compression.native) changes no bit of DCT-DP."""

  @parameterized.named_parameters(
      ("guard_warmup", dict(warmup_steps=2, capacity_factor=1.2)),
      ("no_guard_overflow", dict(density_band=None, capacity_factor=1.0)))
  def test_native_equals_stock(self, extra):
    test_native.require_native(self)
    # (700,): more wire slots than sparse_wire.BATCH_CAPACITY, so its sums
    # also come from the native decode-scatter-count kernel.
    shapes = [(6, 5), (17,), (40,), (700,)]
    self.assertGreater(dct_dp.capacity(700, 0.7, 1.0),
                       sparse_wire.BATCH_CAPACITY)
    grads = harness.gradients(9, 2, seed=7, shapes=shapes)
    for t, step in enumerate(grads):  # a drifting scale: early refreshes
      for g in step:
        g[2] *= 2.0**t
        g[0][0, :2] = 0.0  # zeros stay behind even when tau is 0
    runs = {}
    for native in (False, True):
      compressor = DCTDP(0.7, threshold_life=4, native=native, min_count=8,
                         **extra)
      with _fuse_size(0):  # stock: every variable alone (native: one op)
        repl, step_fn, _, history = harness.run(compressor, grads, 2,
                                                shapes=shapes)
      step = repl._steps[(step_fn, next(iter(repl._inputs)))]  # pylint: disable=protected-access
      kinds = util.graph_ops(step)  # with the branches of tf.cond
      runs[native] = (history, compressor.communication_stats(), kinds)
    self.assertNotIn("TfDctSelect", runs[False][2])
    # One op per replica selects all four variables, refreshes included.
    self.assertEqual(runs[True][2].count("TfDctSelect"), 2)
    self.assertIn("TopKV2", runs[False][2])
    self.assertNotIn("TopKV2", runs[True][2])
    # One payload and one decode per replica for all variables' buffers.
    for kind in ("TfDctEncode", "TfDctGatherSum"):
      self.assertEqual(runs[True][2].count(kind), 2)
      self.assertNotIn(kind, runs[False][2])
    # The kernel checks the gradients it reads: no CheckNumerics left.
    self.assertIn("CheckNumerics", runs[False][2])
    self.assertNotIn("CheckNumerics", runs[True][2])
    (stock, stock_stats, _), (fused, fused_stats, _) = runs[False], runs[True]
    for t, ((out, states), (base_out, base_states)) in enumerate(
        zip(fused, stock)):
      for r in range(2):
        for v in range(len(shapes)):
          self.assertAllEqual(out[r][v], base_out[r][v], msg=f"step {t} var {v}")
      for st, base_st in zip(states, base_states):
        for key in base_st:
          self.assertAllEqual(st[key], base_st[key], msg=f"step {t} {key}")
    for name, var in stock_stats["variables"].items():
      self.assertEqual(fused_stats["variables"][name]["counters"],
                       var["counters"])
      self.assertEqual(fused_stats["variables"][name]["total"]["nnz"],
                       var["total"]["nnz"])
    if extra.get("density_band", 0) is not None:
      self.assertGreater(
          sum(stock_stats["variables"]["w2"]["counters"]["early_refreshes"]), 0)
    else:
      self.assertGreater(sum(sum(h[1][2]["overflow"]) for h in stock), 0)

  def test_non_finite_gradient_leaves_state_alone(self):
    test_native.require_native(self)
    harness.check_non_finite(  # both variables in one native op
        self, DCTDP(sparsity=0.8, threshold_life=5, native=True, min_count=8),
        "DCTDP: non-finite gradient for variable .* : Tensor had NaN")

  def test_native_argument(self):
    with self.assertRaisesRegex(ValueError, "native must be None, True or False"):
      DCTDP(native=1)
    with mock.patch.object(native_ops, "available", return_value=False):
      with self.assertRaisesRegex(RuntimeError, "native=True.*cannot be built"):
        DCTDP(native=True)
      DCTDP(native=None)  # falls back quietly


class DensityGuardTest(tf.test.TestCase, parameterized.TestCase):

  # XLA on one replica: a jit-compiled step of several local replicas is one
  # XLA cluster on one device, which cannot reach the other replicas' state.
  @parameterized.named_parameters(("eager", False, 2), ("xla", True, 1))
  def test_drifting_scale_refreshes_early_and_conserves(self, jit, replicas):
    steps, n = 10, 50
    kwargs = dict(sparsity=0.9, threshold_life=1000, capacity_factor=2.0,
                  min_count=0)
    band = (0.5, 2.0)
    rng = np.random.default_rng(7)
    # The scale grows 1.5x per step: a reused tau selects ever more entries.
    grads = [[[(rng.normal(size=n) * 1.5**t).astype(np.float32)]
              for _ in range(replicas)] for t in range(steps)]
    # float32 values, as the reference's residuals hold them
    guarded = DCTDP(value_dtype=None, **kwargs)  # default band (0.5, 2.0)
    self.assertEqual(guarded.density_band, band)
    *_, history = harness.run(guarded, grads, replicas, shapes=[(n,)],
                              jit_compile=jit)
    ref_taus, ref_res, ref_early = _guard_reference(
        [[g[0] for g in s] for s in grads], band=band, life=1000,
        sparsity=0.9, factor=2.0)
    for t, (_, states) in enumerate(history):
      self.assertAllEqual(states[0]["threshold"], ref_taus[t], msg=f"step {t}")
    stats = guarded.communication_stats()["variables"]["w0"]
    self.assertEqual(stats["counters"]["early_refreshes"], ref_early)
    self.assertGreater(min(ref_early), 2)
    final = history[-1][1][0]["residual"]
    for r in range(replicas):
      self.assertAllEqual(final[r], ref_res[r])
    # Conservation: applied updates + residuals == all gradients fed in.
    applied = sum(out[0][0] for out, _ in history)
    total = sum(g[r][0] for g in grads for r in range(replicas))
    self.assertAllClose(applied + sum(final), total, atol=1e-5 * np.abs(total).max(),
                        rtol=0)
    # Without the guard the same run never refreshes after step 0.
    plain = DCTDP(density_band=None, **kwargs)
    harness.run(plain, grads, replicas, shapes=[(n,)])
    counters = plain.communication_stats()["variables"]["w0"]["counters"]
    self.assertNotIn("early_refreshes", counters)
    self.assertEqual(counters["refreshes"], [1] * replicas)

  def test_default_guard_avoids_the_cold_start(self):
    # Stationary gradients: tau from step 0 (residual 0) is too low once error
    # feedback builds up, so Algorithm 1 with a long life keeps selecting
    # far more than K; the default guard brings the selection back to K.
    n, steps, sparsity = 200, 40, 0.9
    k = dct_dp.expected_count(n, sparsity)
    rng = np.random.default_rng(11)
    grads = [[[rng.normal(size=n).astype(np.float32)]] for _ in range(steps)]
    selected = {}
    for name, band in (("literal", None), ("default", (0.5, 2.0)),
                       ("tight", (0.5, 1.25))):
      compressor = DCTDP(sparsity, threshold_life=1000, density_band=band,
                         min_count=0)  # K = k, no floor
      *_, history = harness.run(compressor, grads, 1, shapes=[(n,)])
      selected[name] = np.array([st[0]["sent"][0] + st[0]["overflow"][0]
                                 for _, st in history])
    late = slice(steps // 2, steps)
    self.assertGreater(selected["literal"][late].mean(), 2 * k)  # about 2.5 K
    self.assertTrue(np.all(selected["default"][late] >= k // 2), selected["default"])
    self.assertTrue(np.all(selected["default"] <= 2 * k), selected["default"])
    # The default lets the reused tau select more than 1.25 K on some steps;
    # a (0.5, 1.25) band never does.
    self.assertGreater(selected["default"].max(), 1.25 * k)
    self.assertTrue(np.all(selected["tight"] >= k // 2), selected["tight"])
    self.assertTrue(np.all(selected["tight"] <= 1.25 * k), selected["tight"])
    self.assertEqual(DCTDP().density_band, (0.5, 2.0))

  def test_bad_band_and_encoding(self):
    for band in [(0.5,), (1.5, 2.0), (0.5, 0.9), (-0.1, 2.0), (0.5, float("inf")),
                 "wide", (True, 2.0), (1.0, 1.0)]:
      with self.assertRaisesRegex(ValueError, "density_band must be None or a pair"):
        DCTDP(density_band=band)
    self.assertEqual(DCTDP(density_band=(0, 3)).density_band, (0.0, 3.0))
    with self.assertRaisesRegex(ValueError, "index_encoding must be"):
      DCTDP(index_encoding="uint4")


if __name__ == "__main__":
  tf.test.main()
