"""Tests for models/data/movielens.py: readers, splits, negatives, synthetic data."""

import os

import numpy as np
import tensorflow as tf

from models.data import errors
from models.data import movielens as ml
from tests import util


def setUpModule():
  util.setup_cpus()


def _interactions(users, items, times, num_users, num_items) -> ml.Interactions:
  return ml.Interactions(np.array(users, np.int32), np.array(items, np.int32),
                         np.array(times, np.int64), num_users, num_items)


class ReaderTest(tf.test.TestCase):

  def _write(self, name: str, text: str) -> str:
    path = os.path.join(self.get_temp_dir(), name)
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
    return path

  def test_ratings_csv(self):
    path = self._write("ratings.csv", "userId,movieId,rating,timestamp\n"
                       "1,31,2.5,1260759144\n1,1029,3.0,1260759179\n7,31,4,5\n")
    r = ml.read_ratings_csv(path)
    self.assertAllEqual(r.users, [1, 1, 7])
    self.assertAllEqual(r.items, [31, 1029, 31])
    self.assertAllClose(r.ratings, [2.5, 3.0, 4.0])
    self.assertAllEqual(r.timestamps, [1260759144, 1260759179, 5])
    self.assertAllEqual(ml.read_dir(self.get_temp_dir()).items, r.items)

  def test_u_data(self):
    path = self._write("u.data", "196\t242\t3\t881250949\n186\t302\t3\t891717742\n")
    r = ml.read_u_data(path)
    self.assertAllEqual(r.users, [196, 186])
    self.assertAllEqual(r.items, [242, 302])
    self.assertAllEqual(r.timestamps, [881250949, 891717742])
    self.assertAllEqual(ml.read_dir(self.get_temp_dir()).users, r.users)

  def test_malformed_rows_name_line(self):
    header = "userId,movieId,rating,timestamp\n"
    good = "1,2,3.5,4\n"
    cases = [
        ("ratings.csv", header + good + "1,2,3.5\n", ml.read_ratings_csv,
         r"ratings.csv:3: expected 4 fields"),
        ("ratings.csv", header + good + good + "1,x,3.5,4\n", ml.read_ratings_csv,
         r"ratings.csv:4: expected integer user"),
        ("ratings.csv", "user,movie,rating,time\n" + good, ml.read_ratings_csv,
         r"ratings.csv:1: expected header"),
        ("u.data", "1\t2\t3\t4\n1 2 3 4\n", ml.read_u_data, r"u.data:2: expected 4 fields"),
    ]
    for name, text, reader, message in cases:
      with self.assertRaisesRegex(ValueError, message):
        reader(self._write(name, text))

  def test_a_header_line_in_u_data_is_named(self):
    with self.assertRaisesRegex(errors.DataError,
                                r"u.data:1: expected 4 fields .* \(a header line\? "
                                r"u.data has none"):
      ml.read_u_data(self._write("u.data", "user item rating\n1\t2\t3\t4\n"))
    with self.assertRaisesRegex(errors.DataError,
                                r"u.data:1: expected integer user.* \(a header line\?"):
      ml.read_u_data(self._write("u.data", "user\titem\trating\ttime\n1\t2\t3\t4\n"))

  def test_any_plain_form_reads_as_line_by_line(self):
    # The numpy parser and the line-by-line one (which reads what it does not:
    # spaces, signs, blank lines, carriage returns) give the same arrays.
    header = "userId,movieId,rating,timestamp\n"
    texts = [
        "1,31,2.5,1260759144\n1,1029,3,1260759179\n007,31,.5,5\n12,9,4.,0",
        "1,2,0.125,3\n",
        "1, 2,3.5,4\n-1,2,3,4\n",
        "1,2,3.5,4\r\n\n5,6,7,8\r\n",
        "123456789012345,2,3.5,4\n",
        "1234567890123456,2,3.5,4\n",
    ]
    for text in texts:
      path = self._write("ratings.csv", header + text)
      buf = np.frombuffer(text.encode(), np.uint8)
      fast = ml._parse_fast(buf, ",")  # pylint: disable=protected-access
      scan = ml._scan(path, ",", ml.CSV_HEADER)  # pylint: disable=protected-access
      self.assertEqual(fast is None, text.startswith(("1, ", "1,2,3.5,4\r", "1234567890123456")),
                       msg=text)
      for got, want in zip(vars(ml.read_ratings_csv(path)).values(), vars(scan).values()):
        self.assertEqual(got.dtype, want.dtype)
        self.assertAllEqual(got, want, msg=text)
    r = ml.read_ratings_csv(self._write("ratings.csv", header + texts[0]))
    self.assertAllClose(r.ratings, [2.5, 3.0, 0.5, 4.0])
    self.assertAllEqual(r.users, [1, 1, 7, 12])
    self.assertAllEqual(r.timestamps, [1260759144, 1260759179, 5, 0])

  def test_bad_rows_after_many_good_ones(self):
    good = "1\t2\t3\t4\n" * 1000
    cases = [("1\t2\t3.5.5\t4\n", "u.data:1001: expected integer user"),
             ("1\t2.0\t3\t4\n", "u.data:1001: expected integer user"),
             ("1\t2\t\t4\n", "u.data:1001: expected integer user"),
             ("1\t2\t3\n", "u.data:1001: expected 4 fields")]
    for bad, message in cases:
      with self.assertRaisesRegex(errors.DataError, message):
        ml.read_u_data(self._write("u.data", good + bad + good))

  def test_missing_paths(self):
    missing = os.path.join(self.get_temp_dir(), "absent")
    with self.assertRaisesRegex(FileNotFoundError, "absent/ratings.csv"):
      ml.read_ratings_csv(os.path.join(missing, "ratings.csv"))
    with self.assertRaisesRegex(FileNotFoundError, "absent"):
      ml.read_dir(missing)
    with self.assertRaisesRegex(FileNotFoundError, "expected ratings.csv or u.data"):
      ml.read_dir(self.create_tempdir().full_path)


