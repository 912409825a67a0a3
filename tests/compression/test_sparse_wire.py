"""Tests for tf_dct.compression.sparse_wire against numpy."""

from unittest import mock

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import tf_dct
from tf_dct import _private
from tf_dct.compression import native, sparse_wire
from tests import util
from tests.compression import reference_bfloat16
from tests.compression import test_native


def setUpModule():
  util.setup_cpus()


def _np_compact(acc, mask, capacity):
  n = acc.size
  positions = np.flatnonzero(mask)[:capacity]
  idx = np.full(capacity, n, np.int32)
  val = np.zeros(capacity, acc.dtype)
  idx[:positions.size] = positions
  val[:positions.size] = acc[positions]
  fitted = np.zeros(n, bool)
  fitted[positions] = True
  return idx, val, positions.size, fitted


class CompactTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("sparse_fits", 50, 0.1, 20),
      ("overflow", 50, 0.6, 10),
      ("exactly_full", 8, 1.0, 8),
      ("nothing_selected", 30, 0.0, 5),
      ("capacity_one", 30, 0.5, 1),
      ("single_entry", 1, 1.0, 1),
      ("capacity_beyond_n", 5, 1.0, 8),
      ("almost_all", 300, 0.97, 290),
  )
  def test_matches_numpy(self, n, density, capacity):
    rng = np.random.default_rng(n + capacity)
    acc = rng.normal(size=n).astype(np.float32)
    mask = rng.uniform(size=n) < density
    want = _np_compact(acc, mask, capacity)
    eager = sparse_wire.compact(tf.constant(acc), tf.constant(mask), capacity)
    jitted = tf.function(lambda a, m: sparse_wire.compact(a, m, capacity),
                         jit_compile=True)(tf.constant(acc), tf.constant(mask))
    given = sparse_wire.compact(  # the caller's prefix count, reused
        tf.constant(acc), tf.constant(mask), capacity,
        ends=tf.constant(np.cumsum(mask).astype(np.int32)))
    for got in (eager, jitted, given):
      idx, val, count, fitted = [t.numpy() for t in got]
      self.assertEqual(idx.dtype, np.int32)
      self.assertAllEqual(idx, want[0])
      self.assertAllEqual(val, want[1])
      self.assertEqual(count, want[2])
      self.assertAllEqual(fitted, want[3])
      # What did not fit is exactly the selected remainder.
      self.assertAllEqual(mask & ~fitted, mask & ~want[3])

  @parameterized.named_parameters(
      ("one_segment", [50], [20], 0.3),
      ("mixed", [7, 1, 130, 64, 3], [3, 1, 20, 64, 1], 0.4),
      ("overflow_everywhere", [40, 65, 9], [2, 5, 1], 0.9),
      ("nothing_selected", [10, 20], [4, 4], 0.0),
      ("all_selected", [5, 70], [5, 70], 1.0),
  )
  def test_segments_match_compact_of_each_segment(self, sizes, caps, density):
    rng = np.random.default_rng(sum(sizes) + len(caps))
    n = sum(sizes)
    acc = rng.normal(size=n).astype(np.float32)
    mask = rng.uniform(size=n) < density
    starts = np.cumsum([0] + sizes)
    want = [_np_compact(acc[a:b], mask[a:b], c)
            for a, b, c in zip(starts[:-1], starts[1:], caps)]

    def run(a, m):
      return sparse_wire.compact_segments(a, m, sparse_wire.prefix_count(m),
                                          sizes, caps)

    eager = run(tf.constant(acc), tf.constant(mask))
    jitted = tf.function(run, jit_compile=True)(tf.constant(acc),
                                                tf.constant(mask))
    for got in (eager, jitted):
      idx, val, selected, fitted = [t.numpy() for t in got]
      self.assertEqual(idx.dtype, np.int32)
      self.assertAllEqual(idx, np.concatenate([w[0] for w in want]))
      self.assertAllEqual(val, np.concatenate([w[1] for w in want]))
      self.assertAllEqual(fitted, np.concatenate([w[3] for w in want]))
      self.assertAllEqual(selected, [mask[a:b].sum()
                                     for a, b in zip(starts[:-1], starts[1:])])

  def test_segments_bad_arguments(self):
    flat, mask = tf.zeros([6]), tf.ones([6], tf.bool)
    ends = sparse_wire.prefix_count(mask)
    with self.assertRaisesRegex(ValueError, "compact_segments: flat, mask and "
                                "ends \\(int32\\) must be rank 1 of length "
                                "sum\\(sizes\\) = 5"):
      sparse_wire.compact_segments(flat, mask, ends, [2, 3], [1, 1])
    with self.assertRaisesRegex(ValueError, "must be rank 1"):
      sparse_wire.compact_segments(flat, mask, tf.cast(ends, tf.int64), [6], [1])
    with self.assertRaisesRegex(ValueError, "capacities must hold one int in "
                                "\\[1, size\\] per segment"):
      sparse_wire.compact_segments(flat, mask, ends, [2, 4], [3, 1])
    with self.assertRaisesRegex(ValueError, "capacities must hold one int"):
      sparse_wire.compact_segments(flat, mask, ends, [2, 4], [1])
    with self.assertRaisesRegex(ValueError, "capacities must hold one int"):
      sparse_wire.compact_segments(flat, mask, ends, [2, 4], [0, 1])

  @parameterized.named_parameters(
      ("one", 1), ("block", 64), ("block_plus_one", 65), ("ragged", 1000),
      ("many_blocks", 64 * 70 + 3))
  def test_prefix_count_matches_cumsum(self, n):
    rng = np.random.default_rng(n)
    for density in (0.0, 0.03, 0.5, 1.0):
      mask = rng.uniform(size=n) < density
      want = np.cumsum(mask.astype(np.int32))
      eager = sparse_wire.prefix_count(tf.constant(mask))
      jitted = tf.function(sparse_wire.prefix_count, jit_compile=True)(
          tf.constant(mask))
      for got in (eager, jitted):
        self.assertEqual(got.dtype, tf.int32)
        self.assertAllEqual(got, want)

  def test_scatter_sum_drops_padding_and_sums_duplicates(self):
    idx = tf.constant([0, 2, 2, 4, 4], tf.int32)  # n = 4: index 4 is padding
    val = tf.constant([1.0, 2.0, 3.0, 7.0, -9.0])  # padding values never count
    jitted = tf.function(sparse_wire.scatter_sum, jit_compile=True)
    for scatter in (sparse_wire.scatter_sum, jitted):
      self.assertAllEqual(scatter(idx, val, 4), [1.0, 0.0, 5.0, 0.0])

  def test_bad_arguments(self):
    acc = tf.zeros([4])
    mask = tf.ones([4], tf.bool)
    with self.assertRaisesRegex(ValueError, "capacity must be a Python int >= 1"):
      sparse_wire.compact(acc, mask, 0)
    with self.assertRaisesRegex(ValueError, "acc_flat must be rank 1"):
      sparse_wire.compact(tf.zeros([2, 2]), mask, 2)
    with self.assertRaisesRegex(ValueError, "prefix_count: mask must be a rank-1 bool "
                                "tensor of static length, got int32"):
      sparse_wire.prefix_count(tf.zeros([4], tf.int32))
    with self.assertRaisesRegex(ValueError, "prefix_count: mask must be a rank-1 bool"):
      sparse_wire.prefix_count(tf.zeros([2, 2], tf.bool))
    dynamic = tf.function(sparse_wire.prefix_count, input_signature=[
        tf.TensorSpec([None], tf.bool)])
    with self.assertRaisesRegex(ValueError, "of static length, got bool \\(None,\\)"):
      dynamic.get_concrete_function()
    with self.assertRaisesRegex(ValueError, "ends must be int32 of the mask's shape"):
      sparse_wire.compact(acc, mask, 2, ends=tf.zeros([3], tf.int32))
    with self.assertRaisesRegex(ValueError, "ends must be int32"):
      sparse_wire.compact(acc, mask, 2, ends=tf.zeros([4], tf.int64))


