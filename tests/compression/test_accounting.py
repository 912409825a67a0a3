"""Tests for the communication accounting of compressors (exact byte model)."""


import itertools
import math

from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from tf_dct import compression
from tf_dct.compression import Dense
from tf_dct.compression import accounting
from tf_dct.compression import sparse_wire
from tests import util
from tests.compression import harness
from tests.compression import test_native

CLTK = harness.compress_all(compression.CLTK)
DCTDP = harness.compress_all(compression.DCTDP)
DEFT = harness.compress_all(compression.DEFT)
TopK = harness.compress_all(compression.TopK)


def setUpModule():
  util.setup_cpus()


def _run(compressor, grads, shapes, replicas, logdir=None, step=None):
  """Feeds grads[t][r][v] through `compressor`; returns per-step outputs.

  `step`: a tf.Variable set to t + 1 before step t, the summaries' step.
  """
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA)
  compressor.bind(repl)
  with repl.scope():
    variables = [tf.Variable(tf.zeros(s), name=f"w{i}")
                 for i, s in enumerate(shapes)]

  def input_fn(replica_id):
    return tf.data.Dataset.from_tensor_slices(tuple(
        np.stack([g[replica_id][v] for g in grads]) for v in range(len(shapes))))

  def step_fn(g):
    return [a for a, _ in compressor.aggregate(list(zip(g, variables)))]

  writer = tf.summary.create_file_writer(logdir) if logdir else None
  outs = []
  for t in range(len(grads)):
    if step is not None:
      step.assign(t + 1)
    if writer:
      with writer.as_default(step=step):
        outs.append(util.local(repl, repl.run(step_fn, input_fn)))
    else:
      outs.append(util.local(repl, repl.run(step_fn, input_fn)))
  if writer:
    writer.flush()
  return outs


def _upstream(op):
  """Every op that `op` waits for, through data and control inputs."""
  seen, todo = set(), [op]
  while todo:
    current = todo.pop()
    for before in [t.op for t in current.inputs] + list(current.control_inputs):
      if before not in seen:
        seen.add(before)
        todo.append(before)
  return seen


