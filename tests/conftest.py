"""Process-wide settings every test module needs before TensorFlow loads."""

import gc
import os

# TFRS needs tf.keras to be Keras 2; we import tf_keras / keras explicitly.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

# tf.test.TestCase helpers (create_tempdir, get_temp_dir) read absl flags,
# which pytest never parses.
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

if not flags.FLAGS.is_parsed():
  flags.FLAGS.mark_as_parsed()


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test():
  """Python's cyclic garbage collector runs between tests, never during one.

  A finished training run (a model, a Job, a replicator's datasets) is freed
  by the cyclic collector; freeing its tf.data iterators while another test
  traces or steps can block for as long as their autotuning threads sleep
  (pauses of 10-60 s landed in unrelated tests). Collected right after the
  test that made them, they go quickly.
  """
  gc.disable()
  try:
    yield
  finally:
    gc.enable()
    gc.collect()


def pytest_collection_finish(session):
  """Takes what collection imported out of the per-test collections.

  TensorFlow, both Kerases and the test modules (some 400,000 objects) live
  for the whole session, yet every full collection walks all of them again:
  about 0.2 s of CPU after each of the ~900 tests. Frozen (moved to the
  permanent generation), they are skipped, and each collection only walks
  what the tests made. Frozen objects are still freed by reference counting
  (only cycles among them would stay, and these objects stay anyway).
  """
  del session
  # Every distributed dataset's per-device iterators would start tf.data
  # autotune threads, and freeing the iterator waits for them (stalls of
  # 5-60 s after a fit or a custom loop); see the function's docstring.
  from tf_dct import _private  # pylint: disable=g-import-not-at-top
  _private.per_device_iterators_without_autotune()
  gc.collect()
  gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
  """After a file's last test (and its class and module teardown), what
  survives is frozen too: TensorFlow's and Keras's caches and registries
  grow by some 100,000 objects per file, which the next file's collections
  would otherwise walk after every test (0.1-0.2 s each after two files)."""
  yield
  if nextitem is None or nextitem.path != item.path:
    gc.collect()
    gc.freeze()


def pytest_configure(config):
  # Under `--dist loadfile`, pytest-xdist hands out files in the order
  # `pytest_collection_modifyitems` leaves them (see there), not re-sorted
  # by their number of tests.
  if getattr(config.option, "dist", None) == "loadfile":
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  # tf.test.TestCase inherits a deprecated `test_session` context manager that
  # pytest collects as a (skipped) test; it is not one.
  items[:] = [item for item in items if item.name != "test_session"]
  # Longest first, so that two xdist workers finish together instead of one
  # running a long file alone at the end. A file's cost estimate is one
  # second per test plus the `seconds` of each `slow(seconds=N)` mark in it
  # (a mark on a class or module counts once: N is the time of all of it).
  cost = {}
  marks = set()
  for item in items:
    cost[item.path] = cost.get(item.path, 0.0) + 1.0
    for node in item.listchain():
      for i, mark in enumerate(node.own_markers):
        if mark.name == "slow" and (node.nodeid, i) not in marks:
          marks.add((node.nodeid, i))
          cost[item.path] += float(mark.kwargs.get("seconds", 0.0))
  items.sort(key=lambda item: -cost[item.path])   # stable: files stay whole


# TensorFlow can take minutes to destroy distributed iterators and collective
# executors when the interpreter exits (seen: 6 minutes after the last test).
# Once pytest has printed its summary nothing is left to run, so end the
# process there with pytest's own exit status.
_exit_status = None


def pytest_sessionfinish(session, exitstatus):
  del session
  global _exit_status
  _exit_status = int(exitstatus)


def pytest_unconfigure(config):
  # Under pytest-xdist only the controller leaves this way: a worker must
  # close its channel to the controller normally (the controller tears the
  # workers down, killing one that hangs).
  if hasattr(config, "workerinput"):
    return
  if _exit_status is not None and os.environ.get("TF_DCT_FAST_EXIT", "1") == "1":
    import sys  # pylint: disable=g-import-not-at-top
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)  # pylint: disable=protected-access