def exact_index_words(enc, used):
  """Index words sent with exact sizes when `used` slots hold a position."""
  if enc.name == "int32":
    return used
  if enc.name != "ef":
    return (enc.count_words if used else 0) + -(-used * enc.offset_bytes // 4)
  # The stream of the used slots, laid out for (n, used): b low bits each,
  # then a bitmap of ((n - 1) >> b) + used bits.
  if not used:
    return 0
  b = max(0, int(np.floor(np.log2(enc.n / used))))
  return -(-(used * b + ((enc.n - 1) >> b) + used) // 32)


class ExchangeTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("exact_string", {"exact": "yes"}, r"exact must be None, True or False, got 'yes'"),
      ("exact_int", {"exact": 1}, r"exact must be None, True or False, got 1"),
      ("payload_none", {"payload": None}, r"payload must be True or False, got None"),
      ("payload_int", {"payload": 0}, r"payload must be True or False, got 0"),
      ("nnz", {"nnz": "no"}, r"nnz must be True or False, got 'no'"),
      ("presorted", {"presorted": 1}, r"presorted must be True or False, got 1"),
      ("use_native", {"use_native": None},
       r"use_native must be True or False, got None"),
      ("encoding", {"encoding": "chunk4"}, r"encoding must be 'auto' or one of "
       r"\('int32', 'chunk16', 'chunk8', 'ef'\), got 'chunk4'"))
  def test_bad_arguments_are_rejected_before_any_op(self, kwargs, pattern):
    graph = tf.Graph()
    with graph.as_default():
      buffers = [(tf.constant([0, 4], tf.int32), tf.constant([1.0, 0.0]), 4)]
      before = len(graph.get_operations())
      with self.assertRaisesRegex(ValueError, f"^exchange_many: {pattern}$"):
        sparse_wire.exchange_many(None, buffers, **kwargs)
      self.assertLen(graph.get_operations(), before)

  def test_exact_sizes_are_rejected_under_xla(self):
    @tf.function(jit_compile=True)
    def step(exact):
      return sparse_wire.exchange_many(None, [], exact=exact)

    with self.assertRaisesRegex(ValueError, r"exchange_many: exact must be None or "
                                r"False under XLA, got True \(exact sizes vary"):
      step(True)
    self.assertEqual(step(None), [])  # None: the fixed capacity under XLA

  def test_sums_every_replica_on_four_replicas(self):
    n, capacity = 12, 5
    replicas = util.NUM_CPUS
    rng = np.random.default_rng(1)
    accs = [rng.normal(size=n).astype(np.float32) for _ in range(replicas)]
    # Overlapping selections (duplicate positions across replicas), one
    # replica overflowing and one sending nothing (all padding).
    masks = [np.arange(n) < 4, np.arange(n) % 2 == 0, np.arange(n) >= 10,
             np.zeros(n, bool)]
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)])

    def fn():
      ctx = tf.distribute.get_replica_context()
      r = tf.get_static_value(ctx.replica_id_in_sync_group)
      idx, val, count, _ = sparse_wire.compact(
          tf.constant(accs[r]), tf.constant(masks[r]), capacity)
      single = sparse_wire.exchange(ctx, idx, val, n)
      # Batched form: several vectors in one all-gather.
      many = sparse_wire.exchange_many(ctx, [(idx, val, n), (idx, val * 2, n)])
      return single, many, count

    out = util.local(repl, tf.function(lambda: repl.run(fn))())
    want = np.zeros(n, np.float64)
    for acc, mask in zip(accs, masks):
      fitted = _np_compact(acc, mask, capacity)[3]
      want += np.where(fitted, acc, 0)
    for single, many, _ in out:
      self.assertAllClose(single, want, atol=1e-6, rtol=0)
      self.assertAllClose(many[0], want, atol=1e-6, rtol=0)
      self.assertAllClose(many[1], 2 * want, atol=1e-6, rtol=0)
      self.assertAllEqual(single, out[0][0])  # identical on every replica
    self.assertEqual([o[2] for o in out], [4, 5, 2, 0])

  @parameterized.named_parameters(
      ("stock", False, [tf.int32, tf.float64]),
      ("native", None, [tf.int32, tf.int32]))
  def test_many_vectors_and_dtypes_share_one_gather_per_dtype(self, use_native,
                                                                streams):
    # Stock ops: float32 values travel with the int32 index words (one
    # stream), float64 values in a second stream. Native kernels: one int32
    # payload per value dtype. Either way one all-gather call of 2 tensors
    # per replica for 5 vectors of different encodings, instead of 10 tensors.
    if use_native is None:
      test_native.require_native(self)
      use_native = True
    replicas = 2
    rng = np.random.default_rng(4)
    specs = [(300, 6, tf.float32, "chunk8"), (12, 5, tf.float32, "int32"),
             (40, 3, tf.float64, "auto"), (70000, 4, tf.float32, "chunk16"),
             (900, 8, tf.float32, "ef")]
    data = [[(np.sort(rng.choice(n, cap, replace=False)).astype(np.int32),
              rng.normal(size=cap).astype(dtype.as_numpy_dtype))
             for n, cap, dtype, _ in specs] for _ in range(replicas)]
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)])

    calls = []

    class Counting:
      """The replica context, counting all-gather calls and their tensors."""

      def __init__(self, ctx):
        self._ctx = ctx

      def __getattr__(self, name):
        return getattr(self._ctx, name)

      def all_gather(self, value, axis):
        calls.append([t.dtype for t in tf.nest.flatten(value)])
        return self._ctx.all_gather(value, axis)

    def fn():
      ctx = tf.distribute.get_replica_context()
      r = tf.get_static_value(ctx.replica_id_in_sync_group)
      many = sparse_wire.exchange_many(
          Counting(ctx), [(tf.constant(i), tf.constant(v), n)
                          for (i, v), (n, _, _, _) in zip(data[r], specs)],
          presorted=True, use_native=use_native)
      single = [sparse_wire.exchange_many(
          ctx, [(tf.constant(i), tf.constant(v), n)], encoding=enc,
          presorted=True, use_native=False)[0]
                for (i, v), (n, _, _, enc) in zip(data[r], specs)]
      return many, single

    out = util.local(repl, tf.function(lambda: repl.run(fn))())
    self.assertEqual(calls, [streams] * replicas)
    for many, single in out:
      for t, (n, _, dtype, _) in enumerate(specs):
        want = np.zeros(n)
        for r in range(replicas):
          np.add.at(want, data[r][t][0], data[r][t][1])
        self.assertEqual(many[t].dtype, dtype.as_numpy_dtype)
        self.assertAllClose(many[t], want, atol=1e-6, rtol=0)
        self.assertAllEqual(many[t], single[t])

  def test_native_and_stock_agree_bit_for_bit(self):
    # On CPU the native kernels encode a replica's buffers into one payload
    # and decode, sum and count them; the stock ops batch the short buffers
    # and take the long ones (above BATCH_CAPACITY) one by one.
    test_native.require_native(self)
    replicas = 2
    rng = np.random.default_rng(8)
    specs = [(3000, 200, tf.float32, "chunk8"), (900, 150, tf.float32, "int32"),
             (70000, 300, tf.float64, "chunk16"), (5000, 140, tf.float32, "auto"),
             (400, 20, tf.float32, "chunk8"), (60, 9, tf.float64, "int32"),
             (4000, 130, tf.float64, "ef"), (700, 12, tf.float32, "ef")]
    data = []
    for r in range(replicas):
      per = []
      for n, cap, dtype, _ in specs:
        used = cap - 7 * r  # padding on the second replica
        idx = np.full(cap, n, np.int32)
        idx[:used] = np.sort(rng.choice(n, used, replace=False))
        val = rng.normal(size=cap).astype(dtype.as_numpy_dtype)
        val[used:] = 0
        per.append((idx, val))
      data.append(per)
    data[1][0][0][:3] = data[0][0][0][:3]  # shared positions ...
    data[1][0][1][:3] = -data[0][0][1][:3]  # ... that cancel to exact zeros
    idx, val = data[1][0]
    used = idx < specs[0][0]
    assert len(set(idx[used])) == used.sum()  # still distinct
    order = np.argsort(idx[used], kind="stable")  # increasing again
    idx[used], val[used] = idx[used][order], val[used][order]
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)])

    def fn(use_native, together):
      ctx = tf.distribute.get_replica_context()
      r = tf.get_static_value(ctx.replica_id_in_sync_group)
      buffers = [(tf.constant(i), tf.constant(v), n)
                 for (i, v), (n, _, _, _) in zip(data[r], specs)]
      if together:  # "auto" for every buffer, one exchange
        sums, counts = sparse_wire.exchange_many(
            ctx, buffers, presorted=True, nnz=True, use_native=use_native)
        return [([s], [c]) for s, c in zip(sums, counts)]
      return [sparse_wire.exchange_many(
          ctx, [buffer], encoding=enc, presorted=True, nnz=True,
          use_native=use_native) for buffer, (_, _, _, enc) in zip(buffers, specs)]

    runs = {}
    for use_native, together in ((True, False), (False, False), (True, True),
                                 (False, True)):
      step = tf.function(lambda u=use_native, t=together: repl.run(
          fn, args=(u, t)))
      graph = step.get_concrete_function().graph.as_graph_def()
      kinds = [node.op for node in graph.node]
      # Together: per replica one payload per value dtype, one decode each.
      self.assertEqual(kinds.count("TfDctEncode"),
                       use_native * replicas * (2 if together else len(specs)))
      self.assertEqual(kinds.count("TfDctGatherSum"),
                       kinds.count("TfDctEncode"))
      runs[(use_native, together)] = util.local(repl, step())
    for r in range(replicas):  # "auto" in one exchange: the same sums
      for t in range(len(specs)):
        for use_native in (True, False):
          self.assertAllEqual(runs[(use_native, True)][r][t][0][0],
                              runs[(True, False)][r][t][0][0])
          self.assertEqual(int(runs[(use_native, True)][r][t][1][0]),
                           int(runs[(True, False)][r][t][1][0]))
    runs = {u: runs[(u, False)] for u in (True, False)}
    for r in range(replicas):
      for t, (n, _, dtype, _) in enumerate(specs):
        (fast, fast_nnz), (slow, slow_nnz) = (runs[True][r][t],
                                              runs[False][r][t])
        want = np.zeros(n, dtype.as_numpy_dtype)
        for q in range(replicas):
          np.add.at(want, data[q][t][0][data[q][t][0] < n],
                    data[q][t][1][data[q][t][0] < n])
        self.assertAllEqual(fast[0], slow[0])
        self.assertAllClose(fast[0], want, atol=1e-6, rtol=0)
        self.assertEqual(int(fast_nnz[0]), int(slow_nnz[0]))
        self.assertEqual(int(fast_nnz[0]), np.count_nonzero(slow[0]))
    # The cancelled positions are exact zeros and not counted.
    shared = data[0][0][0][:3]
    union = set(data[0][0][0][data[0][0][0] < 3000]) | set(
        data[1][0][0][data[1][0][0] < 3000])
    sums, counts = runs[True][0][0]
    self.assertAllEqual(sums[0][shared], np.zeros(3))
    self.assertEqual(int(counts[0]), len(union) - 3)

  @parameterized.named_parameters(("stock", False), ("native", True))
  def test_exact_sizes_give_the_fixed_capacity_bits(self, use_native):
    # Each replica sends only its used slots: one replica none, one all;
    # every encoding, short and long buffers, float32 and float64 (and
    # float16 with stock ops). The sums and non-zero counts are those of the
    # fixed-capacity exchange, bit for bit, and the bytes reported are those
    # of the tensors handed to the all-gather, padded by TensorFlow to the
    # longest replica's, plus the int32 length it gathers first.
    if use_native:
      test_native.require_native(self)
    replicas = util.NUM_CPUS
    rng = np.random.default_rng(11)
    specs = [(3000, 200, tf.float32, "chunk8"), (900, 150, tf.float32, "int32"),
             (70000, 300, tf.float64, "chunk16"), (400, 20, tf.float32, "auto"),
             (60, 9, tf.float64, "int32"), (500, 30, tf.float32, "chunk16")]
    if not use_native:
      specs.append((50, 7, tf.float16, "chunk8"))
    used = [[0] * len(specs), [cap for _, cap, _, _ in specs],
            [cap // 3 for _, cap, _, _ in specs], [1] * len(specs)]
    data = [[(np.r_[np.sort(rng.choice(n, u, replace=False)),
                    np.full(cap - u, n)].astype(np.int32),
              np.r_[rng.normal(size=u), np.zeros(cap - u)].astype(
                  dtype.as_numpy_dtype))
             for (n, cap, dtype, _), u in zip(specs, used[r])]
            for r in range(replicas)]
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)])
    handed = {}  # (exact, replica) -> bytes of each tensor handed to the all-gather

    class Recording:
      def __init__(self, ctx, key):
        self._ctx, self._key = ctx, key

      def __getattr__(self, name):
        return getattr(self._ctx, name)

      def all_gather(self, value, axis):
        handed[self._key] = [tf.size(t) * t.dtype.size
                             for t in tf.nest.flatten(value)]
        return self._ctx.all_gather(value, axis)

    def fn(exact):
      ctx = tf.distribute.get_replica_context()
      r = tf.get_static_value(ctx.replica_id_in_sync_group)
      buffers = [(tf.constant(i), tf.constant(v), n)
                 for (i, v), (n, _, _, _) in zip(data[r], specs)]
      sums, counts, sent = sparse_wire.exchange_many(
          Recording(ctx, (exact, int(r))), buffers, encoding="auto", presorted=True,
          nnz=True, use_native=use_native, payload=True, exact=exact)
      return sums, counts, sent, handed[(exact, int(r))]

    fixed, exact = (util.local(repl, tf.function(
        lambda e=e: repl.run(fn, args=(e,)))()) for e in (False, True))
    for r in range(replicas):
      for t, (n, cap, dtype, _) in enumerate(specs):
        self.assertAllEqual(exact[r][0][t], fixed[r][0][t])
        self.assertEqual(int(exact[r][1][t]), int(fixed[r][1][t]))
        enc = sparse_wire.make_encoding("auto", n, cap)
        self.assertEqual(fixed[r][2][t], enc.index_bytes + cap * dtype.size)
      # Per tensor, TensorFlow pads to the longest replica's and gathers a
      # length first; the bytes reported add up to that.
      longest = np.max([[int(b) for b in exact[q][3]] for q in range(replicas)],
                       axis=0)
      self.assertEqual(sum(float(b) for b in exact[r][2]),
                       float(longest.sum() + 4 * longest.size))
      # A vector other than the first carries its used index words and values.
      for t, ((n, cap, dtype, _), u) in enumerate(zip(specs, used[r])):
        if t == 0:
          continue
        enc = sparse_wire.make_encoding("auto", n, cap)
        words = exact_index_words(enc, u)
        self.assertEqual(float(exact[r][2][t]), 4 * words + u * dtype.size,
                         msg=f"replica {r} vector {t}")
    # Replica 1 fills every slot, so each tensor crosses at its full length:
    # the fixed payload plus the counts header (one word per vector and the
    # row length) and TensorFlow's length word per tensor.
    streams = len(exact[0][3])
    self.assertEqual(sum(float(b) for b in exact[0][2]),
                     sum(fixed[0][2]) + 4 * (len(specs) + 1) + 4 * streams)

  def test_one_worker_sends_the_fixed_capacity_by_default(self):
    # The replicas of one process span one worker: exact=None sends every
    # buffer at its capacity (the payload reported is `wire_bytes`, a Python
    # int); exact=True forces the used slots only (a float64 tensor).
    repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"])
    self.assertEqual(_private.num_workers(repl), 1)
    idx, val = [0, 5, 40, 40], [1.0, 2.0, 0.0, 0.0]

    def fn(exact):
      ctx = tf.distribute.get_replica_context()
      buffers = [(tf.constant(idx, tf.int32), tf.constant(val), 40)]
      sums, sent = sparse_wire.exchange_many(ctx, buffers, presorted=True,
                                             payload=True, exact=exact)
      return sums[0], tf.cast(sent[0], tf.float64)

    default, forced = (util.local(repl, tf.function(
        lambda e=e: repl.run(fn, args=(e,)))()) for e in (None, True))
    expected = np.zeros(40, np.float32)
    expected[[0, 5]] = [2.0, 4.0]
    for r in range(2):
      self.assertAllEqual(default[r][0], expected)
      self.assertAllEqual(forced[r][0], expected)
      self.assertEqual(default[r][1], sparse_wire.wire_bytes(40, 4, tf.float32))
      # 2 used slots: their index words and values, the counts header and
      # TensorFlow's length word.
      words = exact_index_words(sparse_wire.make_encoding("auto", 40, 4), 2)
      self.assertEqual(float(forced[r][1]), 4 * (words + 2 + 2) + 4)

  def test_compiles_with_xla_on_one_replica(self):
    repl = tf_dct.Replicator(["/cpu:0"], jit_compile=True)
    acc = np.array([0.5, -2.0, 0.1, 3.0], np.float32)

    def step_fn(a):
      ctx = tf.distribute.get_replica_context()
      idx, val, _, _ = sparse_wire.compact(a, tf.abs(a) >= 0.5, 2)
      return sparse_wire.exchange(ctx, idx, val, 4)

    out = repl.run(step_fn, lambda ctx: tf.data.Dataset.from_tensors(acc).repeat())
    step = repl._steps[(step_fn, next(iter(repl._inputs)))]  # pylint: disable=protected-access
    self.assertTrue(step.replicated_step._jit_compile)  # pylint: disable=protected-access
    self.assertAllEqual(out, [0.5, -2.0, 0.0, 0.0])