class ByteModelTest(tf.test.TestCase, parameterized.TestCase):

  def test_ring_formulas(self):
    self.assertEqual(accounting.all_gather_bytes(24, 4), 72)
    self.assertEqual(accounting.all_reduce_bytes(100, 4), 150)
    self.assertEqual(accounting.all_reduce_bytes(100, 1), 0)

  def test_float64_vector_of_mixed_values(self):
    big = 2**40 + 1  # beyond float32 and int32: must stay exact
    cases = [
        ([3, 0.5, 7], [3.0, 0.5, 7.0]),  # Python numbers only
        ([tf.constant(2), 5, tf.constant(-1)], [2.0, 5.0, -1.0]),  # one cast
        ([tf.constant(2), 0.5], [2.0, 0.5]),  # 0.5 is not an int32
        ([tf.constant(big, tf.int64), tf.constant(1, tf.int32), 2],
         [float(big), 1.0, 2.0]),  # mixed dtypes
        ([tf.constant(0.25, tf.float64), big], [0.25, float(big)]),
    ]
    for values, want in cases:
      got = accounting._as_float64_vector(values)  # pylint: disable=protected-access
      self.assertEqual(got.dtype, tf.float64)
      self.assertAllEqual(got, want)

  def test_dct_dp_exact_on_two_replicas_with_summaries(self):
    # w0: 40 entries, sparsity 0.9 -> K = 4 = capacity (factor 1); "ef"
    # layout: 4 x 3 low bits and a bitmap of (39 >> 3) + 4 bits, 1 word.
    # w1: 3 entries < min_size -> dense all-reduce of 12 bytes.
    replicas, shapes = 2, [(40,), (3,)]
    rng = np.random.default_rng(0)
    grads = [[[rng.normal(size=s).astype(np.float32) for s in shapes]
              for _ in range(replicas)] for _ in range(2)]
    self.assertEqual(sparse_wire.choose_encoding(40, 4).name, "ef")
    # Index word + 4 bfloat16 values (the default), two to a word, all slots
    # used on both replicas at both steps; with exact sizes also the header
    # (the row length and w0's count) and the int32 length TensorFlow
    # gathers first.
    p = 4 + 2 * 4 + 2 * 4 + 4
    m = 3 * 4
    sent = (replicas - 1) * p + 2 * (replicas - 1) / replicas * m   # 36
    dense = 2 * (replicas - 1) / replicas * 4 * 43                  # 172
    logdir = self.create_tempdir().full_path
    compressor = DCTDP(sparsity=0.9, threshold_life=10, capacity_factor=1.0,
                       min_size=10, min_count=0)
    compressor.exact_sizes = True  # one machine's default is the fixed capacity
    with self.assertRaisesRegex(TypeError, "variable_summaries must be True, False or a "
                                "callable returning a boolean, got int"):
      compressor.variable_summaries = 1
    step = tf.Variable(0, dtype=tf.int64)
    compressor.variable_summaries = lambda: tf.equal(step % 2, 0)
    outs = _run(compressor, grads, shapes, replicas, logdir, step=step)
    stats = compressor.communication_stats()
    self.assertEqual(stats["num_replicas"], 2)
    self.assertEqual(stats["steps"], [2, 2])
    last, total = stats["last"], stats["total"]
    self.assertEqual(last["bytes_sent"], [sent] * 2)
    self.assertEqual(last["bytes_received"], [sent] * 2)
    self.assertEqual(last["payload_bytes"], [p + m] * 2)
    self.assertEqual(last["dense_bytes"], [dense] * 2)
    self.assertEqual(last["dense_payload_bytes"], [4 * 43] * 2)
    # Dense gradients: stock TF all-reduces them, as the densified baseline.
    self.assertEqual(last["stock_bytes"], [dense] * 2)
    self.assertEqual(last["stock_payload_bytes"], [4 * 43] * 2)
    self.assertEqual(total["bytes_sent"], [2 * sent] * 2)
    self.assertEqual(total["dense_bytes"], [2 * dense] * 2)
    nnz0 = int(np.count_nonzero(outs[-1][0][0]))
    self.assertEqual(last["nnz"], [nnz0 + 3] * 2)
    self.assertAllClose(last["density"], [(nnz0 + 3) / 43] * 2)
    self.assertEqual(last["sent"], [4 + 3] * 2)
    w0 = stats["variables"]["w0"]
    self.assertEqual(w0["size"], 40)
    self.assertEqual(w0["last"]["payload_bytes"], [p] * 2)
    self.assertAllClose(w0["last"]["density"], [nnz0 / 40] * 2)
    self.assertEqual(w0["last"]["local_density"], [0.1, 0.1])
    taus = compressor.state_values(_var(compressor, "w0"))["threshold"]
    self.assertEqual(w0["last"]["threshold"], [float(t) for t in taus])
    self.assertEqual(w0["counters"]["refreshes"], [1, 1])  # step 0 only
    self.assertEqual(stats["variables"]["w1"]["last"]["density"], [1.0, 1.0])
    self.assertTrue(all(s >= 0 for s in total["selection_seconds"]))
    # Summaries from local replica 0, at the default summary step.
    events = util.events(logdir)
    self.assertEqual(events["tf_dct/bytes_sent"], [(1, sent), (2, sent)])
    self.assertEqual(events["tf_dct/total_bytes_sent"], [(1, sent), (2, 2 * sent)])
    self.assertEqual([s for s, _ in events["tf_dct/compression_ratio"]], [1, 2])
    self.assertAllClose([v for _, v in events["tf_dct/compression_ratio"]],
                        [dense / sent] * 2)  # the totals' ratio
    residual = compressor.state_for(_var(compressor, "w0"))["residual"].numpy()[0]
    self.assertEqual([s for s, _ in events["tf_dct/residual_norm"]], [1, 2])
    self.assertAllClose(events["tf_dct/residual_norm"][-1][1],
                        np.linalg.norm(residual), rtol=1e-6)
    # The per-variable scalars only where their own condition holds too.
    self.assertEqual([s for s, _ in events["tf_dct_variables/density/w0"]], [2])
    self.assertEqual(events["tf_dct/dense_bytes"], [(1, dense), (2, dense)])
    self.assertEqual(events["tf_dct/stock_bytes"], [(1, dense), (2, dense)])
    self.assertAllClose([v for _, v in events["tf_dct/stock_ratio"]],
                        [dense / sent] * 2)
    self.assertAllClose([v for _, v in events["tf_dct/stock_payload_ratio"]],
                        [4 * 43 / (p + m)] * 2)
    self.assertAllClose(events["tf_dct_variables/density/w0"][-1][1], nnz0 / 40)
    self.assertAllClose(events["tf_dct_variables/threshold/w0"][-1][1], taus[0])
    self.assertIn("tf_dct/density", events)
    self.assertEqual(events["tf_dct_variables/refreshes/w0"], [(2, 1)])
    self.assertFalse([t for t in events if t.startswith("tf_dct/density/")])

  @parameterized.named_parameters(
      ("DCTDP", lambda: DCTDP(0.8, threshold_life=3, native=False), 2),
      ("DCTDP_native", lambda: DCTDP(0.8, threshold_life=3), 0),
      ("TopK", lambda: TopK(0.2), 2),
      ("CLTK", lambda: CLTK(0.2), 2),
      ("DEFT", lambda: DEFT(0.2), 2))
  def test_selection_time_is_one_span_per_replica_step(self, make, stamps):
    # Per-variable timers would serialize the variables' selections (TF runs
    # stateful ops without resource inputs in program order), so there are
    # exactly two Timestamp ops per replica, whatever the variable count.
    # Nor may one replica's timestamps wait for another's: in program order
    # they ran the replicas' selections one after another. The native DCT-DP
    # kernel times itself: no Timestamp at all.
    if stamps == 0:
      test_native.require_native(self)
    compressor = make()
    repl, step_fn, _, _ = harness.run(compressor, harness.gradients(2, 2), 2)
    step = repl._steps[(step_fn, next(iter(repl._inputs)))]  # pylint: disable=protected-access
    graph = step.get_concrete_function().graph
    ops = graph.get_operations()
    self.assertLen([op for op in ops if op.type == "Timestamp"], stamps * 2)
    replica = lambda op: op.name.split("/")[0] if op.name.startswith(
        "replica_") else "replica_0"
    for op in ops:
      if op.type == "Timestamp":
        self.assertEmpty([o.name for o in _upstream(op) if o.type == "Timestamp"
                          and replica(o) != replica(op)], msg=op.name)
    if stamps == 0:
      self.assertLen([op for op in ops if op.type == "TfDctSelect"], 2)
    stats = compressor.communication_stats()
    self.assertTrue(all(s > 0 for s in stats["total"]["selection_seconds"]))
    per_variable = [v["total"]["selection_seconds"]
                    for v in stats["variables"].values()]
    self.assertTrue(all(s > 0 for s in per_variable[0]))
    self.assertEqual(per_variable[1], [0.0, 0.0])

  def test_dense_reports_on_four_replicas(self):
    replicas, shapes = 4, [(5, 2)]
    grads = [[[np.ones(shapes[0], np.float32)] for _ in range(replicas)]]
    compressor = Dense()
    _run(compressor, grads, shapes, replicas)
    stats = compressor.communication_stats()
    want = 2 * 3 / 4 * 40
    self.assertEqual(stats["last"]["bytes_sent"], [want] * 4)
    self.assertEqual(stats["last"]["dense_bytes"], [want] * 4)
    self.assertEqual(stats["last"]["payload_bytes"], [40.0] * 4)
    self.assertEqual(stats["last"]["density"], [1.0] * 4)

  def test_dense_records_the_all_gather_of_indexed_slices(self):
    # TF's collectives gather IndexedSlices (row count, values, int64 row
    # ids) instead of all-reducing the table: 3 rows of width 4 ->
    # P = 4 + 48 + 24 bytes, the stock baseline itself.
    repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"])
    compressor = Dense()
    compressor.bind(repl)
    with repl.scope():
      table = tf.Variable(tf.zeros([10, 4]), name="table")

    def step_fn():
      ctx = tf.distribute.get_replica_context()
      rows = tf.cast(ctx.replica_id_in_sync_group, tf.int64) + tf.constant(
          [0, 2, 5], tf.int64)
      g = tf.IndexedSlices(tf.ones([3, 4]), rows, tf.constant([10, 4]))
      return tf.convert_to_tensor(compressor.aggregate([(g, table)])[0][0])

    out = repl.experimental_local_results(repl.run(tf.function(step_fn)))
    want = np.zeros((10, 4), np.float32)
    for r in range(2):
      want[[r, r + 2, r + 5]] += 1
    self.assertAllEqual(out[0], want)
    stats = compressor.communication_stats()["last"]
    self.assertEqual(stats["payload_bytes"], [76.0, 76.0])
    self.assertEqual(stats["bytes_sent"], [76.0, 76.0])  # (n - 1) * P
    self.assertEqual(stats["stock_payload_bytes"], [76.0, 76.0])
    self.assertEqual(stats["stock_bytes"], [76.0, 76.0])
    self.assertEqual(stats["dense_bytes"], [160.0, 160.0])
    self.assertEqual(stats["sent"], [12, 12])
    self.assertEqual(stats["nnz"], [24, 24])  # gathered entries (upper bound)

  def test_no_steps_yet(self):
    compressor = DCTDP()
    compressor.bind(tf_dct.Replicator(["/cpu:0", "/cpu:1"]))
    stats = compressor.communication_stats()
    self.assertEqual(stats["steps"], [0, 0])
    self.assertEqual(stats["variables"], {})


