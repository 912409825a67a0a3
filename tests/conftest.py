"""Process-wide settings every test module needs before TensorFlow loads."""

import os

# TFRS needs tf.keras to be Keras 2; we import tf_keras / keras explicitly.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

# tf.test.TestCase helpers (create_tempdir, get_temp_dir) read absl flags,
# which pytest never parses.
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

if not flags.FLAGS.is_parsed():
  flags.FLAGS.mark_as_parsed()


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