def _np_ef_encode(idx, n, capacity):
  """The "ef" words of positions `idx` (padding n), from the definition: a
  little-endian bit stream of each slot's low b bits at fixed width, then a
  bitmap of ((n - 1) >> b) + capacity bits where the i-th position p sets
  bit (p >> b) + i."""
  b = max(0, int(np.floor(np.log2(n / capacity))))
  stream = [0] * (capacity * b + ((n - 1) >> b) + capacity)
  for i, p in enumerate(int(p) for p in idx if p < n):
    for k in range(b):
      stream[i * b + k] = (p >> k) & 1
    stream[capacity * b + (p >> b) + i] = 1
  stream += [0] * (-len(stream) % 32)
  return np.array([sum(bit << k for k, bit in enumerate(stream[w:w + 32]))
                   for w in range(0, len(stream), 32)], np.uint32).view(np.int32)


def _np_ef_decode(words, n, capacity):
  """Inverse of `_np_ef_encode`: int32[capacity] positions, padding n."""
  b = max(0, int(np.floor(np.log2(n / capacity))))
  bits = [(int(w) >> k) & 1 for w in np.asarray(words).view(np.uint32)
          for k in range(32)]
  bitmap = bits[capacity * b:capacity * b + ((n - 1) >> b) + capacity]
  idx = np.full(capacity, n, np.int32)
  for i, q in enumerate(np.flatnonzero(bitmap)):
    low = sum(bits[i * b + k] << k for k in range(b))
    idx[i] = ((q - i) << b) | low
  return idx


