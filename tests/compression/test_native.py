"""tf_dct.compression.native: the DCT-DP kernels against numpy and the stock ops."""

import dataclasses
import os
from unittest import mock

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tf_dct.compression import dct_dp
from tf_dct.compression import sparse_wire
from tf_dct.compression import native
from tests import util
from tests.compression import reference_bfloat16


def setUpModule():
  util.setup_cpus()  # before any op, like every module of the suite


def require_native(test):
  """Skips `test` when the kernel cannot be built here; under CI it fails."""
  if native.available():
    return
  if os.environ.get("CI") == "true":
    test.fail("tf_dct native kernels did not build (see the logged warning)")
  test.skipTest("no native kernels here (no C++ compiler?)")


def reference(grad, residual, tau, capacity):
  """numpy DCT Algorithm 1 lines 2 and 9-11 with the wire's capacity."""
  acc = grad + residual
  mask = (np.abs(acc) >= tau) & (acc != 0)
  positions = np.flatnonzero(mask)
  sent = positions[:capacity]
  idx = np.full(capacity, grad.size, np.int32)
  val = np.zeros(capacity, grad.dtype)
  idx[:sent.size] = sent
  val[:sent.size] = acc[sent]
  new_residual = acc.copy()
  new_residual[sent] = 0
  return idx, val, new_residual, positions.size


def select_one(grad, residual, tau, capacity, mode=native.FIXED, m=0,
               band=(0, 0), message="m", value_dtype=None):
  """`native.select` of one variable: (idx, val, residual, tau, selected,
  early) as numpy values."""
  idx, val, res, taus, selected, early, _ = native.select(
      [tf.constant(grad)], [tf.constant(residual)],
      tf.constant([tau], grad.dtype), tf.constant([mode], tf.int32),
      [capacity], [m], [band[0]], [band[1]], [message], value_dtype)
  return (idx[0].numpy(), val[0].numpy(), res[0].numpy(), taus.numpy()[0],
          int(selected[0]), bool(early[0]))


