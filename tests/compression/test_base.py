"""tf_dct.compression.base: `exclude`, `sparse_gradients` and
`dense_gradients` (variables aggregated as they are)."""

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from tf_dct import compression
from tf_dct.compression import accounting
from tf_dct.compression import base
from tf_dct.compression import sparse_wire
from tests import util
from tests.compression import test_sparse_wire


def setUpModule():
  util.setup_cpus()


COMPRESSORS = {
    "Dense": compression.Dense,
    "DCTDP": lambda **kw: compression.DCTDP(sparsity=0.8, threshold_life=3, **kw),
    "DEFT": lambda **kw: compression.DEFT(density=0.2, **kw),
    "TopK": lambda **kw: compression.TopK(density=0.2, **kw),
    "CLTK": lambda **kw: compression.CLTK(density=0.2, **kw),
    "HardThreshold": lambda **kw: compression.HardThreshold(0.5, **kw),
}
ROWS, WIDTH, K, N, STEPS, REPLICAS = 6, 3, 4, 40, 3, 2


def _run(make):
  """Feeds an IndexedSlices gradient of `table` and a dense one of `w`.

  Two compressors see the same gradients: one with exclude=("table",) given
  both variables, one without exclude given `w` alone. Returns per step the
  per-replica outputs (table as dense, w with exclude, w alone) and the two
  compressors.
  """
  rng = np.random.default_rng(0)
  ids = rng.integers(0, ROWS, size=(STEPS, REPLICAS, K)).astype(np.int32)
  vals = rng.normal(size=(STEPS, REPLICAS, K, WIDTH)).astype(np.float32)
  dense = rng.normal(size=(STEPS, REPLICAS, N)).astype(np.float32)
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(REPLICAS)],
                           input_replication=tf_dct.PER_REPLICA)
  with_exclude, alone = make(exclude=("^table",)), make()
  for c in (with_exclude, alone):
    c.bind(repl)
  with repl.scope():
    table = tf.Variable(tf.zeros([ROWS, WIDTH]), name="table")
    w = tf.Variable(tf.zeros([N]), name="w")

  def input_fn(replica_id):
    return util.without_autotune(tf.data.Dataset.from_tensor_slices(
        (ids[:, replica_id], vals[:, replica_id], dense[:, replica_id])))

  def step_fn(batch):
    i, v, d = batch
    g = tf.IndexedSlices(v, i, tf.constant([ROWS, WIDTH]))
    (t_out, _), (w_out, _) = with_exclude.aggregate([(g, table), (d, w)])
    ((w_alone, _),) = alone.aggregate([(d, w)])
    return tf.convert_to_tensor(t_out), w_out, w_alone

  history = [util.local(repl, repl.run(step_fn, input_fn)) for _ in range(STEPS)]
  return history, ids, vals, with_exclude, alone, table


class ExcludeTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(*[(name, name) for name in COMPRESSORS])
  def test_excluded_variable_is_summed_as_is(self, name):
    history, ids, vals, with_exclude, alone, table = _run(COMPRESSORS[name])
    for t, out in enumerate(history):
      expected = np.zeros([ROWS, WIDTH], np.float32)
      for r in range(REPLICAS):
        np.add.at(expected, ids[t, r], vals[t, r])
      for r in range(REPLICAS):
        table_out, w_out, w_alone = out[r]
        self.assertAllClose(table_out, expected, atol=1e-6, rtol=0)
        # The compressed variable is untouched by the exclusion of the other.
        self.assertAllEqual(w_out, w_alone, msg=f"step {t} replica {r}")
    self.assertEqual(with_exclude.state_for(table), {})
    stats = with_exclude.communication_stats()["variables"]["table"]
    # All-gathered, not densified. Stock TF sends the row count, K rows of
    # WIDTH floats and K int32 ids; so does Dense, while the compressors
    # send each replica's distinct rows (`dedup_rows`).
    stock = 4 + K * WIDTH * 4 + K * 4
    self.assertEqual(stats["last"]["stock_payload_bytes"], [stock] * REPLICAS)
    self.assertEqual(stats["last"]["payload_bytes"],
                     [stock if name == "Dense" else
                      _rows_payload(ids[-1], WIDTH)] * REPLICAS)
    self.assertNotIn("counters", stats)

  @parameterized.named_parameters(
      ("bare_string", "table"), ("not_a_sequence", 3), ("not_strings", (1,)),
      ("bad_regex", ("(",)))
  def test_bad_exclude(self, exclude):
    for make in COMPRESSORS.values():
      with self.assertRaisesRegex(ValueError, "exclude"):
        make(exclude=exclude)


# Two tables fed IndexedSlices: "wide" (2000 x 8) with 4 rows touched per
# replica, where TF's all-gather of the rows is far cheaper than any
# compressed exchange, and "tall" (100 x 4) with 64 rows touched, where the
# rows cost more than the compressed exchange (at 0.99 / density 0.01).
TABLES = {"wide": (2000, 8, 4), "tall": (100, 4, 64)}
SPARSE = {
    "DCTDP": lambda **kw: compression.DCTDP(sparsity=0.99, **kw),
    "DEFT": lambda **kw: compression.DEFT(density=0.01, **kw),
    "TopK": lambda **kw: compression.TopK(density=0.01, **kw),
    "CLTK": lambda **kw: compression.CLTK(density=0.01, **kw),
    "HardThreshold": lambda **kw: compression.HardThreshold(
        0.5, capacity_density=0.01, **kw),
}