def _distinct_counts(lookups, rows):
  """(counts, probabilities) of the distinct rows among `lookups` uniform
  row ids of `rows` rows, by enumerating all rows ** lookups sequences."""
  counts = [len(set(ids)) for ids in itertools.product(range(rows),
                                                        repeat=lookups)]
  values, freq = np.unique(counts, return_counts=True)
  return values.astype(np.float64), freq / freq.sum()


class DistinctRowsTest(tf.test.TestCase, parameterized.TestCase):

  def test_exact_expectation(self):
    for rows in (1, 2, 3, 4):
      for lookups in (1, 2, 3, 5):
        values, p = _distinct_counts(lookups, rows)
        mean = float(values @ p)
        std = math.sqrt(float((values - mean) ** 2 @ p))
        self.assertAllClose(accounting.distinct_rows(lookups, rows), mean,
                            rtol=1e-12, atol=1e-12)
        cap = min(lookups, rows)
        for replicas in (2, 3, 8):
          got = accounting.distinct_rows(lookups, rows, replicas)
          # mu + sigma (R - 1) / sqrt(2R - 1), at most min(lookups, rows) ...
          self.assertAllClose(
              got, min(cap, mean + std * (replicas - 1)
                       / math.sqrt(2 * replicas - 1)), rtol=1e-12, atol=1e-12)
          # ... and no less than the exact expected largest of R counts
          cdf = np.cumsum(p)
          largest = float(values @ np.diff(cdf ** replicas, prepend=0.0))
          self.assertGreaterEqual(got, largest - 1e-12)
    self.assertEqual(accounting.distinct_rows(0, 7, 4), 0.0)
    self.assertEqual(accounting.distinct_rows(9, 1, 4), 1.0)

  def test_large_table_keeps_its_digits(self):
    # 10^5 ids of 10^12 rows: expected duplicates C(n, 2) / V - C(n, 3) / V^2
    # + ..., variance about C(n, 2) / V (collisions are nearly Poisson).
    n, v = 10**5, 10**12
    mean = accounting.distinct_rows(n, v)
    self.assertAllClose(n - mean, n * (n - 1) / 2 / v
                        - n * (n - 1) * (n - 2) / 6 / v**2, rtol=1e-6)
    self.assertEqual(accounting.distinct_rows(n, v, 2), n)  # capped
    n, v = 10**6, 10**7  # not capped
    spread = (accounting.distinct_rows(n, v, 2) - accounting.distinct_rows(n, v)) * math.sqrt(3)
    e1, e2 = math.exp(-n / v), math.exp(-2 * n / v)  # V -> inf at fixed n / V
    self.assertAllClose(spread, math.sqrt(v * (e1 - (1 + n / v) * e2)),
                        rtol=1e-4)

  def test_monte_carlo(self):
    # Uniform ids: the largest of 2 replicas' distinct counts (800 pairs).
    rng = np.random.default_rng(0)
    n, v = 1000, 1000
    counts = np.array([len(np.unique(rng.integers(0, v, n)))
                       for _ in range(1600)], np.float64).reshape(800, 2)
    largest = counts.max(1)
    error = largest.std() / math.sqrt(len(largest))
    self.assertAllClose(largest.mean(), accounting.distinct_rows(n, v, 2),
                        atol=4 * error, rtol=0)
    # Skewed ids (Zipf, exponent 1) repeat rows more: far fewer distinct rows.
    p = 1 / np.arange(1, v + 1)
    skewed = [len(np.unique(rng.choice(v, n, p=p / p.sum())))
              for _ in range(40)]
    self.assertLess(max(skewed), 0.6 * accounting.distinct_rows(n, v))

  def test_bad_input(self):
    for args, message in (
        ((-1, 5), "lookups must be an int >= 0, got -1"),
        ((2.0, 5), "lookups must be an int >= 0, got 2.0"),
        ((True, 5), "lookups must be an int >= 0, got True"),
        ((3, 0), "rows must be an int >= 1, got 0"),
        ((3, None), "rows must be an int >= 1, got None"),
        ((3, 5, 0), "replicas must be an int >= 1, got 0")):
      with self.assertRaisesRegex(ValueError, "distinct_rows: " + message):
        accounting.distinct_rows(*args)