def _sorted_positions(n, capacity, count, seed):
  """int32[capacity]: `count` increasing distinct positions, then padding n."""
  rng = np.random.default_rng(seed)
  idx = np.full(capacity, n, np.int32)
  idx[:count] = np.sort(rng.choice(n, size=count, replace=False))
  return idx


class EncodingTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      # (n, capacity, count); chunk8 with capacity >= 256 needs 2-byte counts,
      # n = 70000 gives a partial last chunk for both chunk sizes.
      ("small", 40, 4, 3),
      ("partial_chunks", 70000, 300, 300),
      ("empty", 1000, 17, 0),
      ("full", 9, 9, 9),
  )
  def test_round_trip_eager_and_xla(self, n, capacity, count):
    idx = _sorted_positions(n, capacity, count, seed=n)
    for name in sparse_wire.ENCODINGS:
      enc = sparse_wire.make_encoding(name, n, capacity)
      encode = lambda i, e=enc: sparse_wire.encode_indices(i, e)
      decode = lambda w, e=enc: sparse_wire.decode_indices(w, e)
      words = encode(tf.constant(idx))
      self.assertEqual(words.dtype, tf.int32)
      self.assertEqual(words.shape, [enc.words])
      self.assertAllEqual(decode(words), idx, msg=name)
      jit_words = tf.function(encode, jit_compile=True)(tf.constant(idx))
      self.assertAllEqual(jit_words, words, msg=name)
      self.assertAllEqual(tf.function(decode, jit_compile=True)(jit_words),
                          idx, msg=name)
      # Several replicas' words decode in one call, row by row, whatever
      # each row's count (here count, 0 and all slots).
      rows = np.stack([idx, _sorted_positions(n, capacity, 0, seed=1),
                       _sorted_positions(n, capacity, capacity, seed=2)])
      batch = tf.stack([encode(tf.constant(r)) for r in rows])
      for dec in (decode, tf.function(decode, jit_compile=True)):
        self.assertAllEqual(dec(batch), rows, msg=name)

  @parameterized.named_parameters(
      # (n, capacity, count): b = floor(log2(n / capacity)).
      ("b6_partial", 1000, 10, 7),          # n not a multiple of 2^6
      ("b0", 50, 40, 40),                   # capacity > n / 2: no low bits
      ("b0_over_n", 5, 8, 5),               # more slots than entries
      ("empty", 1000, 17, 0),
      ("full", 64, 16, 16),                 # n a multiple of 2^b, all slots
      ("one", 1, 1, 1),
      ("spills", 70000, 300, 299),          # b = 7: lows cross word edges
      ("wide", 2**20 + 3, 17, 17),          # b = 15
  )
  def test_ef_matches_numpy_reference(self, n, capacity, count):
    enc = sparse_wire.make_encoding("ef", n, capacity)
    self.assertEqual(enc.low_bits, max(0, int(np.floor(np.log2(n / capacity)))))
    rows = []
    for seed in range(3):
      idx = _sorted_positions(n, capacity, count, seed=seed)
      if count:
        idx[count - 1] = n - 1 if seed == 0 else idx[count - 1]  # the largest
      if count > 1 and seed == 1:
        idx[0] = 0
      rows.append(idx)
    want = np.stack([_np_ef_encode(i, n, capacity) for i in rows])
    for i, w in zip(rows, want):
      self.assertAllEqual(_np_ef_decode(w, n, capacity), i)
    self.assertEqual(want.shape[1], enc.words)
    encode = lambda i: sparse_wire.encode_indices(i, enc)
    decode = lambda w: sparse_wire.decode_indices(w, enc)
    for enc_fn, dec_fn in ((encode, decode),
                           (tf.function(encode, jit_compile=True),
                            tf.function(decode, jit_compile=True))):
      got = np.stack([enc_fn(tf.constant(i)).numpy() for i in rows])
      self.assertAllEqual(got, want)
      self.assertAllEqual(dec_fn(tf.constant(want)), np.stack(rows))
      self.assertAllEqual(dec_fn(tf.constant(want[0])), rows[0])

  def test_ef_words_by_hand(self):
    # n = 100, capacity 4: b = floor(log2(25)) = 4; 16 low bits, then a
    # bitmap of (99 >> 4) + 4 = 10 bits: 26 bits, one word. Positions 3, 17,
    # 99 and a padding slot: lows 3, 1, 3, 0 at bits 0, 4, 8, 12; highs 0,
    # 1, 6 set bitmap bits 0 + 0, 1 + 1, 6 + 2 = bits 16, 18, 24.
    enc = sparse_wire.make_encoding("ef", 100, 4)
    self.assertEqual((enc.low_bits, enc.high_bits, enc.bits, enc.words),
                     (4, 10, 26, 1))
    words = sparse_wire.encode_indices(tf.constant([3, 17, 99, 100]), enc)
    want = 3 | 1 << 4 | 3 << 8 | 1 << 16 | 1 << 18 | 1 << 24
    self.assertAllEqual(words, [want])
    self.assertAllEqual(sparse_wire.decode_indices(words, enc), [3, 17, 99, 100])
    # Repeated positions (several replicas' entries in one buffer) still
    # set distinct bitmap bits.
    words = sparse_wire.encode_indices(tf.constant([17, 17, 100, 100]), enc)
    self.assertAllEqual(sparse_wire.decode_indices(words, enc),
                        [17, 17, 100, 100])

  def test_bad_sizes_are_rejected_before_anything_runs(self):
    for name in ("auto", "ef", "int32"):
      with self.assertRaisesRegex(ValueError, r"capacity must be >= 1, got 0"):
        sparse_wire.make_encoding(name, 10, 0)
      with self.assertRaisesRegex(ValueError,
                                  r"n must be in \[1, 2147483646\], got 0"):
        sparse_wire.make_encoding(name, 0, 3)
    with self.assertRaisesRegex(ValueError, "capacity must be an int"):
      sparse_wire.make_encoding("ef", 10, 2.0)

  def test_packing_is_byte_exact(self):
    # 5 one-byte offsets take 2 words (not 5); counts of one chunk, 1 word.
    enc = sparse_wire.make_encoding("chunk8", 200, 5)
    self.assertEqual((enc.count_bytes, enc.count_words, enc.offset_words), (1, 1, 2))
    idx = tf.constant([3, 7, 255 - 56, 199, 200], tf.int32)  # 200 = padding
    words = sparse_wire.encode_indices(idx, enc).numpy()
    raw = words.view(np.uint8)
    self.assertEqual(raw[0], 4)                         # count of chunk 0
    self.assertAllEqual(raw[4:8], [3, 7, 199, 199])     # offsets, 4 per word
    self.assertAllEqual(raw[8:12], [0, 0, 0, 0])        # padding slot + fill

  def test_auto_choice(self):
    # (n, capacity): int32 words vs chunk16 vs chunk8 vs ef, counted by
    # hand; ef is capacity b + ((n - 1) >> b) + capacity bits in words, b =
    # floor(log2(n / capacity)). Ties keep the earlier layout.
    cases = {
        (100, 1): "int32",               # 1 vs 1+1 vs 1+1 vs (6+1+1)/32: 1
        (40, 4): "ef",                   # 4 vs 1+2 vs 1+1 vs (12+4+4)/32: 1
        (9, 9): "ef",                    # 9 vs 1+3 vs 1+3 vs (0+8+9)/32: 1
        (1_000_000, 20_000): "ef",       # 20000 vs 8+10000 vs 1954+5000 vs
                                         # (100000+31249+20000)/32: 4727
        (1_000_000, 2_000): "ef",        # 2000 vs 8+1000 vs 1954+500 vs
                                         # (16000+3906+2000)/32: 685
        (2**20, 64): "ef",               # 64 vs 4+32 vs 1024+16 vs
                                         # (896+63+64)/32: 32
    }
    for (n, cap), want in cases.items():
      self.assertEqual(sparse_wire.choose_encoding(n, cap).name, want,
                       msg=f"n={n}, capacity={cap}")
    enc = sparse_wire.choose_encoding(1_000_000, 20_000)
    self.assertEqual(enc.index_bytes, 4 * 4727)
    self.assertEqual(sparse_wire.make_encoding("chunk8", 1_000_000, 20_000).words,
                     1954 + 5000)
    self.assertEqual(sparse_wire.wire_bytes(1_000_000, 20_000, tf.float32),
                     4 * 4727 + 4 * 20_000)
    self.assertEqual(sparse_wire.wire_bytes(1_000_000, 20_000, tf.float32,
                                            "int32"), 8 * 20_000)
    with self.assertRaisesRegex(ValueError, "index encoding must be"):
      sparse_wire.make_encoding("uint4", 10, 2)

  def test_batched_layout_matches_one_vector_at_a_time(self):
    # Every layout and count width (counts of 1, 2 and 4 bytes, chunk8,
    # chunk16, int32), full, partial and empty buffers: the batched words
    # are the per-vector words laid end to end, and decode back, eager and
    # under XLA, on several replicas' rows at once.
    specs = [("chunk8", 300, 6, 4), ("int32", 12, 5, 5), ("chunk16", 70000, 4, 0),
             ("chunk8", 2000, 300, 300), ("chunk16", 70000, 70000, 9),
             ("chunk8", 40, 4, 3), ("int32", 9, 1, 0)]
    encs = [sparse_wire.make_encoding(name, n, cap) for name, n, cap, _ in specs]
    self.assertEqual([encs[i].count_bytes for i in (0, 3, 4)], [1, 2, 4])
    rows = [[_sorted_positions(n, cap, count if r == 0 else (r * 7) % (cap + 1),
                               seed=10 * r + i)
             for i, (_, n, cap, count) in enumerate(specs)] for r in range(3)]
    layout = sparse_wire._Layout(encs)  # pylint: disable=protected-access
    want_words = np.stack([np.concatenate(
        [sparse_wire.encode_indices(tf.constant(i), e).numpy()
         for i, e in zip(row, encs)]) for row in rows])
    encode = lambda i: layout.encode(i)
    decode = lambda w: layout.decode(w)
    for enc_fn, dec_fn in ((encode, decode),
                           (tf.function(encode, jit_compile=True),
                            tf.function(decode, jit_compile=True))):
      words = np.stack([enc_fn(tf.constant(np.concatenate(row))).numpy()
                        for row in rows])
      self.assertAllEqual(words, want_words)
      self.assertAllEqual(dec_fn(tf.constant(words)),
                          [np.concatenate(row) for row in rows])
    with self.assertRaisesRegex(ValueError, "_Layout takes no 'ef' encodings"):
      sparse_wire._Layout([sparse_wire.make_encoding("ef", 40, 4)])  # pylint: disable=protected-access

  def test_batched_ef_matches_one_vector_at_a_time(self):
    # Low bits of 0, 3, 5 and 15 bits, full, partial and empty buffers.
    specs = [(1000, 10, 7), (50, 40, 0), (300, 6, 6), (2**20 + 3, 17, 17),
             (9, 1, 1)]
    encs = [sparse_wire.make_encoding("ef", n, cap) for n, cap, _ in specs]
    self.assertEqual([e.low_bits for e in encs], [6, 0, 5, 15, 3])
    rows = [[_sorted_positions(n, cap, count if r == 0 else (r * 7) % (cap + 1),
                               seed=10 * r + i)
             for i, (n, cap, count) in enumerate(specs)] for r in range(3)]
    coder = sparse_wire._EliasFano(encs)  # pylint: disable=protected-access
    want_words = np.stack([np.concatenate(
        [_np_ef_encode(i, e.n, e.capacity) for i, e in zip(row, encs)])
                           for row in rows])
    for enc_fn, dec_fn in ((coder.encode, coder.decode),
                           (tf.function(coder.encode, jit_compile=True),
                            tf.function(coder.decode, jit_compile=True))):
      words = np.stack([enc_fn(tf.constant(np.concatenate(row))).numpy()
                        for row in rows])
      self.assertAllEqual(words, want_words)
      self.assertAllEqual(dec_fn(tf.constant(words)),
                          [np.concatenate(row) for row in rows])

  def test_ef_for_the_used_slots_matches_numpy_reference(self):
    # Exact sizes lay each replica's "ef" stream out for its c used slots:
    # the words of (n, c), zero-filled to those of (n, capacity). Counts
    # where b changes (b = 6, 7 and 9 at n = 1000 for c = 10, 7 and 1), 0
    # and all slots; two vectors at once, rows of different counts decoded
    # together with their counts; stock ops and the native kernels.
    specs = [(1000, 10), (70000, 300)]
    encs = [sparse_wire.make_encoding("ef", n, cap) for n, cap in specs]
    low_bits, words = sparse_wire.ef_exact_tables(1000, 10)
    self.assertEqual([int(low_bits[c]) for c in (1, 7, 10)], [9, 7, 6])
    self.assertEqual(int(words[0]), 0)
    counts = np.array([[10, 300], [7, 299], [1, 0], [0, 1]], np.int32)
    rows, want = [], []
    for r, row_counts in enumerate(counts):
      idx = [_sorted_positions(n, cap, c, seed=r) for (n, cap), c in
             zip(specs, row_counts)]
      rows.append(np.concatenate(idx))
      streams = [_np_ef_encode(i[:c], n, c) if c else np.zeros(0, np.int32)
                 for i, (n, _), c in zip(idx, specs, row_counts)]
      want.append(np.concatenate([np.pad(w, (0, e.words - w.size))
                                  for w, e in zip(streams, encs)]))
    want = np.stack(want)
    self.assertEqual(want.shape[1], sum(e.words for e in encs))
    coder = sparse_wire._EliasFanoExact(encs)  # pylint: disable=protected-access
    got = np.stack([coder.encode(tf.constant(i), tf.constant(c)).numpy()
                    for i, c in zip(rows, counts)])
    self.assertAllEqual(got, want)
    self.assertAllEqual(coder.decode(tf.constant(want), tf.constant(counts)),
                        np.stack(rows))
    if not native.available():
      return
    for r, (i, c) in enumerate(zip(rows, counts)):
      parts = np.split(i, [specs[0][1]])
      payload = native.encode([tf.constant(p) for p in parts],
                              [tf.ones([cap]) for _, cap in specs], encs,
                              exact=True)
      self.assertAllEqual(payload[:want.shape[1]], want[r])
    values = np.arange(1, 1 + sum(cap for _, cap in specs), dtype=np.float32)
    payload = np.concatenate([want, np.tile(values.view(np.int32),
                                            (len(counts), 1))], 1)
    sums, _ = native.gather_sum(tf.constant(payload), encs, tf.float32,
                                tf.constant(counts))
    starts = np.cumsum([0] + [cap for _, cap in specs])
    for v, (n, cap) in enumerate(specs):
      dense = np.zeros(n, np.float32)
      for r, i in enumerate(rows):
        local = i[starts[v]:starts[v + 1]]
        np.add.at(dense, local[:counts[r, v]],
                  values[starts[v]:starts[v + 1]][:counts[r, v]])
      self.assertAllEqual(sums[v], dense)
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                r"counts of vector 1 must be in \[0, 300\], got 301"):
      native.gather_sum(tf.constant(payload), encs, tf.float32,
                        tf.constant(counts + np.int32([[0, 1]])))

  def test_exchange_batches_short_buffers_and_gives_the_same_sums(self):
    # Short buffers (<= BATCH_CAPACITY slots) go through one batched set of
    # ops, long ones one by one; with batching off every result is the same
    # to the bit, for mixed dtypes and encodings.
    replicas = 2
    rng = np.random.default_rng(5)
    big = sparse_wire.BATCH_CAPACITY + 1
    specs = [(300, 6, tf.float32), (5000, big, tf.float32), (40, 3, tf.float64),
             (12, 5, tf.float32), (9000, big + 50, tf.float64)]
    data = [[(np.sort(rng.choice(n, cap, replace=False)).astype(np.int32),
              rng.normal(size=cap).astype(dtype.as_numpy_dtype))
             for n, cap, dtype in specs] for _ in range(replicas)]
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)])

    def fn(batch):
      ctx = tf.distribute.get_replica_context()
      r = tf.get_static_value(ctx.replica_id_in_sync_group)
      return sparse_wire.exchange_many(
          ctx, [(tf.constant(i), tf.constant(v), n)
                for (i, v), (n, _, _) in zip(data[r], specs)], presorted=True,
          use_native=False, batch_capacity=batch)

    outs = {}
    for batch in (sparse_wire.BATCH_CAPACITY, 0):
      outs[batch] = util.local(
          repl, tf.function(lambda: repl.run(fn, args=(batch,)))())  # pylint: disable=cell-var-from-loop
    with self.assertRaisesRegex(ValueError, r"exchange_many: batch_capacity must be an "
                                r"int >= 0 \(or None\), got -1"):
      sparse_wire.exchange_many(None, [], batch_capacity=-1)
    for t, (n, _, dtype) in enumerate(specs):
      want = np.zeros(n)
      for r in range(replicas):
        np.add.at(want, data[r][t][0], data[r][t][1])
      for got, single in zip(outs[sparse_wire.BATCH_CAPACITY], outs[0]):
        self.assertEqual(got[t].dtype, dtype.as_numpy_dtype)
        self.assertAllClose(got[t], want, atol=1e-6, rtol=0)
        self.assertAllEqual(got[t], single[t])

  def test_decode_rejects_words_of_rank_three(self):
    enc = sparse_wire.make_encoding("chunk8", 40, 4)
    with self.assertRaisesRegex(ValueError, "decode_indices: words must be rank 1 or 2"):
      sparse_wire.decode_indices(tf.zeros([1, 1, enc.words], tf.int32), enc)

  def test_exchange_shrinks_the_gather_and_sorts_unsorted_input(self):
    n, capacity, replicas = 300, 6, util.NUM_CPUS
    rng = np.random.default_rng(2)
    # Unsorted positions with padding in the middle and a duplicate.
    idxs = [rng.permutation(np.r_[rng.choice(n, 4, replace=False), n, n])
            .astype(np.int32) for _ in range(replicas)]
    idxs[0][:2] = [5, 5]
    vals = [rng.normal(size=capacity).astype(np.float32) for _ in range(replicas)]
    want = np.zeros(n + 1)
    for i, v in zip(idxs, vals):
      np.add.at(want, i, v)
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)])
    sizes = {}

    def fn(name):
      ctx = tf.distribute.get_replica_context()
      r = tf.get_static_value(ctx.replica_id_in_sync_group)
      enc = sparse_wire.make_encoding(name, n, capacity)
      sizes[name] = enc.words
      return sparse_wire.exchange(ctx, tf.constant(idxs[r]), tf.constant(vals[r]),
                                  n, encoding=name)

    for name in sparse_wire.ENCODINGS:
      out = util.local(repl, tf.function(lambda: repl.run(fn, args=(name,)))())
      for got in out:
        self.assertAllClose(got, want[:n], atol=1e-6, rtol=0, msg=name)
    # 6 int32 positions vs 2 chunks of 1-byte counts (1 word) + 6 one-byte
    # offsets (2 words).
    # ef: b = 5, 30 low bits + (299 >> 5) + 6 = 15 bitmap bits, 2 words.
    self.assertEqual(sizes, {"int32": 6, "chunk16": 1 + 3, "chunk8": 1 + 2,
                             "ef": 2})