def _stock_ring_bytes(rows, width, replicas=REPLICAS):
  """(n - 1) * (4 + rows * (4 width + 4)): TF's all-gather of int32 ids."""
  return (replicas - 1) * (4 + rows * (4 * width + 4))


def _rows_payload(ids, width):
  """P of float32 rows sent with `dedup_rows`, `ids` [replicas, k] (int32):
  TF's row count, every replica's distinct rows padded to the largest
  count, and that count's own all-gather."""
  longest = max(len(np.unique(replica_ids)) for replica_ids in ids)
  return 4 + longest * (4 * width + 4) + 4


def _sparse_run(compressor, steps=2, jit_compile=False, phases=False,
                tables=None):
  """Feeds the IndexedSlices gradients of `tables` (name: (rows, width,
  ids per replica); TABLES by default); returns per step the per-replica
  aggregates (dense) and the exact sums, and the tables.
  `phases`: each step is traced in the compressor's phase of that step."""
  shapes = TABLES if tables is None else tables
  rng = np.random.default_rng(1)
  feeds = {name: (rng.integers(0, n, size=(steps, REPLICAS, k)).astype(np.int32),
                  rng.normal(size=(steps, REPLICAS, k, w)).astype(np.float32))
           for name, (n, w, k) in shapes.items()}
  replicas = 1 if jit_compile else REPLICAS
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA,
                           jit_compile=jit_compile)
  compressor.bind(repl)
  with repl.scope():
    tables = {name: tf.Variable(tf.zeros([n, w]), name=name)
              for name, (n, w, _) in shapes.items()}

  def input_fn(replica_id):
    return tf.data.Dataset.from_tensor_slices(
        {name: (ids[:, replica_id], vals[:, replica_id])
         for name, (ids, vals) in feeds.items()})

  def step_fn(batch):
    pairs = [(tf.IndexedSlices(batch[name][1], batch[name][0],
                               tf.constant(list(shapes[name][:2]))),
              tables[name]) for name in shapes]
    return [tf.convert_to_tensor(g) for g, _ in compressor.aggregate(pairs)]

  done = [0]  # steps run so far
  if phases:
    repl.add_trace_hook(lambda: compressor.in_phase(done[0]))
  out = []
  for _ in range(steps):
    out.append(util.local(repl, repl.run(step_fn, input_fn)))
    done[0] += 1
  exact = []
  ids = {name: feed[0] for name, feed in feeds.items()}
  for t in range(steps):
    sums = []
    for name, (n, w, _) in shapes.items():
      total = np.zeros([n, w], np.float32)
      for r in range(replicas):
        np.add.at(total, feeds[name][0][t, r], feeds[name][1][t, r])
      sums.append(total)
    exact.append(sums)
  return out, exact, tables, ids


class ExactSizesTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("string", "DCTDP", "yes", r"DCTDP: exact_sizes must be None, True or "
       r"False, got 'yes'"),
      ("int", "TopK", 1, r"TopK: exact_sizes must be None, True or False, got 1"),
      ("no_sparse_wire", "CLTK", True, r"CLTK: exact_sizes must be None \(it "
       r"exchanges no sparse_wire buffers\), got True"),
      ("dense", "Dense", False, r"Dense: exact_sizes must be None \(it "
       r"exchanges no sparse_wire buffers\), got False"))
  def test_bad_exact_sizes(self, name, value, pattern):
    compressor = COMPRESSORS[name]()
    with self.assertRaisesRegex(ValueError, f"^{pattern}$"):
      compressor.exact_sizes = value
    self.assertIsNone(compressor.exact_sizes)

  def test_workers_compare_exact_sizes(self):
    compressor = COMPRESSORS["HardThreshold"]()
    self.assertIsNone(compressor.config()["exact_sizes"])
    compressor.exact_sizes = False
    self.assertIs(compressor.config()["exact_sizes"], False)


class SparseGradientsTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(*[(name, name) for name in SPARSE])
  def test_auto_sends_rows_as_tf_does_where_cheaper(self, name):
    compressor = SPARSE[name](sparse_gradients="auto")
    if compressor.exchanges_sparse_wire:  # the exact-size payloads below
      compressor.exact_sizes = True
    out, exact, tables, ids = _sparse_run(compressor)
    wide, tall = tables["wide"], tables["tall"]
    self.assertTrue(compressor.sends_as_is(wide))
    self.assertFalse(compressor.sends_as_is(tall))
    stats = compressor.communication_stats()["variables"]
    # The wide table went as TF sends it: exact sums, stock bytes.
    for t, sums in enumerate(exact):
      for r in range(REPLICAS):
        self.assertAllClose(out[t][r][0], sums[0], atol=1e-6, rtol=0)
    self.assertEqual(stats["wide"]["last"]["bytes_sent"],
                     [(REPLICAS - 1) * _rows_payload(ids["wide"][-1], 8)]
                     * REPLICAS)
    # The tall table was compressed, for fewer bytes than its rows cost.
    self.assertLess(stats["tall"]["last"]["bytes_sent"][0],
                    _stock_ring_bytes(64, 4))
    self.assertNotAllClose(out[0][0][1], exact[0][1])
    if name != "DEFT":  # its figure is an estimate (`DEFT.compressed_bytes`)
      # `compressed_bytes` prices the full capacity; with exact sizes the
      # payload is at most that plus the step's header (the row length, the
      # table's count, TensorFlow's length word). TopK and HardThreshold fill
      # their capacity here, DCTDP (capacity 2K) does not.
      gather, reduce = compressor.compressed_bytes(tall)
      for payload in stats["tall"]["last"]["payload_bytes"]:
        self.assertLessEqual(payload, gather + reduce + 3 * 4)
        if name == "DCTDP":
          self.assertLess(payload, gather + reduce)
    # Its residual holds what was not sent; the wide table's state is unused.
    self.assertGreater(np.abs(compressor.state_values(tall)["residual"]).sum(), 0)
    self.assertAllEqual(compressor.state_values(wide)["residual"],
                        np.zeros([REPLICAS, 2000, 8]))

  def test_deft_sends_rows_as_tf_does_by_default(self):
    # Each DEFT partition is selected from one replica's accumulator, which
    # holds only the rows its own batches looked up: tables go as rows.
    for name, make in SPARSE.items():
      self.assertEqual(make().sparse_gradients, "stock" if name == "DEFT" else "auto", name)
    compressor = SPARSE["DEFT"]()
    out, exact, tables, _ = _sparse_run(compressor, steps=1)
    for name, table in tables.items():
      self.assertTrue(compressor.sends_as_is(table), name)
      for r in range(REPLICAS):
        self.assertAllClose(out[0][r][list(tables).index(name)],
                            exact[0][list(tables).index(name)], atol=1e-6, rtol=0)

  @parameterized.parameters("stock", "compress")
  def test_fixed_choices(self, choice):
    compressor = compression.DCTDP(sparsity=0.99, sparse_gradients=choice)
    out, exact, tables, _ = _sparse_run(compressor, steps=1)
    for name, table in tables.items():
      self.assertEqual(compressor.sends_as_is(table), choice == "stock", name)
    exact_tall = np.allclose(out[0][0][1], exact[0][1], atol=1e-6)
    self.assertEqual(exact_tall, choice == "stock")

  def test_a_dense_phase_sends_rows_as_tf_does(self):
    # A warm-up step all-gathers a table's rows (exact sums at stock TF's
    # bytes) instead of all-reducing the whole table; the compressed step
    # that follows compresses the tables ("compress").
    compressor = compression.DCTDP(sparsity=0.99, warmup_steps=1,
                                   sparse_gradients="compress")
    out, exact, tables, ids = _sparse_run(compressor, steps=2, phases=True)
    warm, compressed = compressor.communication_stats()["phases"]
    self.assertEqual((warm["steps"], compressed["steps"]),
                     ([1] * REPLICAS, [1] * REPLICAS))
    for v in range(len(TABLES)):
      for r in range(REPLICAS):
        self.assertAllClose(out[0][r][v], exact[0][v], atol=1e-6, rtol=0)
    self.assertEqual(warm["total"]["bytes_sent"],
                     [(REPLICAS - 1) * (_rows_payload(ids["wide"][0], 8)
                                        + _rows_payload(ids["tall"][0], 4))]
                     * REPLICAS)
    self.assertEqual(warm["total"]["stock_bytes"],
                     [_stock_ring_bytes(4, 8) + _stock_ring_bytes(64, 4)]
                     * REPLICAS)
    self.assertNotAllClose(out[1][0][1], exact[1][1])
    self.assertGreater(
        np.abs(compressor.state_values(tables["tall"])["residual"]).sum(), 0)

  def test_auto_prices_the_distinct_rows(self):
    # 32 ids per replica of a 64 x 4 table: as they come, 4 + 32 * 20 = 644
    # bytes on each other replica, more than DCTDP(0.99)'s 560 with float32
    # values; after summing duplicates, an expected 26.4 rows on the larger
    # of 2 replicas, 4 + 26.4 * 20 + 4 = 536 bytes, fewer. (With bfloat16
    # values, the default, the exchange costs 304 bytes: no rows win.)
    shape, ids = (64, 4), 32
    self.assertEqual(compression.DCTDP(sparsity=0.99).compressed_bytes(
        tf.Variable(tf.zeros(shape))), (304, 0))
    compressor = compression.DCTDP(sparsity=0.99, value_dtype=None)
    with tf.device("/cpu:0"):
      table = tf.Variable(tf.zeros(shape))
    grad = tf.IndexedSlices(tf.zeros([ids, shape[1]]), tf.range(ids),
                            tf.constant(shape))
    gather, reduce = compressor.compressed_bytes(table)
    compressed = (REPLICAS - 1) * gather + reduce  # 2 replicas: ring M
    self.assertEqual(compressed, 560)
    rows = accounting.distinct_rows(ids, shape[0], REPLICAS)
    self.assertAllClose(rows, 26.41, atol=0.01)
    self.assertGreater(_stock_ring_bytes(ids, shape[1]), compressed)
    self.assertLess((REPLICAS - 1) * (4 + rows * (4 * shape[1] + 4) + 4),
                    compressed)
    self.assertTrue(compressor.stock_is_cheaper(grad, table, REPLICAS))
    # Without summing duplicates (dedup_rows False) every id is priced.
    compressor.dedup_rows = False
    self.assertFalse(compressor.stock_is_cheaper(grad, table, REPLICAS))
    compressor.dedup_rows = True
    # Under XLA rows go as they are (static shapes): every id is priced.
    under_xla = []

    @tf.function(jit_compile=True)
    def price():
      under_xla.append(compressor.stock_is_cheaper(grad, table, REPLICAS))
      return tf.zeros([])

    price()
    self.assertEqual(under_xla, [False])
    # In a step "auto" sends the table as rows: the exact sums.
    compressor = compression.DCTDP(sparsity=0.99, value_dtype=None)
    out, exact, tables, _ = _sparse_run(compressor, steps=1,
                                        tables={"mid": shape + (ids,)})
    self.assertTrue(compressor.sends_as_is(tables["mid"]))
    for r in range(REPLICAS):
      self.assertAllClose(out[0][r][0], exact[0][0], atol=1e-6, rtol=0)

  def test_auto_compresses_under_xla(self):
    # TF's all-gather of IndexedSlices has no XLA kernel.
    compressor = compression.DCTDP(sparsity=0.99)
    _, _, tables, _ = _sparse_run(compressor, steps=1, jit_compile=True)
    for table in tables.values():
      self.assertFalse(compressor.sends_as_is(table))

  def test_stock_compresses_under_xla_with_a_warning(self):
    # DEFT's default and an explicit "stock" alike: the step compiles.
    for compressor in (compression.DEFT(density=0.01),
                       compression.DCTDP(sparsity=0.99, sparse_gradients="stock")):
      with self.assertLogs(level="WARNING") as logs:
        _, _, tables, _ = _sparse_run(compressor, steps=1, jit_compile=True)
      for table in tables.values():
        self.assertFalse(compressor.sends_as_is(table))
      warned = [line for line in logs.output
                if "under XLA" in line and "sparse_gradients='stock'" in line]
      self.assertLen(warned, len(tables), logs.output)

  @parameterized.named_parameters(*[(name, name) for name in SPARSE])
  def test_bad_sparse_gradients(self, name):
    for bad in ("Auto", "dense", None, True):
      with self.assertRaisesRegex(
          ValueError, r"sparse_gradients must be one of \('auto', 'stock', "
          r"'compress'\), got"):
        SPARSE[name](sparse_gradients=bad)