class SelectTest(tf.test.TestCase, parameterized.TestCase):
  """Lines 2 and 9-11 with a given tau (mode FIXED)."""

  def setUp(self):
    super().setUp()
    require_native(self)

  @parameterized.named_parameters(
      ("float32_room", np.float32, 200, 40),
      ("float32_overflow", np.float32, 200, 5),
      ("float64", np.float64, 300, 12),
      ("capacity_n", np.float32, 7, 7),
      ("many_blocks", np.float32, 1000, 30))
  def test_matches_reference(self, dtype, n, capacity):
    rng = np.random.default_rng(n)
    grad = np.round(rng.normal(size=n) * 4).astype(dtype) / 4  # ties, zeros
    residual = np.round(rng.normal(size=n) * 4).astype(dtype) / 8
    residual[:3] = -grad[:3]  # acc exactly 0: never selected, even at tau 0
    # tau 3 selects under 1%: most blocks of the one-pass kernel hold none.
    for tau in (0.0, 0.5, 1.25, 3.0, 100.0):
      got = select_one(grad, residual, dtype(tau), capacity)
      want = reference(grad, residual, dtype(tau), capacity)
      for name, g, w in zip(("idx", "val", "residual", "selected"),
                            got[:3] + (got[4],), want):
        self.assertAllEqual(g, w, msg=f"{name} tau {tau}")
      self.assertEqual(got[1].dtype, dtype)
      self.assertEqual(got[3], dtype(tau))  # FIXED keeps tau
      self.assertFalse(got[5])

  @parameterized.named_parameters(
      ("fixed", native.FIXED, (0, 0)), ("refresh", native.REFRESH, (0, 0)),
      # The old tau 0 selects too many: the packed words go back into the
      # accumulator (exactly) before the refresh.
      ("guard_refreshes", native.GUARDED, (1, 10)))
  def test_bfloat16_values_are_round_values_bit_for_bit(self, mode, band):
    # Ties, exponent carries, values either side of TINY, a subnormal and a
    # normal whose error would be subnormal; a scalar residual of 0 keeps
    # the accumulator as it is. m = 50 keeps the tiny values selected.
    grad = reference_bfloat16.tricky_floats(1000, 5)
    zero = np.float32([0.0])
    args = (np.float32(0.0), 900, mode, 50, band)
    idx, val, res, *rest = select_one(grad, zero, *args)
    got_idx, got_val, got_res, *got_rest = select_one(
        grad, zero, *args, value_dtype=tf.bfloat16)
    self.assertEqual(rest[-1], mode == native.GUARDED)
    self.assertAllEqual(got_idx, idx)
    self.assertEqual(got_rest, rest)
    self.assertEqual(got_val.dtype, tf.bfloat16.as_numpy_dtype)
    bits = got_val.view(np.uint16)
    self.assertAllEqual(bits, reference_bfloat16.np_bfloat16_bits(val))
    word, kept = sparse_wire.round_values(
        tf.constant(idx), tf.constant(val), tf.constant(res), "bfloat16")
    self.assertAllEqual(bits, tf.bitcast(word, tf.uint16))
    self.assertAllEqual(got_res.view(np.uint32), kept.numpy().view(np.uint32))
    # Conservation: word + residual is the accumulator's entry to the bit.
    sent = idx[idx < grad.size]
    self.assertTrue(np.any(np.abs(val[:sent.size]) < sparse_wire.TINY))
    whole, want = got_res.copy(), res.copy()
    whole[sent] += reference_bfloat16.np_bfloat16_value(bits[:sent.size])
    want[sent] = val[:sent.size]
    self.assertAllEqual(whole.view(np.uint32), want.view(np.uint32))
    with self.assertRaisesRegex(ValueError, "value_dtype must be None, the "
                                "gradients' dtype or bfloat16 .float32 "
                                "gradients only., got bfloat16 for float64"):
      select_one(grad.astype(np.float64), np.float64([0.0]), 0.0, 5,
                 value_dtype=tf.bfloat16)

  def test_reports_its_run_time(self):
    seconds = native.select(
        [tf.ones([5])], [tf.zeros([5])], tf.constant([0.5]),
        tf.constant([native.FIXED]), [5], [0], [0], [0], ["m"])[-1]
    self.assertEqual(seconds.dtype, tf.float64)
    self.assertEqual(seconds.shape, [])
    self.assertGreater(float(seconds), 0.0)
    self.assertTrue(np.isfinite(float(seconds)))

  def test_scalar_residual_is_added_to_every_entry(self):
    grad = np.array([0.5, -2.0, 3.0, 0.0], np.float32)
    got = select_one(grad, np.float32(1.0), np.float32(2.0), 2)
    want = reference(grad, np.float32(1.0), np.float32(2.0), 2)
    for g, w in zip(got[:3] + (got[4],), want):
      self.assertAllEqual(g, w)
    # A scalar 0 adds nothing: the gradient is the accumulator, -0.0 kept.
    grad = np.array([-0.0, 3.0, -0.5], np.float32)
    got = select_one(grad, np.float32(0.0), np.float32(1.0), 2)
    self.assertAllEqual(got[2], [0.0, 0.0, -0.5])
    self.assertTrue(np.signbit(got[2][0]))

  @parameterized.product(
      bad=[("nan", np.nan, "NaN"), ("inf", -np.inf, "Inf")],
      mode=[native.GUARDED, native.REFRESH, native.FIXED])
  def test_non_finite_gradient_raises_with_the_message(self, bad, mode):
    _, value, kind = bad
    grads = [np.array([1.0, 2.0, 3.0], np.float32),
             np.array([1.0, value, 2.0], np.float32)]
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                f"DCTDP: bad gradient w1 : Tensor had {kind}"):
      native.select([tf.constant(g) for g in grads], [tf.zeros([3])] * 2,
                    tf.constant([1.0, 1.0]), tf.constant([mode] * 2),
                    [2, 2], [1, 1], [1, 1], [2, 2],
                    ["DCTDP: bad gradient w0", "DCTDP: bad gradient w1"])

  def test_bad_arguments_raise(self):
    one = lambda grad, residual, **kw: native.select(
        [grad], [residual], kw.get("taus", tf.constant([1.0])),
        kw.get("modes", tf.constant([native.FIXED])), kw.get("caps", [2]),
        kw.get("below", [0]), [0], [0], ["m"])
    with self.assertRaisesRegex((ValueError, tf.errors.InvalidArgumentError),
                                "rank"):
      one(tf.zeros([2, 2]), tf.zeros([4]))
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "residual must have 4 entries or one"):
      one(tf.zeros([4]), tf.zeros([3]))
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                r"below must be in \[0, 3\), got 3"):
      one(tf.zeros([3]), tf.zeros([3]), below=[3])
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "modes must be 0, 1 or 2, got 5"):
      one(tf.zeros([3]), tf.zeros([3]), modes=tf.constant([5]))
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "taus and modes must have N = 1 entries"):
      one(tf.zeros([3]), tf.zeros([3]), taus=tf.constant([1.0, 2.0]))
    with self.assertRaisesRegex((ValueError, tf.errors.InvalidArgumentError),
                                "capacities"):
      one(tf.zeros([3]), tf.zeros([3]), caps=[2, 2])
    with self.assertRaisesRegex((ValueError, tf.errors.InvalidArgumentError),
                                "capacities must be >= 1"):
      one(tf.zeros([3]), tf.zeros([3]), caps=[0])