class SplitTest(tf.test.TestCase):

  def test_implicit_and_leave_one_out(self):
    r = ml.Ratings(np.array([10, 10, 10, 20, 20, 30]), np.array([5, 7, 9, 7, 5, 9]),
                   np.array([1, 5, 2, 4, 4, 3], np.float32), np.array([3, 9, 9, 1, 2, 7]))
    data = ml.to_implicit(r)
    self.assertEqual((data.num_users, data.num_items), (3, 3))
    self.assertAllEqual(data.users, [0, 0, 0, 1, 1, 2])
    self.assertAllEqual(data.items, [0, 1, 2, 1, 0, 2])
    train, test = ml.leave_one_out(data)
    # latest per user; user 0's tie at t=9 goes to the later row
    self.assertAllEqual(test.users, [0, 1, 2])
    self.assertAllEqual(test.items, [2, 0, 2])
    self.assertAllEqual(train.users, [0, 0, 1])
    self.assertAllEqual(train.items, [0, 1, 1])
    self.assertAllEqual(train.user_ids, [10, 20, 30])
    self.assertAllEqual(test.item_ids, [5, 7, 9])
    self.assertEqual(ml.to_implicit(r, min_rating=3).num_users, 3)
    self.assertLen(ml.to_implicit(r, min_rating=3).users, 4)

  def test_negatives_avoid_positives(self):
    data = _interactions([0, 0, 1], [0, 1, 2], [1, 2, 3], 2, 4)
    rng = np.random.default_rng(0)
    neg = ml.sample_negatives(np.array([0, 1, 0]), 50, data, rng)
    self.assertEqual(neg.shape, (3, 50))
    self.assertAllInSet(neg[[0, 2]], [2, 3])
    self.assertAllInSet(neg[1], [0, 1, 3])
    full = _interactions([0, 0, 0, 0], [0, 1, 2, 3], [1, 2, 3, 4], 1, 4)
    with self.assertRaisesRegex(ValueError, "interacted with all 4 items"):
      ml.sample_negatives(np.array([0]), 1, full, rng)

  def test_eval_data_and_training_batches(self):
    train, test = ml.leave_one_out(ml.to_implicit(ml.synthetic_ratings(0, 30, 40, 5)))
    ev = ml.eval_data(train, test, num_negatives=9, seed=1)
    self.assertEqual(ev.items.shape, (30, 10))
    self.assertAllEqual(ev.items[:, 0], test.items)
    seen = set(zip(np.concatenate([train.users, test.users]).tolist(),
                   np.concatenate([train.items, test.items]).tolist()))
    self.assertFalse(any((u, i) in seen for u, row in zip(ev.users, ev.items[:, 1:])
                         for i in row))
    # Two epochs of 120 positives x (1 + 4) in batches of 40 (15 batches each).
    batches = list(ml.training_dataset(train, 40, num_negatives=4, seed=0).take(30))
    users = np.concatenate([u for (u, _), _ in batches])
    items = np.concatenate([i for (_, i), _ in batches])
    labels = np.concatenate([y[:, 0] for _, y in batches])
    train_pairs = set(zip(train.users.tolist(), train.items.tolist()))
    negatives = []
    for e in range(2):
      epoch = slice(e * 600, (e + 1) * 600)
      pos = labels[epoch] == 1
      # Every positive once, as a positive; 4 negatives per positive's user.
      self.assertEqual(sorted(zip(users[epoch][pos].tolist(), items[epoch][pos].tolist())),
                       sorted(train_pairs))
      self.assertAllEqual(np.sort(users[epoch][~pos]), np.sort(np.repeat(train.users, 4)))
      self.assertFalse(any(pair in train_pairs for pair in zip(
          users[epoch][~pos].tolist(), items[epoch][~pos].tolist())))
      negatives.append(items[epoch][~pos])
    self.assertNotAllEqual(negatives[0], negatives[1])  # redrawn every epoch
    # Batch b depends on b alone: the stream from batch 17 on, made directly.
    late = list(ml.training_dataset(train, 40, num_negatives=4, seed=0, start=17).take(2))
    for got, want in zip(late, batches[17:19]):
      tf.nest.map_structure(self.assertAllEqual, got, want)
    with self.assertRaisesRegex(ValueError, "interacted with all 2 items"):
      ml.training_dataset(_interactions([0, 0], [0, 1], [1, 2], 1, 2), 4)
    with self.assertRaisesRegex(ValueError, r"start \(the index of the first batch\)"):
      ml.training_dataset(train, 40, start=-1)