# One step of a 6 x 3 table's rows on 2 replicas, duplicates within each:
# replica 0 touches 2 distinct rows of its 4, replica 1 3 of its 4.
DUP_IDS = np.array([[1, 3, 1, 1], [0, 5, 2, 5]], np.int32)


class DuplicateRowsTest(tf.test.TestCase, parameterized.TestCase):

  def _run(self):
    """Sends DUP_IDS's rows (integer-valued floats: every sum is exact)
    through a compressor's rows path and through Dense; returns per replica
    (rows path's aggregate, its row count, Dense's aggregate), the numpy
    sum and the two compressors."""
    ids = DUP_IDS
    vals = np.random.default_rng(3).integers(
        -8, 8, size=ids.shape + (3,)).astype(np.float32)
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(len(ids))],
                             input_replication=tf_dct.PER_REPLICA)
    rows_path = compression.TopK(density=0.1, sparse_gradients="stock")
    stock = compression.Dense()
    for c in (rows_path, stock):
      c.bind(repl)
    with repl.scope():
      table = tf.Variable(tf.zeros([6, 3]), name="table")

    def input_fn(replica_id):
      return tf.data.Dataset.from_tensors((ids[replica_id], vals[replica_id]))

    def step_fn(batch):
      g = tf.IndexedSlices(batch[1], batch[0], tf.constant([6, 3]))
      ((mine, _),) = rows_path.aggregate([(g, table)])
      ((theirs, _),) = stock.aggregate([(g, table)])
      return (tf.convert_to_tensor(mine), tf.size(mine.indices),
              tf.convert_to_tensor(theirs))

    out = util.local(repl, repl.run(step_fn, input_fn))
    exact = np.zeros([6, 3], np.float32)
    for replica_ids, replica_vals in zip(ids, vals):
      np.add.at(exact, replica_ids, replica_vals)
    return out, exact, rows_path, stock

  def test_same_aggregate_as_stock_tf_in_fewer_bytes(self):
    out, exact, rows_path, stock = self._run()
    for mine, rows, theirs in out:
      self.assertAllEqual(mine, exact)
      self.assertAllEqual(theirs, exact)
      self.assertEqual(rows, 2 + 3)  # the distinct rows of both replicas
    # Each replica sends its distinct rows, padded by TF to the longest (3):
    # TF's row count, 3 x (3 floats + an int32 id), and that count (int32).
    # Stock TF, and Dense, send the 4 rows with duplicates.
    mine = rows_path.communication_stats()["variables"]["table"]["last"]
    theirs = stock.communication_stats()["variables"]["table"]["last"]
    self.assertEqual(mine["payload_bytes"], [4 + 3 * 16 + 4] * 2)
    self.assertEqual(mine["bytes_sent"], [4 + 3 * 16 + 4] * 2)
    self.assertEqual(mine["sent"], [2 * 3, 3 * 3])
    for last in (mine, theirs):
      self.assertEqual(last["stock_payload_bytes"], [4 + 4 * 16] * 2)
    self.assertEqual(theirs["payload_bytes"], [4 + 4 * 16] * 2)
    self.assertEqual(theirs["sent"], [4 * 3] * 2)

  def test_sum_duplicate_rows(self):
    # Rows of shape [2, 2], int64 ids: one row per id in order of first
    # appearance, each the sum of that id's rows.
    ids = np.array([4, 1, 4, 0, 1], np.int64)
    vals = np.arange(20, dtype=np.float32).reshape(5, 2, 2)
    out = compression.base.sum_duplicate_rows(
        tf.IndexedSlices(tf.constant(vals), tf.constant(ids), [6, 2, 2]))
    self.assertAllEqual(out.indices, [4, 1, 0])
    self.assertAllEqual(out.values, [vals[0] + vals[2], vals[1] + vals[4], vals[3]])
    self.assertAllEqual(out.dense_shape, [6, 2, 2])


