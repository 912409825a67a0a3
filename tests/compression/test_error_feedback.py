"""tf_dct.compression.error_feedback: IndexedSlices vs densified, per compressor."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import tf_dct
from tf_dct import compression
from tf_dct.compression import error_feedback
from tests import util
from tests.compression import harness

DCTDP = harness.compress_all(compression.DCTDP)
TopK = harness.compress_all(compression.TopK)
DEFT = harness.compress_all(compression.DEFT)
CLTK = harness.compress_all(compression.CLTK)
HardThreshold = harness.compress_all(compression.HardThreshold)


def setUpModule():
  util.setup_cpus()


# min_count=0: on these tiny variables the default floor of 8 entries would
# send nearly everything and leave no residual to compare.
# The compressors' own path for IndexedSlices ("compress"; "auto" would send
# these small tables as TF does, see tests/compression/test_base.py).
COMPRESSORS = {
    "DCTDP": lambda: DCTDP(sparsity=0.8, threshold_life=3,
                                       capacity_factor=1.5, min_count=0,
                                       sparse_gradients="compress"),
    "DEFT": lambda: DEFT(density=0.2, min_count=0,
                                     sparse_gradients="compress"),
    "TopK": lambda: TopK(density=0.2, capacity_factor=1.5,
                                     min_count=0, sparse_gradients="compress"),
    "CLTK": lambda: CLTK(density=0.2, sparse_gradients="compress"),
    "HardThreshold": lambda: HardThreshold(
        0.5, capacity_density=0.3, sparse_gradients="compress"),
}


def _slices_run(make, replicas, steps, jit_compile, seed=0, make_dense=None):
  """Same IndexedSlices fed as slices to one compressor, densified to another
  (made by `make_dense`, default `make`)."""
  rows, width, k = 6, 3, 5
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, rows, size=(steps, replicas, k)).astype(np.int32)
  ids[:, :, 1] = ids[:, :, 0]  # duplicates on every step and replica
  ids[:, :, 4] = ids[:, :, 0]
  vals = rng.normal(size=(steps, replicas, k, width)).astype(np.float32)
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA,
                           jit_compile=jit_compile)
  sparse, dense = make(), (make_dense or make)()
  for c in (sparse, dense):
    c.bind(repl)
  with repl.scope():
    table = tf.Variable(tf.zeros([rows, width]), name="table")

  def input_fn(replica_id):
    return tf.data.Dataset.from_tensor_slices((ids[:, replica_id],
                                               vals[:, replica_id]))

  def step_fn(batch):
    i, v = batch
    g = tf.IndexedSlices(v, i, tf.constant([rows, width]))
    a = sparse.aggregate([(g, table)])[0][0]
    b = dense.aggregate([(tf.convert_to_tensor(g), table)])[0][0]
    return a, b

  history = []
  for _ in range(steps):
    out = util.local(repl, repl.run(step_fn, input_fn))
    states = [{key: np.asarray(v) for key, v in c.state_values(table).items()}
              for c in (sparse, dense)]
    history.append((out, states))
  return history


class IndexedSlicesTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      [(f"{name}_2_replicas", name, 2, False) for name in COMPRESSORS]
      + [("DCTDP_1_replica_xla", "DCTDP", 1, True),
         # Slices through the native kernel, the densified gradient through
         # stock ops.
         ("DCTDP_native_vs_stock", "DCTDP", 2, False,
          lambda: DCTDP(sparsity=0.8, threshold_life=3,
                                    capacity_factor=1.5, native=False,
                                    min_count=0, sparse_gradients="compress"))])
  def test_matches_densified_path(self, name, replicas, jit_compile,
                                  make_dense=None):
    history = _slices_run(COMPRESSORS[name], replicas, steps=4,
                          jit_compile=jit_compile, make_dense=make_dense)
    # Bit-identical without XLA; XLA may sum the duplicates in another order.
    same = self.assertAllClose if jit_compile else self.assertAllEqual
    tol = {"atol": 1e-6, "rtol": 0} if jit_compile else {}
    for t, (out, (st_sparse, st_dense)) in enumerate(history):
      for r in range(replicas):
        same(out[r][0], out[r][1], msg=f"update step {t}", **tol)
      self.assertEqual(set(st_sparse), set(st_dense))
      for key in st_sparse:
        if st_sparse[key].dtype.kind == "f":
          same(st_sparse[key], st_dense[key], msg=f"{key} step {t}", **tol)
        else:
          self.assertAllEqual(st_sparse[key], st_dense[key], msg=f"{key} step {t}")
    self.assertTrue(np.any(history[-1][1][0]["residual"] != 0))
    self.assertTrue(np.any(history[-1][0][0][0] != 0))


class HelpersTest(tf.test.TestCase):

  def test_combine_rows_sums_duplicates_like_densify(self):
    ids = tf.constant([3, 1, 3, 0, 3], tf.int64)
    vals = tf.constant(np.arange(10, dtype=np.float32).reshape(5, 2))
    slices = tf.IndexedSlices(vals, ids, tf.constant([4, 2]))
    row_ids, summed = error_feedback.combine_rows(slices, 2)
    dense = np.zeros((4, 2), np.float32)
    for i, v in zip(ids.numpy(), vals.numpy()):
      dense[i] += v
    rebuilt = np.zeros((4, 2), np.float32)
    for i, v in zip(row_ids.numpy(), summed.numpy()):
      rebuilt[i] += v
    self.assertAllEqual(rebuilt, dense)
    self.assertLen(set(row_ids.numpy()[:3]), 3)  # 3 distinct rows first
    self.assertAllEqual(summed.numpy()[3:], np.zeros((2, 2)))

  def test_non_finite_slices_are_caught(self):
    v = tf.Variable(tf.zeros([2, 2]), name="emb")
    g = tf.IndexedSlices(tf.constant([[np.nan, 1.0]]), tf.constant([1]),
                         tf.constant([2, 2]))
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "Owner: non-finite gradient for variable emb"):
      error_feedback.check_finite("Owner", [g], [v])[0].values.numpy()


  def test_all_finite(self):
    slices = lambda x: tf.IndexedSlices(tf.constant([[x, 1.0]]), tf.constant([1]),
                                        tf.constant([2, 2]))
    dense = tf.constant([1.0, -2.0])
    self.assertTrue(error_feedback.all_finite([dense, slices(3.0)]).numpy())
    self.assertTrue(error_feedback.all_finite([]).numpy())
    for bad in (np.nan, np.inf, -np.inf):
      self.assertFalse(error_feedback.all_finite([dense, slices(bad)]).numpy())
      self.assertFalse(error_feedback.all_finite(
          [tf.constant([bad, 0.0]), slices(3.0)]).numpy())


class GateTest(tf.test.TestCase):

  def test_ops_under_the_checks_get_one_control_input(self):
    # Every op under tf.control_dependencies(xs) gets each x as a control
    # input: with one per gradient, a step of V variables had O(V^2) edges.
    inputs = {}

    @tf.function
    def fn(grads):
      checked = error_feedback.check_finite("t", grads, variables)
      with tf.control_dependencies(error_feedback.dependencies(checked)):
        inputs["const"] = tf.constant(1.0).op.control_inputs
      with tf.control_dependencies(error_feedback.gate(checked + [None])):
        inputs["after"] = tf.constant(2.0).op.control_inputs
      return checked

    variables = [tf.Variable(tf.zeros([3]), name=f"v{i}") for i in range(20)]
    out = fn([tf.fill([3], float(i)) for i in range(20)])
    self.assertLen(inputs["const"], 1)
    self.assertLen(inputs["after"], 1)
    self.assertLen(inputs["const"][0].control_inputs, 20)  # the gate waits for all
    self.assertAllEqual(out[19], [19.0] * 3)
    # Eagerly nothing needs gating: the checks have run already.
    eager = [tf.constant([1.0])]
    self.assertEqual(error_feedback.gate(eager), eager)


class _State:
  """Stands in for a PerReplicaState: `local()` is one plain variable."""

  def __init__(self, value):
    self.variable = tf.Variable(value)

  def local(self):
    return self.variable


class ReadCheckedTest(parameterized.TestCase, tf.test.TestCase):

  def test_only_the_reads_wait_for_the_checks(self):
    seen = {}

    @tf.function
    def fn(grads):
      checked = error_feedback.check_finite("t", grads, variables)
      deps = error_feedback.dependencies(checked)
      values = error_feedback.read_checked(deps, states, ("residual", "step"))
      seen["reads"] = [v[key].op for v in values if v for key in v]
      seen["empty"] = values[1]
      acc = checked[0] + values[0]["residual"]
      seen["acc"] = acc.op
      return acc, values[2]["step"]

    variables = [tf.Variable(tf.zeros([2]), name=f"v{i}") for i in range(3)]
    states = [{"residual": _State([1.0, 2.0]), "step": _State(5)}, {},
              {"residual": _State([0.0, 0.0]), "step": _State(7)}]
    acc, step = fn([tf.constant([1.0, 1.0])] * 3)
    self.assertAllEqual(acc, [2.0, 3.0])
    self.assertEqual(int(step), 7)
    self.assertEqual(seen["empty"], {})
    self.assertLen(seen["reads"], 4)
    for op in seen["reads"]:  # read_value(): Identity(ReadVariableOp)
      read = op if op.type == "ReadVariableOp" else op.inputs[0].op
      self.assertEqual(read.type, "ReadVariableOp")
      self.assertLen(read.control_inputs, 1)  # the one gate over the checks
      self.assertLen(read.control_inputs[0].control_inputs, 3)
    self.assertEqual(seen["acc"].control_inputs, [])  # waits through its data

  def test_gradients_checked_by_the_caller_are_skipped(self):
    seen = {}

    @tf.function
    def fn(grads):
      checked, values, dense = error_feedback.checked_reads(
          "t", grads, variables, states, ("residual",),
          checked_by_caller=[True, False, False])
      seen["checked"] = checked
      seen["read"] = values[0]["residual"].op
      seen["dense"] = dense
      return checked[0] + values[0]["residual"]

    variables = [tf.Variable(tf.zeros([2]), name=f"v{i}") for i in range(3)]
    states = [{"residual": _State([1.0, 2.0])}, {}, {"residual": _State([0.0, 0.0])}]
    # The NaN of gradient 0 passes: its caller checks it (a native kernel).
    out = fn([tf.constant([np.nan, 1.0]), tf.constant([1.0, 1.0]),
              tf.constant([2.0, 2.0])])
    self.assertTrue(np.isnan(out[0]))
    self.assertEqual(seen["checked"][0].op.type, "Placeholder")  # unchecked
    self.assertEqual([c.op.type for c in seen["checked"][1:]],
                     ["CheckNumerics", "CheckNumerics"])
    read = seen["read"] if seen["read"].type == "ReadVariableOp" else (
        seen["read"].inputs[0].op)
    gate = read.control_inputs[0]  # the reads still wait for the other checks
    self.assertCountEqual([c.type for c in gate.control_inputs],
                          ["CheckNumerics", "CheckNumerics"])
    self.assertEqual([i for i, _ in seen["dense"]], [1])
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "t: non-finite"):
      fn([tf.constant([1.0, 1.0]), tf.constant([np.inf, 1.0]),
          tf.constant([2.0, 2.0])])

  def test_non_finite_gradient_raises_before_the_read(self):
    state = {"residual": _State([1.0])}
    variables = [tf.Variable([0.0], name="w")]

    @tf.function
    def fn(grads):
      checked = error_feedback.check_finite("t", grads, variables)
      values = error_feedback.read_checked(
          error_feedback.dependencies(checked), [state], ("residual",))
      with tf.control_dependencies([values[0]["residual"]]):
        return state["residual"].variable.assign([9.0])

    with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "non-finite"):
      fn([tf.constant([np.nan])])
    self.assertAllEqual(state["residual"].variable, [1.0])

  @parameterized.named_parameters(
      # Stock ops: the native kernel checks its own gradient (test_dct_dp).
      ("DCTDP", lambda: DCTDP(0.8, threshold_life=3, min_size=10,
                                          native=False), 2),
      ("DEFT", lambda: DEFT(0.2, min_size=10), 2),
      ("TopK", lambda: TopK(0.2, min_size=10), 2),
      ("CLTK", lambda: CLTK(0.2, min_size=10), 2),
      ("HardThreshold", lambda: HardThreshold(0.5, min_size=10), 2))
  def test_in_a_step_only_reads_and_dense_sums_wait_for_the_checks(
      self, make, reads_per_replica):
    # A control edge from the checks on every op of the step cost grappler
    # minutes on large models; every other op waits through its data.
    shapes = [(6, 5), (3,)]  # the second is below min_size: dense, no state
    repl, step_fn, _, _ = harness.run(
        make(), harness.gradients(1, 2, shapes=shapes), 2, shapes=shapes)
    step = repl._steps[(step_fn, next(iter(repl._inputs)))]  # pylint: disable=protected-access
    ops = step.get_concrete_function().graph.get_operations()
    gates = {op for op in ops if op.type == "NoOp" and op.control_inputs
             and all(c.type == "CheckNumerics" for c in op.control_inputs)}
    self.assertLen(gates, 2)  # one per replica
    waiting = [op for op in ops if gates & set(op.control_inputs)]
    self.assertLen([op for op in waiting if op.type == "ReadVariableOp"],
                   2 * reads_per_replica)
    self.assertLen([op for op in waiting if op.type == "Identity"], 2)
    self.assertLen(waiting, 2 * reads_per_replica + 2)


# Compressors whose selection reshapes a gradient to the variable's shape.
RESHAPING = {
    "DCTDP": lambda: DCTDP(0.5, min_count=0, native=False,
                           sparse_gradients="compress"),
    "DCTDP_native": lambda: DCTDP(0.5, min_count=0,
                                  sparse_gradients="compress"),
    "TopK": lambda: TopK(0.5, min_count=0, sparse_gradients="compress"),
    "DEFT": lambda: DEFT(0.5, min_count=0, sparse_gradients="compress"),
}


def _bound(make, shape=(4, 3), dtype=tf.float32, name="kernel"):
  """A compressor bound to a 2-replica Replicator and one variable."""
  repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"])
  c = make()
  c.bind(repl)
  with repl.scope():
    v = tf.Variable(tf.zeros(shape, dtype), name=name)
  return repl, c, v


def _dense_step(repl, c, v, signature=None):
  """A step aggregating one dense gradient `g` of `v` on every replica."""
  @tf.function(input_signature=signature)
  def step(g):
    return repl.run(lambda: c.aggregate([(g, v)])[0][0])
  return step


def _slices_step(repl, c, v):
  """A step aggregating IndexedSlices (values, row ids) of table `v`."""
  @tf.function
  def step(values, ids):
    g = tf.IndexedSlices(values, ids, tf.constant(v.shape.as_list()))
    return repl.run(lambda: tf.convert_to_tensor(c.aggregate([(g, v)])[0][0]))
  return step


def _state(c, v):
  return {k: np.asarray(x) for k, x in c.state_values(v).items()}


class GradientChecksTest(tf.test.TestCase, parameterized.TestCase):

  def _assert_same_state(self, before, after):
    self.assertEqual(set(before), set(after))
    for key in before:
      self.assertAllEqual(before[key], after[key], msg=key)

  @parameterized.named_parameters(*[(n, n) for n in RESHAPING])
  def test_misshapen_gradient_raises_at_trace(self, name):
    repl, c, v = _bound(RESHAPING[name])
    owner = "DEFT" if name == "DEFT" else ("TopK" if name == "TopK" else "DCTDP")
    with self.assertRaisesRegex(
        ValueError, rf"{owner}: the gradient of variable 'kernel' has shape "
        r"\[3, 4\], the variable \[4, 3\]"):
      _dense_step(repl, c, v)(tf.ones([3, 4]))
    self.assertAllEqual(_state(c, v)["residual"], np.zeros([2, 4, 3]))

  @parameterized.named_parameters(*[(n, n) for n in RESHAPING])
  def test_misshapen_gradient_of_unknown_shape_moves_no_state(self, name):
    repl, c, v = _bound(RESHAPING[name])
    step = _dense_step(repl, c, v, [tf.TensorSpec(None, tf.float32)])
    step(tf.reshape(tf.range(12, dtype=tf.float32), [4, 3]))  # a good step
    before = _state(c, v)
    with self.assertRaisesRegex(
        tf.errors.InvalidArgumentError,
        r"the gradient of variable kernel must have the shape of the "
        r"variable, \[4, 3\]"):
      step(tf.reshape(tf.range(12, dtype=tf.float32), [3, 4]))
    self._assert_same_state(before, _state(c, v))

  @parameterized.named_parameters(*[(n, n) for n in RESHAPING])
  def test_misshapen_indexed_slices_raise_at_trace(self, name):
    repl, c, v = _bound(RESHAPING[name], shape=(6, 3), name="table")
    step = _slices_step(repl, c, v)
    with self.assertRaisesRegex(
        ValueError, r"IndexedSlices gradient of variable 'table' has rows of "
        r"shape \[4\], the variable \[6, 3\]"):
      step(tf.ones([2, 4]), tf.constant([0, 1]))

    @tf.function
    def wrong_dense_shape():
      g = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1]),
                           tf.constant([7, 3]))
      return repl.run(lambda: tf.convert_to_tensor(c.aggregate([(g, v)])[0][0]))

    with self.assertRaisesRegex(
        ValueError, r"IndexedSlices gradient of variable 'table' has "
        r"dense_shape \[7, 3\], the variable \[6, 3\]"):
      wrong_dense_shape()

  @parameterized.named_parameters(*[(n, n) for n in RESHAPING])
  def test_row_id_out_of_range_moves_no_state(self, name):
    repl, c, v = _bound(RESHAPING[name], shape=(6, 3), name="table")
    step = _slices_step(repl, c, v)
    values = tf.reshape(tf.range(6, dtype=tf.float32), [2, 3])
    step(values, tf.constant([0, 5]))  # a good step
    before = _state(c, v)
    for bad in (6, -1):
      with self.assertRaisesRegex(
          tf.errors.InvalidArgumentError,
          r"IndexedSlices gradient of variable table: row ids must be in "
          r"\[0, 6\) \(its row count\)"):
        step(values, tf.constant([0, bad]))
      self._assert_same_state(before, _state(c, v))

  @parameterized.named_parameters(*[(n, n) for n in RESHAPING])
  def test_float64_is_compressed(self, name):
    repl, c, v = _bound(RESHAPING[name], dtype=tf.float64)
    g = tf.reshape(tf.range(12, dtype=tf.float64), [4, 3])
    out = util.local(repl, _dense_step(repl, c, v)(g))
    residuals = _state(c, v)["residual"]
    self.assertEqual(out[0].dtype, np.float64)
    self.assertEqual(residuals.dtype, np.float64)
    # Conservation: what was summed plus what is held back is every gradient.
    self.assertAllEqual(out[0] + residuals.sum(0), 2 * g.numpy())
    self.assertGreater(np.count_nonzero(residuals), 0)

  @parameterized.named_parameters(*[(n, n) for n in RESHAPING])
  def test_gradient_of_another_dtype_raises_at_trace(self, name):
    repl, c, v = _bound(RESHAPING[name])
    with self.assertRaisesRegex(
        TypeError, r"the gradient of variable 'kernel' has dtype float64, "
        r"the variable float32"):
      _dense_step(repl, c, v)(tf.ones([4, 3], tf.float64))

  @parameterized.named_parameters(
      ("DCTDP", compression.DCTDP, "int32", "float16, float32, float64"),
      ("DCTDP_bfloat16", compression.DCTDP, "bfloat16",
       "float16, float32, float64"),
      ("TopK", compression.TopK, "int32", "float16, float32, float64"),
      ("HardThreshold", lambda: HardThreshold(0.5), "bfloat16",
       "float16, float32, float64"),
      ("DEFT", compression.DEFT, "int32",
       "float16, bfloat16, float32, float64"),
      ("CLTK", compression.CLTK, "int64",
       "float16, bfloat16, float32, float64"))
  def test_unsupported_variable_dtype(self, make, dtype, supported):
    _, c, v = _bound(make, dtype=tf.as_dtype(dtype))
    with self.assertRaisesRegex(
        TypeError, rf"variable 'kernel:0' has dtype {dtype}; supported "
        rf"dtypes: {supported}$"):
      c.create_states([v])


if __name__ == "__main__":
  tf.test.main()