if __name__ == "__main__":
  tf.test.main()


class ValueWordTest(tf.test.TestCase, parameterized.TestCase):
  """bfloat16 values, two to an int32 word, with their error in the residual."""

  def test_round_values_matches_numpy_and_keeps_the_error(self):
    n, cap = 300, 64
    rng = np.random.default_rng(2)
    idx = np.r_[np.sort(rng.choice(n, cap - 5, replace=False)),
                np.full(5, n)].astype(np.int32)
    val = np.r_[reference_bfloat16.tricky_floats(cap - 5, 3), np.zeros(5)].astype(np.float32)
    residual = rng.normal(size=n).astype(np.float32)
    residual[idx[:-5]] = 0  # sent entries leave a zero residual
    word, kept = sparse_wire.round_values(tf.constant(idx), tf.constant(val),
                                          tf.constant(residual), "bfloat16")
    self.assertEqual(word.dtype, tf.bfloat16)
    want = reference_bfloat16.np_bfloat16_bits(val)
    self.assertAllEqual(tf.bitcast(word, tf.uint16), want)
    # What is held back plus what is sent is the value, to the bit.
    want_kept = residual.copy()
    want_kept[idx[:-5]] = val[:-5] - reference_bfloat16.np_bfloat16_value(want[:-5])
    self.assertAllEqual(kept, want_kept)
    sent = reference_bfloat16.np_bfloat16_value(want[:-5])
    self.assertAllEqual(want_kept[idx[:-5]] + sent, val[:-5])
    # None, and dtypes other than float32, pass through.
    for value_dtype, dtype in ((None, np.float32), ("bfloat16", np.float64)):
      same, same_res = sparse_wire.round_values(
          tf.constant(idx), tf.constant(val.astype(dtype)),
          tf.constant(residual.astype(dtype)), value_dtype)
      self.assertEqual(same.dtype, dtype)
      self.assertAllEqual(same, val.astype(dtype))
      self.assertAllEqual(same_res, residual.astype(dtype))

  def test_packing_is_bit_exact_two_to_a_word(self):
    val = reference_bfloat16.tricky_floats(7, 5)
    bits = reference_bfloat16.np_bfloat16_bits(val, tiny=False)  # tf.cast: plain rounding
    words = sparse_wire._pack_halves(tf.cast(tf.constant(val), tf.bfloat16))  # pylint: disable=protected-access
    padded = np.r_[bits, 0].astype(np.uint32)  # an odd count: a zero fills
    want = (padded[0::2] | (padded[1::2] << 16)).view(np.int32)
    self.assertAllEqual(words, want)
    # Blocks of 3, 4 and 1 slots one after another, 2 rows.
    caps = [3, 4, 1]
    blocks = [tf.cast(tf.constant(v), tf.bfloat16) for v in np.split(
        reference_bfloat16.tricky_floats(16, 6), [3, 7, 8])[:3]]
    row = tf.concat([sparse_wire._pack_halves(b) for b in blocks], 0)  # pylint: disable=protected-access
    self.assertEqual(row.shape[0], 2 + 2 + 1)
    floats = sparse_wire._unpack_halves(tf.stack([row, row]), caps)  # pylint: disable=protected-access
    self.assertEqual(floats.dtype, tf.float32)
    want = np.concatenate([tf.cast(b, tf.float32).numpy() for b in blocks])
    self.assertAllEqual(floats, [want, want])

  def test_value_bytes(self):
    self.assertEqual(sparse_wire.value_bytes(7, tf.bfloat16), 16)
    self.assertEqual(sparse_wire.value_bytes(8, tf.bfloat16), 16)
    self.assertEqual(sparse_wire.value_bytes(7, tf.float32), 28)
    self.assertEqual(sparse_wire.wire_bytes(1000, 10, tf.bfloat16), 12 + 20)
    self.assertEqual(sparse_wire.wire_dtype(tf.float32, "bfloat16"), tf.bfloat16)
    self.assertEqual(sparse_wire.wire_dtype(tf.float64, "bfloat16"), tf.float64)
    self.assertEqual(sparse_wire.wire_dtype(tf.float32, None), tf.float32)

  @parameterized.named_parameters(
      ("float16", "float16"), ("float32", "float32"), ("dtype", tf.bfloat16),
      ("bool", True))
  def test_bad_value_dtype(self, value_dtype):
    with self.assertRaisesRegex(
        ValueError, r"^X: value_dtype must be None \(the variable's dtype\) or "
        r"'bfloat16', got "):
      sparse_wire.check_value_dtype("X", value_dtype)

  def test_auto_value_dtype(self):
    # "auto" passes only where the owner allows it; the error then names it.
    self.assertEqual(sparse_wire.check_value_dtype("X", "auto", auto=True),
                     "auto")
    with self.assertRaisesRegex(ValueError, r"^X: value_dtype must be None "):
      sparse_wire.check_value_dtype("X", "auto")
    with self.assertRaisesRegex(
        ValueError, r"^X: value_dtype must be 'auto', None \(the variable's "
        r"dtype\) or 'bfloat16', got 'float16'$"):
      sparse_wire.check_value_dtype("X", "float16", auto=True)

  @parameterized.named_parameters(("stock_batched", None, False),
                                  ("one_by_one", 0, False),
                                  ("native", None, True))
  def test_exchange_sums_in_float32_fixed_and_exact(self, batch_capacity,
                                                    use_native):
    # Short (batched) and long buffers, odd and even capacities, beside a
    # float32 vector; replicas using none, all, a third and one slot. The
    # sums are the float32 sums of the bfloat16 values in replica order, to
    # the bit, at fixed capacity and with exact sizes; the bytes count two
    # per value, a filler for an odd count included. On CPU the native
    # kernels take bfloat16 values too.
    if use_native:
      test_native.require_native(self)
    replicas = util.NUM_CPUS
    rng = np.random.default_rng(8)
    specs = [(3000, 201, tf.bfloat16), (400, 21, tf.bfloat16),
             (500, 30, tf.float32), (90, 8, tf.bfloat16)]
    used = [[0] * 4, [cap for _, cap, _ in specs],
            [cap // 3 for _, cap, _ in specs], [1] * 4]
    data = [[(np.r_[np.sort(rng.choice(n, u, replace=False)),
                    np.full(cap - u, n)].astype(np.int32),
              np.r_[rng.normal(size=u), np.zeros(cap - u)].astype(np.float32))
             for (n, cap, _), u in zip(specs, used[r])] for r in range(replicas)]
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)])

    def fn(exact):
      ctx = tf.distribute.get_replica_context()
      r = tf.get_static_value(ctx.replica_id_in_sync_group)
      buffers = [(tf.constant(i), tf.cast(tf.constant(v), dtype), n)
                 for (i, v), (n, _, dtype) in zip(data[r], specs)]
      return sparse_wire.exchange_many(
          ctx, buffers, presorted=True, payload=True, exact=exact,
          batch_capacity=batch_capacity, use_native=use_native)

    with mock.patch.object(native, "gather_sum",
                           wraps=native.gather_sum) as kernel:
      fixed, exact = (util.local(repl, tf.function(
          lambda e=e: repl.run(fn, args=(e,)))()) for e in (False, True))
    # Per replica and layout one kernel call for each value dtype.
    self.assertEqual(kernel.call_count, 2 * 2 * replicas if use_native else 0)
    for t, (n, cap, dtype) in enumerate(specs):
      want = np.zeros(n, np.float32)
      for r in range(replicas):
        idx, val = data[r][t]
        if dtype == tf.bfloat16:
          val = reference_bfloat16.np_bfloat16_value(reference_bfloat16.np_bfloat16_bits(val))
        for i, x in zip(idx, val):
          if i < n:
            want[i] = np.float32(want[i] + x)
      enc = sparse_wire.make_encoding("auto", n, cap)
      for r in range(replicas):
        self.assertEqual(fixed[r][0][t].dtype, np.float32)
        self.assertAllEqual(fixed[r][0][t], want)
        self.assertAllEqual(exact[r][0][t], want)
        self.assertEqual(fixed[r][1][t],
                         enc.index_bytes + sparse_wire.value_bytes(cap, dtype))
        if t:  # the first vector also carries the step's overhead
          u = used[r][t]
          self.assertEqual(float(exact[r][1][t]),
                           4 * exact_index_words(enc, u)
                           + sparse_wire.value_bytes(u, dtype))

  def test_compiles_with_xla(self):
    repl = tf_dct.Replicator(["/cpu:0"], jit_compile=True)
    acc = np.array([0.5, -2.0, 0.1, 3.0, 1.0 + 2.0**-9], np.float32)

    def step_fn(a):
      ctx = tf.distribute.get_replica_context()
      idx, val, _, fitted = sparse_wire.compact(a, tf.abs(a) >= 0.5, 3)
      val, _ = sparse_wire.round_values(idx, val, tf.where(fitted, 0.0, a),
                                        "bfloat16")
      return sparse_wire.exchange(ctx, idx, val, 5)

    out = repl.run(step_fn, lambda ctx: tf.data.Dataset.from_tensors(acc).repeat())
    step = repl._steps[(step_fn, next(iter(repl._inputs)))]  # pylint: disable=protected-access
    self.assertTrue(step.replicated_step._jit_compile)  # pylint: disable=protected-access
    self.assertAllEqual(out, [0.5, -2.0, 0.0, 3.0, 0.0])