# Dense gradients of a bias (8 entries) and a kernel (8 x 4 = 32) on 2
# replicas, DCTDP(sparsity=0.99, min_count=8, value_dtype=None) (float32
# values): the bias's 8 wire slots cost 36 bytes against its 32-byte
# all-reduce, the kernel's 16 slots 72 bytes against 128 (ring model: one
# peer, an all-reduce moves 2 (n - 1) / n x). With bfloat16 values (the
# default) they cost 20 and 40 bytes (test_break_even_grows_with_replicas).
DENSE = {"bias": ([8], np.float32), "kernel": ([8, 4], np.float32)}


def _used_words(n, capacity, used):
  """int32 words a replica sends for a float32 vector with `used` of its
  `capacity` slots in use ("auto" layout, exact sizes)."""
  enc = sparse_wire.make_encoding("auto", n, capacity)
  return test_sparse_wire.exact_index_words(enc, used) + used


def _exact_first_payload(own, row, longest, vectors):
  """P of a step's first exchanged vector under exact sizes: its `own`
  words, the header (the row length and one count per vector), TensorFlow's
  length word, and the padding of this replica's `row` to the `longest`."""
  return 4 * (own + 1 + vectors + longest - row) + 4


def _dense_run(compressor, steps=2, variables=None, replicas=REPLICAS,
               jit_compile=False):
  """Feeds the `variables` (name -> (shape, dtype); default DENSE) dense
  gradients; returns per step the per-replica aggregates and the exact sums,
  and the variables."""
  specs = variables or DENSE
  rng = np.random.default_rng(2)
  feeds = {name: rng.normal(size=[steps, replicas] + shape).astype(dtype)
           for name, (shape, dtype) in specs.items()}
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA,
                           jit_compile=jit_compile)
  compressor.bind(repl)
  with repl.scope():
    made = {name: tf.Variable(tf.zeros(shape, dtype), name=name)
            for name, (shape, dtype) in specs.items()}

  def input_fn(replica_id):
    return tf.data.Dataset.from_tensor_slices(
        {name: feed[:, replica_id] for name, feed in feeds.items()})

  def step_fn(batch):
    return [g for g, _ in compressor.aggregate(
        [(batch[name], made[name]) for name in specs])]

  out = [util.local(repl, repl.run(step_fn, input_fn)) for _ in range(steps)]
  exact = [[feeds[name][t].sum(0) for name in specs] for t in range(steps)]
  return out, exact, made