class StockBaselineTest(tf.test.TestCase, parameterized.TestCase):
  """Baselines priced as stock TF sends each gradient, and densified.

  The model: int32 ids [batch, 2] -> Embedding(10, 4) -> Flatten ->
  Dense(1), on 4 replicas with 3 examples each. Per replica and step, by
  hand (n = 4: ring all-gather (n - 1) P = 3P, all-reduce 2 (n - 1) / n M =
  1.5M):

  | variable | stock payload | stock ring | densified payload | densified ring |
  |---|---|---|---|---|
  | embeddings [10, 4] | 4 + 6 * (16 + 4) = 124 | 372 | 160 | 240 |
  | kernel [8, 1] | 32 | 48 | 32 | 48 |
  | bias [1] | 4 | 6 | 4 | 6 |
  | total | 160 | 426 | 196 | 294 |

  The embedding's gradient is IndexedSlices of 6 rows (3 examples x 2 ids,
  duplicates kept): a 4-byte row count, 6 rows of 4 float32 values and 6
  int32 row ids.
  """

  REPLICAS, PER_REPLICA = 4, 3
  STOCK = {40: (124, 372), 8: (32, 48), 1: (4, 6)}      # size: payload, ring
  DENSIFIED = {40: (160, 240), 8: (32, 48), 1: (4, 6)}

  def test_indexed_slices_payload(self):
    self.assertEqual(accounting.indexed_slices_payload(6, 16, 4), 124)
    # TF pads values and row ids to the largest count over the replicas.
    self.assertEqual(accounting.indexed_slices_payload(6, 16, 4, max_rows=9),
                     4 + 9 * 20)
    got = accounting.indexed_slices_payload(tf.constant(6), 16, 8)
    self.assertEqual(got.dtype, tf.float64)
    self.assertEqual(float(got), 4 + 6 * 24)

  def _train(self, compressor, steps=2):
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(self.REPLICAS)],
                             input_replication=tf_dct.PER_REPLICA)
    with repl.scope():
      model = tf_keras.Sequential([
          tf_keras.Input((2,), dtype=tf.int32),
          tf_keras.layers.Embedding(10, 4), tf_keras.layers.Flatten(),
          tf_keras.layers.Dense(1)])
      opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(0.1),
                                compression=compressor)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 10, size=(steps * self.PER_REPLICA, 2), dtype=np.int32)
    ids[0] = [3, 3]  # a duplicate id is a row of its own
    y = rng.normal(size=(steps * self.PER_REPLICA, 1)).astype(np.float32)

    def input_fn(replica_id):
      del replica_id
      return tf.data.Dataset.from_tensor_slices((ids, y)).batch(
          self.PER_REPLICA, drop_remainder=True)

    def step_fn(batch):
      x, target = batch
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x) - target))
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(steps):
      repl.run(step_fn, input_fn)
    return opt.communication_stats()

  def _assert_baselines(self, stats, steps):
    n = self.REPLICAS
    by_size = {v["size"]: v for v in stats["variables"].values()}
    self.assertEqual(sorted(by_size), [1, 8, 40])
    for size, var in by_size.items():
      for figures, (payload, ring) in (
          (("stock_payload_bytes", "stock_bytes"), self.STOCK[size]),
          (("dense_payload_bytes", "dense_bytes"), self.DENSIFIED[size])):
        self.assertEqual(var["last"][figures[0]], [payload] * n, msg=size)
        self.assertEqual(var["last"][figures[1]], [ring] * n, msg=size)
        self.assertEqual(var["total"][figures[1]], [steps * ring] * n, msg=size)
    for key, want in (("stock_payload_bytes", 160), ("stock_bytes", 426),
                      ("dense_payload_bytes", 196), ("dense_bytes", 294)):
      self.assertEqual(stats["last"][key], [want] * n, msg=key)
      self.assertEqual(stats["total"][key], [steps * want] * n, msg=key)

  def test_dense_sends_exactly_the_stock_baseline(self):
    stats = self._train(None)
    self._assert_baselines(stats, 2)
    self.assertEqual(stats["last"]["bytes_sent"], [426] * self.REPLICAS)
    self.assertEqual(stats["last"]["bytes_received"], [426] * self.REPLICAS)
    self.assertEqual(stats["last"]["payload_bytes"], [160] * self.REPLICAS)

  def test_compressor_is_priced_against_the_incoming_gradient(self):
    # DCT-DP compresses the table (and densifies the 1-entry bias below
    # min_size); the baselines still price the gradients it was handed.
    stats = self._train(DCTDP(sparsity=0.9, threshold_life=2, min_size=2,
                              min_count=8))
    self._assert_baselines(stats, 2)
    table = next(v for v in stats["variables"].values() if v["size"] == 40)
    self.assertLess(table["last"]["payload_bytes"][0], 124)

  def test_dynamic_row_count(self):
    # Ids of unknown count (boolean_mask) give IndexedSlices of a dynamic
    # number of rows: 5 int64 row ids -> P = 4 + 5 * (16 + 8) = 124.
    n = 2
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(n)])
    compressor = Dense()
    compressor.bind(repl)
    with repl.scope():
      table = tf.Variable(tf.zeros([10, 4]), name="table")

    @tf.function
    def step():
      def step_fn():
        keep = tf.logical_and(tf.constant([True] * 5 + [False]),
                              tf.reduce_sum(table) >= 0)  # known at run time
        ids = tf.boolean_mask(tf.constant([1, 4, 4, 7, 9, 2], tf.int64), keep)
        with tf.GradientTape() as tape:
          loss = tf.reduce_sum(tf.gather(table, ids))
        grad = tape.gradient(loss, table)
        self.assertIsInstance(grad, tf.IndexedSlices)
        self.assertIsNone(grad.indices.shape[0])
        return tf.convert_to_tensor(compressor.aggregate([(grad, table)])[0][0])
      return repl.run(step_fn)

    out = repl.experimental_local_results(step())
    self.assertEqual(float(tf.reduce_sum(out[0])), n * 5 * 4)
    stats = compressor.communication_stats()["last"]
    for key in ("stock_payload_bytes", "payload_bytes"):
      self.assertEqual(stats[key], [124.0] * n, msg=key)
    for key in ("stock_bytes", "bytes_sent", "bytes_received"):
      self.assertEqual(stats[key], [(n - 1) * 124.0] * n, msg=key)
    self.assertEqual(stats["dense_bytes"], [160.0] * n)


def _var(compressor, name):
  for ref, _ in compressor._keys.items():  # pylint: disable=protected-access
    if ref.deref().name.startswith(name + ":"):
      return ref.deref()
  raise KeyError(name)


if __name__ == "__main__":
  tf.test.main()