class RefreshTest(tf.test.TestCase, parameterized.TestCase):
  """Lines 4-5 (mode REFRESH) and the density guard (mode GUARDED)."""

  def setUp(self):
    super().setUp()
    require_native(self)

  @parameterized.named_parameters(("float32", np.float32), ("float64", np.float64))
  def test_equals_top_k_order_statistic_with_ties(self, dtype):
    rng = np.random.default_rng(2)
    grad = (np.round(rng.normal(size=500) * 3) / 3).astype(dtype)  # many ties
    residual = (np.round(rng.normal(size=500) * 3) / 6).astype(dtype)
    for m in (1, 7, 250, 499):
      got = select_one(grad, residual, dtype(123), 20, native.REFRESH, m)
      want = dct_dp.order_statistic_threshold(
          tf.abs(tf.constant(grad) + tf.constant(residual)), m)
      self.assertEqual(got[3].dtype, dtype)
      self.assertEqual(float(got[3]), float(want), msg=f"m {m}")
      self.assertEqual(float(got[3]), np.sort(np.abs(grad + residual))[m])
      # ... and the selection is that of the new threshold.
      for name, g, w in zip(("idx", "val", "residual", "selected"),
                            got[:3] + (got[4],),
                            reference(grad, residual, got[3], 20)):
        self.assertAllEqual(g, w, msg=f"{name} m {m}")
    scalar = select_one(grad, dtype(0.5), dtype(0), 3, native.REFRESH, 3)
    self.assertEqual(float(scalar[3]), np.sort(np.abs(grad + dtype(0.5)))[3])

  def test_m_zero_selects_every_non_zero_entry(self):
    grad = np.array([0.0, -1.0, 2.0, 0.0], np.float32)
    got = select_one(grad, np.float32(0), np.float32(5), 4, native.REFRESH, 0)
    self.assertEqual(got[3], 0.0)
    self.assertEqual(got[4], 2)
    self.assertAllEqual(got[0], [1, 2, 4, 4])

  def test_extreme_spreads(self):
    rng = np.random.default_rng(3)
    cases = {
        "all_equal": np.full(300, -0.75, np.float32),        # one bucket
        "decades": (rng.choice([-1, 1], 400) * 10.0 ** rng.uniform(
            -30, 30, 400)).astype(np.float32),               # many buckets
        # 0 and subnormals, which TensorFlow's CPU threads flush to zero
        # (the stock op too, so only the stock op is the reference here).
        "zeros_and_tiny": np.concatenate([np.zeros(200), np.full(
            50, 1e-45), np.full(5, 1e-30)]).astype(np.float32),
    }
    for name, grad in cases.items():
      for m in (1, grad.size // 2, grad.size - 1):
        got = select_one(grad, np.float32(0), np.float32(0), 1,
                         native.REFRESH, m)[3]
        # acc = g + E, as DCT-DP's stock path computes it (the add flushes).
        want = dct_dp.order_statistic_threshold(
            tf.abs(tf.constant(grad) + tf.zeros_like(grad)), m)
        self.assertEqual(float(got), float(want), msg=f"{name} m {m}")
        if name != "zeros_and_tiny":
          self.assertEqual(float(got), np.sort(np.abs(grad))[m])

  def test_guard_keeps_tau_inside_the_band_and_refreshes_outside(self):
    grad = np.array([4.0, -3.0, 0.5, -0.0, 2.0, -1.0, 0.25, 8.0], np.float32)
    residual = np.zeros(8, np.float32)
    residual[3] = -0.0  # acc -0.0: never selected, kept as -0.0
    m = 5  # a fresh tau selects 3 (4, -3, 8): w_5 = 3
    # Old tau 1.5 selects 4 entries (4, -3, 2, 8): inside [3, 4], kept.
    got = select_one(grad, residual, np.float32(1.5), 4, native.GUARDED, m,
                     band=(3, 4))
    self.assertEqual((got[3], got[4], got[5]), (1.5, 4, False))
    # Outside [1, 3]: refreshed to w_5 = 3, selecting 4, -3 and 8.
    got = select_one(grad, residual, np.float32(1.5), 4, native.GUARDED, m,
                     band=(1, 3))
    self.assertEqual((got[3], got[4], got[5]), (3.0, 3, True))
    want = reference(grad, residual, np.float32(3.0), 4)
    for name, g, w in zip(("idx", "val", "residual"), got[:3], want):
      self.assertAllEqual(g, w, msg=name)
    self.assertTrue(np.signbit(got[2][3]))  # restored bit for bit
    # Too few (old tau 100 selects none of [1, 3]), with an overflowing
    # capacity of 2 before the refresh restores every packed entry.
    got = select_one(grad, residual, np.float32(100), 2, native.GUARDED, m,
                     band=(1, 3))
    self.assertEqual((got[3], got[4], got[5]), (3.0, 3, True))
    got = select_one(grad, residual, np.float32(0.1), 2, native.GUARDED, m,
                     band=(1, 3))  # 6 selected, 2 packed, then refreshed
    self.assertEqual((got[3], got[4], got[5]), (3.0, 3, True))
    for name, g, w in zip(("idx", "val", "residual"), got[:3],
                          reference(grad, residual, np.float32(3.0), 2)):
      self.assertAllEqual(g, w, msg=name)

  def test_several_variables_each_as_alone(self):
    rng = np.random.default_rng(5)
    sizes, caps, below = [30, 1, 64, 9], [4, 1, 6, 9], [26, 0, 60, 3]
    modes = [native.REFRESH, native.FIXED, native.GUARDED, native.GUARDED]
    bands = [(0, 0), (0, 0), (0, 64), (100, 200)]  # only the last refreshes
    grads = [rng.normal(size=n).astype(np.float32) for n in sizes]
    residuals = [rng.normal(size=n).astype(np.float32) for n in sizes]
    taus = np.float32([0.0, 0.5, 1.0, 0.2])
    got = native.select([tf.constant(g) for g in grads],
                        [tf.constant(r) for r in residuals],
                        tf.constant(taus), tf.constant(modes), caps, below,
                        [b[0] for b in bands], [b[1] for b in bands],
                        ["a", "b", "c", "d"])
    for v in range(4):
      alone = select_one(grads[v], residuals[v], taus[v], caps[v], modes[v],
                         below[v], bands[v])
      for name, g, w in zip(("idx", "val", "residual"), alone[:3],
                            [got[0][v], got[1][v], got[2][v]]):
        self.assertAllEqual(g, w, msg=f"{name} of {v}")
      self.assertEqual(alone[3:], (got[3].numpy()[v], int(got[4][v]),
                                   bool(got[5][v])), msg=f"{v}")
    self.assertAllEqual(got[5], [False, False, False, True])


class WireTest(tf.test.TestCase, parameterized.TestCase):
  """`encode` and `gather_sum` against the stock wire ops."""

  def setUp(self):
    super().setUp()
    require_native(self)

  @parameterized.named_parameters(
      ("int32_float32", "int32", np.float32, 300, 40),
      ("chunk8_float32", "chunk8", np.float32, 1000, 60),
      ("chunk8_wide_counts", "chunk8", np.float32, 3000, 300),  # 2-byte counts
      ("chunk16_float64", "chunk16", np.float64, 70000, 50),
      ("ef_float32", "ef", np.float32, 1000, 60),          # 4 low bits
      ("ef_float64_spills", "ef", np.float64, 70000, 50),  # 10: words cross
      ("ef_no_low_bits", "ef", np.float32, 50, 40))        # b = 0
  def test_matches_stock_encode_decode_scatter_and_count(self, name, dtype, n,
                                                         cap):
    enc = sparse_wire.make_encoding(name, n, cap)
    # A second, short "int32" vector shares each payload.
    short = sparse_wire.make_encoding("int32", 12, 3)
    rng = np.random.default_rng(n)
    payloads, words, vals, positions = [], [], [], []
    for r in range(4):
      used = cap - 3 * r  # some padding, more on later replicas
      pos = np.sort(rng.choice(n, size=used, replace=False))
      pos[: 2] = [0, 1]  # shared by every replica: duplicates across them
      pos = np.sort(np.unique(pos))
      idx = np.full(cap, n, np.int32)
      idx[:pos.size] = pos
      val = rng.normal(size=cap).astype(dtype)
      val[pos.size:] = 0
      if r == 3:
        val[1] = -vals[2][1] - vals[1][1] - vals[0][1]  # may cancel at 1
      short_idx = np.int32([5, 12, r])  # unsorted is fine for "int32"
      short_val = np.asarray([1.0, 9.0, -1.0], dtype)
      payload = native.encode([tf.constant(idx), tf.constant(short_idx)],
                              [tf.constant(val), tf.constant(short_val)],
                              [enc, short])
      # Index words bit for bit as the stock encoder lays them, then values.
      stock = sparse_wire.encode_indices(tf.constant(idx), enc)
      per_value = np.dtype(dtype).itemsize // 4
      self.assertAllEqual(payload[:enc.words], stock)
      self.assertAllEqual(payload[enc.words:enc.words + 3], short_idx)
      self.assertAllEqual(
          tf.bitcast(tf.reshape(payload[enc.words + 3:
                                        enc.words + 3 + cap * per_value],
                                [cap, per_value] if per_value > 1 else [cap]),
                     tf.as_dtype(dtype)), val)
      self.assertEqual(payload.shape[0],
                       enc.words + 3 + (cap + 3) * per_value)
      payloads.append(payload)
      words.append(stock)
      vals.append(val)
      positions.append(idx)
    (dense, short_sum), nnz = native.gather_sum(tf.stack(payloads),
                                                [enc, short], tf.as_dtype(dtype))
    decoded = sparse_wire.decode_indices(tf.stack(words), enc)
    self.assertAllEqual(decoded, np.stack(positions))
    vals = np.stack(vals)
    want = sparse_wire.scatter_sum(tf.reshape(decoded, [-1]), vals.ravel(), n)
    self.assertAllEqual(np.signbit(dense), np.signbit(want))
    self.assertAllEqual(dense, want)  # bit for bit: same order of additions
    self.assertEqual(nnz.dtype, tf.int64)
    self.assertEqual(int(nnz[0]), int(tf.math.count_nonzero(want)))
    # Position 12 is the short vector's padding; 0, 1, 2, 3 from the replicas.
    self.assertAllEqual(short_sum, [-1, -1, -1, -1, 0, 4, 0, 0, 0, 0, 0, 0])
    self.assertEqual(int(nnz[1]), 5)

  @parameterized.named_parameters(("int32_even", "int32", 300, 40),
                                  ("chunk8_odd", "chunk8", 1000, 61),
                                  ("ef_odd", "ef", 1000, 61))
  def test_bfloat16_values_match_the_stock_words_and_sums(self, name, n, cap):
    # Two values to a word (`sparse_wire._pack_halves`, a zero half after an
    # odd count); the sums are float32 sums of the widened values.
    self.assertTrue(native.usable(tf.bfloat16, "/cpu:0"))
    enc = sparse_wire.make_encoding(name, n, cap)
    rng = np.random.default_rng(cap)
    payloads, idxs, vals = [], [], []
    for r in range(3):
      pos = np.sort(rng.choice(n, size=cap - 5 * r, replace=False))
      idx = np.r_[pos, np.full(5 * r, n)].astype(np.int32)
      val = tf.cast(np.r_[reference_bfloat16.tricky_floats(pos.size, r),
                          np.zeros(5 * r)].astype(np.float32), tf.bfloat16)
      payload = native.encode([tf.constant(idx)], [val], [enc])
      self.assertEqual(payload.shape[0], enc.words + (cap + 1) // 2)
      self.assertAllEqual(payload[:enc.words],
                          sparse_wire.encode_indices(tf.constant(idx), enc))
      self.assertAllEqual(payload[enc.words:],
                          sparse_wire._pack_halves(val))  # pylint: disable=protected-access
      payloads.append(payload)
      idxs.append(idx)
      vals.append(tf.cast(val, tf.float32))
    (dense,), nnz = native.gather_sum(tf.stack(payloads), [enc], tf.bfloat16)
    want = sparse_wire.scatter_sum(tf.concat(idxs, 0), tf.concat(vals, 0), n)
    self.assertEqual(dense.dtype, tf.float32)
    self.assertAllEqual(dense.numpy().view(np.uint32),
                        want.numpy().view(np.uint32))
    self.assertEqual(int(nnz[0]), int(tf.math.count_nonzero(want)))

  def test_zeros_and_negative_zero_are_not_counted(self):
    enc = sparse_wire.make_encoding("int32", 9, 4)
    rows = [([3, 3, 5, 9], [2.0, -2.0, -0.0, 7.0]),  # 9: padding
            ([5, 1, 9, 9], [-0.0, 1.0, 0.0, 0.0])]
    payload = tf.stack([native.encode([tf.constant(i, tf.int32)],
                                      [tf.constant(v)], [enc])
                        for i, v in rows])
    (dense,), nnz = native.gather_sum(payload, [enc], tf.float32)
    self.assertAllEqual(dense, [0, 1, 0, 0, 0, 0, 0, 0, 0])
    self.assertFalse(np.signbit(dense[5]))  # +0 + -0 + -0 is +0
    self.assertEqual(int(nnz[0]), 1)

  def test_bad_input_raises(self):
    enc = sparse_wire.make_encoding("chunk8", 300, 4)
    encode = lambda idx: native.encode([tf.constant(idx, tf.int32)],
                                       [tf.zeros([4])], [enc])
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "non-decreasing with the padding last"):
      encode([5, 3, 300, 300])
    encode([5, 5, 300, 300])  # repeated positions are fine
    narrow = sparse_wire.make_encoding("chunk8", 300, 300)  # 2-byte counts
    self.assertEqual(narrow.count_bytes, 2)
    tiny = sparse_wire.make_encoding("chunk8", 300, 4)  # 1-byte counts
    self.assertEqual(tiny.count_bytes, 1)
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "chunk 0 holds 256 positions, more than "
                                "1-byte counts carry"):
      native.encode([tf.fill([256], 7)], [tf.zeros([256])],
                    [dataclasses.replace(tiny, capacity=256)])
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "non-decreasing with the padding last"):
      encode([5, 300, 7, 300])
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                r"must be in \[0, 300\], got 301"):
      encode([5, 301, 300, 300])
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                r"must be in \[0, 300\], got -1"):
      encode([-1, 3, 300, 300])
    with self.assertRaisesRegex((ValueError, tf.errors.InvalidArgumentError),
                                "rank 1 of one length"):
      native.encode([tf.zeros([3], tf.int32)], [tf.zeros([4])], [enc])
    for bad in (dict(count_bytes=5), dict(offset_bytes=0), dict(n=0)):
      with self.assertRaisesRegex(
          tf.errors.InvalidArgumentError,
          r"n must be in \[1, 2\^31 - 1\) and a chunked layout needs 1-4 "
          "bytes per count and per offset"):
        native.encode([tf.constant([0, 1, 2, 3])], [tf.zeros([4])],
                      [dataclasses.replace(enc, **bad)])
    ef = sparse_wire.make_encoding("ef", 300, 4)
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                'non-decreasing with the padding last for the '
                                '"ef" layout'):
      native.encode([tf.constant([9, 4, 300, 300])], [tf.zeros([4])], [ef])
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                r"must be in \[0, 300\], got 301"):
      native.encode([tf.constant([9, 301, 300, 300])], [tf.zeros([4])], [ef])
    for bad in (dict(low_bits=31), dict(low_bits=-2),
                dict(chunk=256, count_bytes=1, offset_bytes=1)):
      with self.assertRaisesRegex(
          tf.errors.InvalidArgumentError,
          r"low_bits must be -1 \(not \"ef\"\) or in \[0, 30\] with chunk 0"):
        native.encode([tf.constant([0, 1, 2, 3])], [tf.zeros([4])],
                      [dataclasses.replace(ef, **bad)])
    good = encode([1, 2, 300, 300])
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "payload must be"):
      native.gather_sum(good[None, :-1], [enc], tf.float32)
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "capacities must be >= 1, got 0"):
      native.gather_sum(good[None], [dataclasses.replace(enc, capacity=0)],
                        tf.float32)
    with self.assertRaisesRegex((ValueError, tf.errors.InvalidArgumentError),
                                r"rank|payload must be \[replicas, 6\]"):
      native.gather_sum(good, [enc], tf.float32)