class DenseGradientsTest(tf.test.TestCase, parameterized.TestCase):

  def test_auto_sends_whole_a_variable_whose_exchange_costs_more(self):
    # With momentum correction the bias's aggregate is the sum of the
    # replicas' velocities u = 0.9 u + g, nothing held back; the kernel is
    # compressed.
    compressor = compression.DCTDP(sparsity=0.99, min_count=8, momentum=0.9,
                                   value_dtype=None)
    out, _, variables = _dense_run(compressor)
    bias, kernel = variables["bias"], variables["kernel"]
    self.assertTrue(compressor.sends_whole(bias))
    self.assertFalse(compressor.sends_whole(kernel))
    self.assertFalse(compressor.sends_as_is(bias))
    rng = np.random.default_rng(2)  # the feeds of `_dense_run`
    feeds = {name: rng.normal(size=[2, REPLICAS] + shape).astype(dtype)
             for name, (shape, dtype) in DENSE.items()}
    u = np.zeros([REPLICAS, 8], np.float32)
    for t in range(2):
      u = 0.9 * u + feeds["bias"][t]
      for r in range(REPLICAS):
        self.assertAllClose(out[t][r][0], u.sum(0), atol=1e-6, rtol=0)
    self.assertAllClose(compressor.state_values(bias)["velocity"], u,
                        atol=1e-6, rtol=0)
    self.assertAllEqual(compressor.state_values(bias)["residual"],
                        np.zeros([REPLICAS, 8]))
    self.assertNotAllClose(out[0][0][1], feeds["kernel"][0].sum(0))
    stats = compressor.communication_stats()["variables"]
    self.assertEqual(stats["bias"]["last"]["bytes_sent"], [32] * REPLICAS)
    # The kernel, the only exchanged vector, sends its fixed capacity (16
    # slots, 72 bytes): the default on one machine.
    self.assertEqual(stats["kernel"]["last"]["bytes_sent"], [72] * REPLICAS)
    # Both are updated by the compressor's rule (plain SGD in the optimizer).
    self.assertTrue(compressor.corrects_optimizer(bias))
    self.assertTrue(compressor.corrects_optimizer(kernel))

  def test_a_rejected_step_moves_no_velocity(self):
    # A NaN in the kernel's gradient on replica 1 rejects the step: neither
    # the bias (sent whole, finite gradients) nor the kernel on replica 0
    # (finite there) moves its velocity or any other state.
    compressor = compression.DCTDP(sparsity=0.99, min_count=8, momentum=0.9,
                                   value_dtype=None)
    rng = np.random.default_rng(5)
    bias_g = rng.normal(size=[2, REPLICAS, 8]).astype(np.float32)
    kernel_g = rng.normal(size=[2, REPLICAS, 8, 4]).astype(np.float32)
    kernel_g[1, 1, 0, 0] = np.nan
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(REPLICAS)],
                             input_replication=tf_dct.PER_REPLICA)
    compressor.bind(repl)
    with repl.scope():
      bias = tf.Variable(tf.zeros([8]), name="bias")
      kernel = tf.Variable(tf.zeros([8, 4]), name="kernel")

    def input_fn(replica_id):
      return tf.data.Dataset.from_tensor_slices(
          (bias_g[:, replica_id], kernel_g[:, replica_id]))

    def step_fn(g):
      return [a for a, _ in compressor.aggregate([(g[0], bias), (g[1], kernel)])]

    repl.run(step_fn, input_fn)
    self.assertTrue(compressor.sends_whole(bias))
    before = {v.name: compressor.state_values(v) for v in (bias, kernel)}
    with self.assertRaises(tf.errors.InvalidArgumentError):
      repl.run(step_fn, input_fn)
    for v in (bias, kernel):
      for key, value in compressor.state_values(v).items():
        self.assertAllEqual(value, before[v.name][key], msg=f"{v.name} {key}")

  @parameterized.named_parameters(
      ("deft", lambda **kw: compression.DEFT(density=0.25, min_count=1, **kw)),
      ("topk", lambda **kw: compression.TopK(density=0.25, min_count=1, **kw)),
      ("dct_dp", lambda **kw: compression.DCTDP(
          sparsity=0.75, min_count=1, value_dtype=None, **kw)),
  )
  def test_sends_whole_below_whole_below(self, make):
    # At these densities the exchange is cheaper than the all-reduce, so by
    # bytes alone ("auto" with whole_below=0) the bias is compressed; below
    # `whole_below` it is sent whole (its exact sum), the kernel (32
    # entries) still compressed.
    for whole_below, whole in ((16, True), (0, False)):
      compressor = make(whole_below=whole_below)
      out, exact, variables = _dense_run(compressor)
      bias, kernel = variables["bias"], variables["kernel"]
      self.assertEqual(compressor.sends_whole(bias), whole)
      self.assertFalse(compressor.sends_whole(kernel))
      self.assertFalse(compressor.sends_as_is(bias))
      for t in range(2):
        self.assertEqual(np.allclose(out[t][0][0], exact[t][0], atol=1e-6),
                         whole, msg=f"whole_below={whole_below} step {t}")
        self.assertNotAllClose(out[t][0][1], exact[t][1])

  def test_whole_below_defaults(self):
    # DEFT sends variables under 2048 entries whole; TopK and DCTDP decide
    # by bytes alone unless told.
    self.assertEqual(compression.DEFT().whole_below, base.WHOLE_BELOW)
    self.assertEqual(base.WHOLE_BELOW, 2048)
    self.assertEqual(compression.TopK().whole_below, 0)
    self.assertEqual(compression.DCTDP().whole_below, 0)

  def test_compress_always_compresses(self):
    compressor = compression.DCTDP(sparsity=0.99, min_count=8,
                                   dense_gradients="compress", value_dtype=None)
    compressor.exact_sizes = True  # as across workers
    _, _, variables = _dense_run(compressor, steps=1)
    self.assertFalse(compressor.sends_whole(variables["bias"]))
    stats = compressor.communication_stats()["variables"]
    # All 8 bias entries (36 bytes, its capacity) and the kernel's used
    # slots; the bias, the first vector, carries the step's overhead.
    bias = [_used_words(8, 8, c) for c in stats["bias"]["last"]["sent"]]
    self.assertEqual(bias, [1 + 8] * REPLICAS)  # "ef": one index word
    rows = [b + _used_words(32, 16, c)
            for b, c in zip(bias, stats["kernel"]["last"]["sent"])]
    self.assertEqual(stats["bias"]["last"]["bytes_sent"],
                     [_exact_first_payload(b, w, max(rows), 2)
                      for b, w in zip(bias, rows)])

  def test_adam_side_channel_is_sent_either_way(self):
    # Adam correction's side channel (the kernel's 8 + 4 row and column
    # sums, the bias's 8 entries) goes with a whole variable as with a
    # compressed one, so the choice is the same as without it: the bias is
    # sent whole (32 + 32 bytes), the kernel compressed (72 + 48).
    compressor = compression.DCTDP(sparsity=0.99, min_count=8, value_dtype=None)
    compressor.set_adam(0.9, 0.999, 1e-7)
    _, _, variables = _dense_run(compressor, steps=1)
    self.assertTrue(compressor.sends_whole(variables["bias"]))
    self.assertFalse(compressor.sends_whole(variables["kernel"]))
    for v in variables.values():
      self.assertTrue(compressor.corrects_optimizer(v), v.name)
    stats = compressor.communication_stats()["variables"]
    self.assertEqual(stats["bias"]["last"]["bytes_sent"], [64] * REPLICAS)
    # The kernel's fixed capacity (one machine's default), and its 48 bytes
    # of side channel.
    self.assertEqual(stats["kernel"]["last"]["bytes_sent"], [72 + 48] * REPLICAS)

  def test_break_even_grows_with_replicas(self):
    # The kernel's exchange: (n - 1) x 72 gathered against 2 (n - 1) / n x
    # 128 all-reduced: compressed on 2 replicas (72 < 128), dense on 4
    # (216 > 192).
    compressor = compression.DCTDP(sparsity=0.99, min_count=8, value_dtype=None)
    kernel = tf.Variable(tf.zeros([8, 4]))
    self.assertFalse(compressor.dense_is_cheaper(kernel, 2))
    self.assertTrue(compressor.dense_is_cheaper(kernel, 4))
    # bfloat16 values (the default), two to a word: the bias's 8 slots are
    # 4 value words and 1 index word (20 bytes), the kernel's 16 slots 8 and
    # 2 (40 bytes). The bias: compressed on 2 replicas (20 < 32), whole on 4
    # (60 > 48); the kernel compressed on 4 too (120 < 192).
    compressor = compression.DCTDP(sparsity=0.99, min_count=8)
    bias = tf.Variable(tf.zeros([8]))
    self.assertEqual(compressor.compressed_bytes(bias), (20, 0))
    self.assertEqual(compressor.compressed_bytes(kernel), (40, 0))
    self.assertFalse(compressor.dense_is_cheaper(bias, 2))
    self.assertTrue(compressor.dense_is_cheaper(bias, 4))
    self.assertFalse(compressor.dense_is_cheaper(kernel, 4))

  def test_variables_of_several_dtypes(self):
    # Variables all-reduced whole are batched per dtype. With at most 16
    # entries the capacity (2 x min_count) is every entry, so the exchange,
    # values plus index words, costs more than the dense all-reduce.
    compressor = compression.DCTDP(sparsity=0.99, min_count=8)
    specs = {"a64": ([15], np.float64), "b32": ([3], np.float32),
             "c64": ([4], np.float64)}
    out, exact, made = _dense_run(compressor, steps=1, variables=specs)
    for i, v in enumerate(made.values()):
      self.assertTrue(compressor.sends_whole(v), v.name)
      for r in range(REPLICAS):
        self.assertAllClose(out[0][r][i], exact[0][i], atol=1e-6, rtol=0)

  def test_under_xla(self):
    compressor = compression.DCTDP(sparsity=0.99, min_count=8, value_dtype=None)
    out, exact, made = _dense_run(compressor, replicas=1, jit_compile=True)
    self.assertTrue(compressor.sends_whole(made["bias"]))
    self.assertFalse(compressor.sends_whole(made["kernel"]))
    for t in range(2):
      self.assertAllClose(out[t][0][0], exact[t][0], atol=1e-6, rtol=0)

  @parameterized.named_parameters(*[(name, name) for name in SPARSE])
  def test_bad_dense_gradients(self, name):
    for bad in ("Auto", "stock", None, True):
      with self.assertRaisesRegex(
          ValueError, r"dense_gradients must be one of \('auto', "
          r"'compress'\), got"):
        SPARSE[name](dense_gradients=bad)


class SparseGradientsKerasTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.parameters("tf_keras", "keras3")
  def test_rows_sent_as_is_keep_the_optimizers_adam(self, flavour):
    # An embedding table sent as TF sends it is updated by the optimizer's
    # own Adam (no Adam correction): it ends as with dense aggregation. (The
    # head is frozen: a compressed head would change the table's gradients.)
    k = {"tf_keras": tf_keras, "keras3": keras}[flavour]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 500, size=(16, 2)).astype(np.int32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    devices = [f"/cpu:{i}" for i in range(REPLICAS)]
    weights = {}
    for label, make in (("dense", compression.Dense),
                        # float32 values: rows as TF sends them cost less
                        ("dct", lambda: compression.DCTDP(sparsity=0.99,
                                                          value_dtype=None))):
      repl = tf_dct.Replicator(devices)
      with repl.scope():
        tf.keras.utils.set_random_seed(3)
        model = k.Sequential([k.Input((2,), dtype="int32"),
                              k.layers.Embedding(500, 16), k.layers.Flatten(),
                              k.layers.Dense(1, trainable=False)])
        compressor = make()
        opt = repl.wrap_optimizer(k.optimizers.Adam(0.01), compressor)
      opt.build(model.trainable_variables)

      def input_fn(ctx):
        del ctx
        return tf.data.Dataset.from_tensor_slices((ids, y)).batch(
            8, drop_remainder=True).repeat()

      step_fn = util.squared_error_step(model, opt, 8)
      for _ in range(3):
        repl.run(step_fn, input_fn)
      table = model.trainable_variables[0]
      if label == "dct":
        self.assertTrue(compressor.sends_as_is(table))
        self.assertFalse(compressor.corrects_optimizer(table))
      weights[label] = [np.asarray(v) for v in model.trainable_variables]
    self.assertLen(weights["dct"], 1)
    self.assertAllClose(weights["dct"][0], weights["dense"][0], atol=1e-7,
                        rtol=1e-6)



class Keras3VariableTest(tf.test.TestCase, parameterized.TestCase):
  """Every public method that takes a variable accepts a Keras 3 variable
  and answers as for the tf.Variable behind it (what the aggregation sees)."""

  @parameterized.named_parameters(
      ("sgd", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
      ("adam", lambda: keras.optimizers.Adam(0.01)))
  def test_lookups_match_the_backing_variable(self, make_optimizer):
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(REPLICAS)])
    with repl.scope():
      keras.utils.set_random_seed(1)
      model = keras.Sequential([keras.Input((4,)),
                                keras.layers.Dense(8, name="body"),
                                keras.layers.Dense(1, name="head")])
      compressor = compression.DCTDP(sparsity=0.5, min_count=0,
                                     exclude=("/head/",),
                                     dense_gradients="compress")
      opt = repl.wrap_optimizer(make_optimizer(), compressor)
    variables = model.trainable_variables
    self.assertIsInstance(variables[0], keras.Variable)
    compressor.create_states(variables)
    opt.build(variables)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    y = rng.normal(size=(8, 1)).astype(np.float32)

    def input_fn(ctx):
      del ctx
      return util.without_autotune(
          tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat())

    step_fn = util.squared_error_step(model, opt, 8)
    for _ in range(2):
      repl.run(step_fn, input_fn)
    for v in variables:
      backing = v.value
      self.assertIsInstance(backing, tf.Variable)
      self.assertIs(compression.base.as_tf_variable(v, "test"), backing)
      head = v.path.startswith(f"{model.name}/head/")
      self.assertEqual(compressor.is_excluded(v), head)
      self.assertEqual(compressor.is_excluded(backing), head)
      for method in ("sends_as_is", "sends_whole", "corrects_momentum",
                     "corrects_optimizer", "check_variable"):
        self.assertEqual(getattr(compressor, method)(v),
                         getattr(compressor, method)(backing), method)
      self.assertEqual(compressor.dense_is_cheaper(v, REPLICAS),
                       compressor.dense_is_cheaper(backing, REPLICAS))
      self.assertIs(compressor.state_for(v), compressor.state_for(backing))
      got, want = compressor.state_values(v), compressor.state_values(backing)
      self.assertEqual(sorted(got), sorted(want))
      for key in want:
        self.assertAllEqual(got[key], want[key])
      if head:
        self.assertEqual(got, {})
      else:
        self.assertTrue(compressor.corrects_optimizer(v))
        self.assertGreater(np.abs(got["residual"]).sum(), 0)
    # One state per variable: the Keras 3 variables and the aggregation's
    # tf.Variables keyed the same entries.
    self.assertLen(compressor.state, len(variables))

  @parameterized.named_parameters(*[(name, name) for name in COMPRESSORS])
  def test_byte_model(self, name):
    compressor = COMPRESSORS[name](exclude=("bias",))
    for shape in ([8], [40, 4]):
      for var_name in ("bias", "kernel"):
        v = keras.Variable(np.zeros(shape, np.float32), name=var_name)
        self.assertEqual(compressor.compressed_bytes(v),
                         compressor.compressed_bytes(v.value))
        self.assertEqual(compressor.check_variable(v), np.prod(shape))
        self.assertEqual(compressor.is_excluded(v), var_name == "bias")
        for replicas in (2, 8):
          self.assertEqual(compressor.dense_is_cheaper(v, replicas),
                           compressor.dense_is_cheaper(v.value, replicas))
        grad = tf.IndexedSlices(tf.zeros([3] + shape[1:]), tf.range(3),
                                tf.constant(shape))
        self.assertEqual(compressor.stock_is_cheaper(grad, v, REPLICAS),
                         compressor.stock_is_cheaper(grad, v.value, REPLICAS))

  def test_aggregate_takes_a_keras3_variable(self):
    # One compressor is given the Keras 3 variable, another its tf.Variable:
    # same sums, and each gets back the variable it passed.
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(REPLICAS)],
                             input_replication=tf_dct.PER_REPLICA)
    given, backing = (compression.DCTDP(sparsity=0.8, min_count=0,
                                        dense_gradients="compress")
                      for _ in range(2))
    for c in (given, backing):
      c.bind(repl)
    with repl.scope():
      w = keras.Variable(np.zeros([N], np.float32), name="w")
    feed = np.random.default_rng(3).normal(
        size=(STEPS, REPLICAS, N)).astype(np.float32)

    def input_fn(replica_id):
      return util.without_autotune(
          tf.data.Dataset.from_tensor_slices(feed[:, replica_id]))

    def step_fn(g):
      ((out, var),) = given.aggregate([(g, w)])
      self.assertIs(var, w)
      ((want, var),) = backing.aggregate([(g, w.value)])
      self.assertIs(var, w.value)
      return out, want

    for _ in range(STEPS):
      for out, want in util.local(repl, repl.run(step_fn, input_fn)):
        self.assertAllEqual(out, want)
    self.assertAllEqual(given.state_values(w)["residual"],
                        backing.state_values(w)["residual"])
    self.assertGreater(np.abs(given.state_values(w)["residual"]).sum(), 0)

  def test_not_a_variable(self):
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(REPLICAS)])
    compressor = compression.DCTDP()
    compressor.bind(repl)
    with self.assertRaisesRegex(
        TypeError, r"^DCTDP: variable must be a tf.Variable or a Keras 3 "
        r"variable \(keras.Variable\), got str$"):
      compressor.state_values("kernel")
    with self.assertRaisesRegex(TypeError, "DCTDP: variables must be .* got "
                                "EagerTensor"):
      compressor.create_states([tf.zeros([3])])
    with self.assertRaisesRegex(TypeError, "DCTDP: grads_and_vars must be "):
      repl.run(lambda: compressor.aggregate([(tf.zeros([3]), tf.zeros([3]))]))
    self.assertEqual(compressor.state, {})
    # A Keras 3 variable whose value is not its tf.Variable (here in a
    # stateless scope) is named, not looked up by the tensor it reads as.
    v = keras.Variable(np.zeros([3], np.float32), name="v")
    with keras.StatelessScope(state_mapping=[(v, tf.ones([3]))]):
      with self.assertRaisesRegex(
          TypeError, r"DCTDP: variable 'v' is a Keras 3 variable whose value "
          r"is not a tf.Variable but \w+; look it up outside autocast and "
          "stateless scopes"):
        compressor.state_for(v)


if __name__ == "__main__":
  tf.test.main()
