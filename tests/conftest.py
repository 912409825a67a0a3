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


def pytest_collection_modifyitems(items):
  # tf.test.TestCase inherits a deprecated `test_session` context manager that
  # pytest collects as a (skipped) test; it is not one.
  items[:] = [item for item in items if item.name != "test_session"]


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