class LibraryTest(tf.test.TestCase):

  def _fresh(self):
    return mock.patch.dict(native._loaded, clear=True)  # pylint: disable=protected-access

  def test_switched_off_builds_nothing(self):
    with self._fresh(), mock.patch.dict(os.environ, {native.ENV_SWITCH: "0"}), \
        mock.patch.object(native, "build") as build:
      self.assertIsNone(native.library())
      self.assertFalse(native.available())
      build.assert_not_called()
    with self.assertRaisesRegex(RuntimeError, "unavailable"), \
        mock.patch.dict(os.environ, {native.ENV_SWITCH: "off"}):
      select_one(np.zeros(2, np.float32), np.zeros(2, np.float32),
                 np.float32(1), 1)

  def test_failed_build_warns_once_and_falls_back(self):
    cache = self.create_tempdir().full_path
    env = {native.ENV_CACHE: cache, "CXX": "no-such-compiler-tf-dct"}
    with self._fresh(), mock.patch.dict(os.environ, env), \
        self.assertLogs(level="WARNING") as logs:
      self.assertIsNone(native.library())
      self.assertIsNone(native.library())  # remembered, not retried
    self.assertLen(logs.records, 1)
    self.assertIn("no-such-compiler-tf-dct", logs.output[0])
    self.assertEqual(os.listdir(cache), [])  # no half-built file left

  def test_builds_into_the_cache_keyed_by_source_and_tensorflow(self):
    require_native(self)
    cache = self.create_tempdir().full_path
    with mock.patch.dict(os.environ, {native.ENV_CACHE: cache}):
      path = native.library_path()
      self.assertStartsWith(path, cache)
      # Built, not loaded: a second copy of the kernels in this process
      # would register them twice.
      native.build(path)
      self.assertEqual(os.listdir(cache), [os.path.basename(path)])
      self.assertGreater(os.path.getsize(path), 0)
      with mock.patch.object(tf, "__version__", "0.0.0"):
        self.assertNotEqual(native.library_path(), path)

  def test_x86_builds_for_this_cpu_keyed_by_its_instruction_sets(self):
    with mock.patch.object(native.platform, "machine", lambda: "x86_64"):
      self.assertIn("-march=native", native._flags())
      path = native.library_path()
      with mock.patch.object(native, "_cpu_features", lambda: "sse2"):
        self.assertNotEqual(native.library_path(), path)
    with mock.patch.object(native.platform, "machine", lambda: "aarch64"):
      self.assertNotIn("-march=native", native._flags())
      path = native.library_path()
      with mock.patch.object(native, "_cpu_features", lambda: "sse2"):
        self.assertEqual(native.library_path(), path)


if __name__ == "__main__":
  tf.test.main()