class SyntheticTest(tf.test.TestCase):

  def test_deterministic_and_learnable(self):
    a, b = ml.synthetic_ratings(3), ml.synthetic_ratings(3)
    tf.nest.map_structure(self.assertAllEqual, vars(a), vars(b))
    self.assertNotAllEqual(a.items, ml.synthetic_ratings(4).items)
    # the teacher ranks held-out items far above chance (HR@10 of 10/100 = 0.1)
    train, test = ml.leave_one_out(ml.to_implicit(a))
    ev = ml.eval_data(train, test)
    scores = ml.teacher_scores(3)[train.user_ids - 1][:, train.item_ids - 1]
    pos = scores[ev.users, ev.items[:, 0]][:, None]
    hits = np.sum(scores[ev.users[:, None], ev.items[:, 1:]] >= pos, axis=1) < 10
    self.assertGreater(hits.mean(), 0.5)

  def test_csv_round_trip(self):
    path = os.path.join(self.get_temp_dir(), "ratings.csv")
    r = ml.synthetic_ratings(0, 5, 8, 3)
    ml.write_ratings_csv(path, r)
    tf.nest.map_structure(self.assertAllEqual, vars(ml.read_ratings_csv(path)), vars(r))

  def test_u_data_round_trip(self):
    path = os.path.join(self.get_temp_dir(), "u.data")
    r = ml.synthetic_ratings(1, 5, 8, 3)
    ml.write_u_data(path, r)
    tf.nest.map_structure(self.assertAllEqual, vars(ml.read_u_data(path)), vars(r))


if __name__ == "__main__":
  tf.test.main()
