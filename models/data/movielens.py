"""MovieLens ratings as implicit feedback for NCF: readers, splits, negatives.

Two file formats are read: `ratings.csv` (MovieLens 20M/25M: a header, then
`userId,movieId,rating,timestamp`) and `u.data` (MovieLens 100K: tab-separated
`user item rating timestamp`, no header). A file of plain rows is parsed at
once with numpy; anything else (and a file with a malformed row) is read line
by line, and a malformed row raises a DataError naming `path:line`. Every rating counts as one positive interaction (as in the
NCF paper); ids are remapped to contiguous ranges; the latest interaction of
each user is held out for testing (leave-one-out), and ranked against sampled
items the user never interacted with.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow as tf

from models.data import order
from models.data.errors import DataError

CSV_HEADER = ("userId", "movieId", "rating", "timestamp")


@dataclasses.dataclass(frozen=True)
class Ratings:
  """Raw ratings, one entry per row, in file order."""
  users: np.ndarray  # int64
  items: np.ndarray  # int64
  ratings: np.ndarray  # float32
  timestamps: np.ndarray  # int64


@dataclasses.dataclass(frozen=True)
class Interactions:
  """Implicit feedback with contiguous ids: user u in [0, num_users)."""
  users: np.ndarray  # int32
  items: np.ndarray  # int32
  timestamps: np.ndarray  # int64
  num_users: int
  num_items: int
  user_ids: np.ndarray | None = None  # original id of each user index
  item_ids: np.ndarray | None = None  # original id of each item index


@dataclasses.dataclass(frozen=True)
class EvalData:
  """Ranking candidates: `items[u, 0]` is user `users[u]`'s held-out positive,
  `items[u, 1:]` are sampled negatives."""
  users: np.ndarray  # int32 [U]
  items: np.ndarray  # int32 [U, 1 + negatives]


# Digits of a field the fast parser takes: exact in float64, as `_scan` keeps them.
_MAX_DIGITS = 15
# Byte classes of the plain form `_parse_fast` reads; 0 is any other byte.
_DIGIT, _DOT, _DELIM = 1, 2, 3
# Byte -> its digit's value (0 for any other byte).
_DIGIT_VALUE = np.zeros(256, np.int64)
_DIGIT_VALUE[ord("0"):ord("9") + 1] = np.arange(10)


def _integers(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """The fields `buf[starts[i]:starts[i] + lengths[i]]` read as decimal
  integers, all at once (a byte that is no digit counts as 0)."""
  value = np.zeros(len(starts), np.int64)
  shortest = int(lengths.min(initial=0))
  for k in range(int(lengths.max(initial=0))):
    if k < shortest:  # every field has a k-th byte
      value *= 10
      value += _DIGIT_VALUE[buf[starts + k]]
    else:
      digit = _DIGIT_VALUE[buf[np.minimum(starts + k, len(buf) - 1)]]
      value = np.where(lengths > k, value * 10 + digit, value)
  return value


def _parse_fast(buf: np.ndarray, sep: str) -> Ratings | None:
  """Parses `user<sep>item<sep>rating<sep>timestamp` lines with numpy.

  Args:
    buf: the file's bytes after any header, as uint8.
    sep: the field separator.

  Returns:
    The ratings, or None when the bytes are not in the plain form this reads
    (unsigned integers, a rating with at most one `.`, no spaces, blank lines
    or carriage returns); `_scan` then reads the file line by line and names
    a malformed line.
  """
  if len(buf) and buf[-1] == ord("\n"):
    buf = buf[:-1]
  if not len(buf):
    return None
  classes = np.zeros(256, np.uint8)
  classes[ord("0"):ord("9") + 1] = _DIGIT
  classes[ord(".")] = _DOT
  classes[[ord(sep), ord("\n")]] = _DELIM
  kinds = classes[buf]
  if not kinds.all():
    return None  # another byte: a sign, a space, a letter
  index = np.int32 if len(buf) < 2**31 else np.int64
  delims = np.flatnonzero(kinds == _DELIM).astype(index)
  dots = np.flatnonzero(kinds == _DOT).astype(index)
  del kinds
  n = (len(delims) + 1) // 4
  newlines = buf[delims] == ord("\n")
  if len(delims) != 4 * n - 1 or not newlines[3::4].all() or newlines.sum() != n - 1:
    return None  # a line without exactly 4 fields
  ends = np.append(delims, index(len(buf)))
  starts = np.insert(delims + 1, 0, 0)
  del delims, newlines
  lengths = ends - starts
  if lengths.max() > _MAX_DIGITS + 1:
    return None  # a long number
  users, items, ratings, timestamps = (
      _integers(buf, starts[j::4], lengths[j::4]) for j in range(4))
  # Every `.` must sit in a rating (column 2), one at most in each, beside a digit.
  row = np.searchsorted(starts[2::4], dots, side="right") - 1
  offset = dots - starts[2::4][row]
  length = lengths[2::4][row]
  if len(dots) and (row.min() < 0 or np.any(offset >= length) or np.any(np.diff(row) == 0)):
    return None
  digits = lengths.copy()
  digits[4 * row + 2] -= 1
  if digits.min() < 1 or digits.max() > _MAX_DIGITS:
    return None  # an empty field (or a lone `.`), a number too long to keep exact
  # A `.` was read as a 0 digit: drop it, then scale by the digits after it.
  decimals = (length - offset - 1).astype(np.int64)
  raw = ratings[row]
  ratings = ratings.astype(np.float64)
  ratings[row] = ((raw // 10 ** (decimals + 1)) * 10 ** decimals + raw % 10 ** decimals
                  ) / 10.0 ** decimals
  return Ratings(users, items, ratings.astype(np.float32), timestamps)


def _scan(path: str, sep: str, header: tuple[str, ...] | None) -> Ratings:
  """Parses line by line; raises DataError naming the first malformed line."""
  rows = []
  with open(path, encoding="utf-8", newline="") as f:
    for number, line in enumerate(f, start=1):
      line = line.rstrip("\r\n")
      if number == 1 and header is not None:
        if tuple(c.strip() for c in line.split(sep)) != header:
          raise DataError(f"{path}:1: expected header {','.join(header)!r}, got {line!r}")
        continue
      if not line.strip():
        continue  # blank lines, e.g. at the end
      fields = line.split(sep)
      if len(fields) != 4:
        hint = (" (a header line? u.data has none: remove the first line)"
                if number == 1 and header is None and not fields[0].strip().isdigit()
                else "")
        raise DataError(f"{path}:{number}: expected 4 fields separated by "
                        f"{sep!r}, got {len(fields)}: {line!r}{hint}")
      try:
        rows.append((int(fields[0]), int(fields[1]), float(fields[2]), int(fields[3])))
      except ValueError:
        hint = (" (a header line? u.data has none: remove the first line)"
                if number == 1 and header is None else "")
        raise DataError(f"{path}:{number}: expected integer user, item and "
                        f"timestamp and a numeric rating, got {line!r}{hint}") from None
  table = np.array(rows, dtype=np.float64).reshape(-1, 4)
  return Ratings(table[:, 0].astype(np.int64), table[:, 1].astype(np.int64),
                 table[:, 2].astype(np.float32), table[:, 3].astype(np.int64))


def _parse(path: str, sep: str, header: tuple[str, ...] | None) -> Ratings:
  """Reads a ratings file at once with numpy, or by `_scan` if it is not plain."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"MovieLens ratings file not found: {path}")
  with open(path, "rb") as f:
    data = f.read()
  buf = np.frombuffer(data, np.uint8)
  if header is not None:
    first = data[:data.find(b"\n") + 1 or len(data)]
    names = first.decode("utf-8", "replace").rstrip("\r\n").split(sep)
    buf = buf[len(first):] if tuple(c.strip() for c in names) == header else buf[:0]
  parsed = _parse_fast(buf, sep)  # none for a wrong header: `_scan` names it
  return _scan(path, sep, header) if parsed is None else parsed


def read_ratings_csv(path: str) -> Ratings:
  """Reads MovieLens `ratings.csv` (header `userId,movieId,rating,timestamp`)."""
  return _parse(path, ",", CSV_HEADER)


def read_u_data(path: str) -> Ratings:
  """Reads MovieLens 100K `u.data` (tab-separated, no header)."""
  return _parse(path, "\t", None)


def read_dir(data_dir: str) -> Ratings:
  """Reads `ratings.csv` or `u.data` from `data_dir` (in that preference)."""
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"MovieLens data directory not found: {data_dir}")
  for name, reader in (("ratings.csv", read_ratings_csv), ("u.data", read_u_data)):
    path = os.path.join(data_dir, name)
    if os.path.isfile(path):
      return reader(path)
  raise FileNotFoundError(f"no MovieLens ratings in {data_dir} "
                          "(expected ratings.csv or u.data)")


def to_implicit(ratings: Ratings, min_rating: float = 0.0) -> Interactions:
  """Keeps ratings >= min_rating as positives; remaps ids to 0..n-1 (sorted)."""
  keep = ratings.ratings >= min_rating
  user_ids, users = np.unique(ratings.users[keep], return_inverse=True)
  item_ids, items = np.unique(ratings.items[keep], return_inverse=True)
  return Interactions(users.astype(np.int32), items.astype(np.int32),
                      ratings.timestamps[keep], len(user_ids), len(item_ids),
                      user_ids, item_ids)


def leave_one_out(data: Interactions) -> tuple[Interactions, Interactions]:
  """Splits off each user's latest interaction (the later row on a tie).

  Returns:
    (train, test): test has exactly one interaction per user, train the rest.
  """
  n = len(data.users)
  order = np.lexsort((np.arange(n), data.timestamps, data.users))
  last = np.ones(n, dtype=bool)
  last[:-1] = data.users[order][1:] != data.users[order][:-1]
  test = np.zeros(n, dtype=bool)
  test[order[last]] = True

  def pick(mask):
    return dataclasses.replace(data, users=data.users[mask], items=data.items[mask],
                               timestamps=data.timestamps[mask])

  return pick(~test), pick(test)


def _keys(users: np.ndarray, items: np.ndarray, num_items: int) -> np.ndarray:
  return users.astype(np.int64) * num_items + items


def sample_negatives(users: np.ndarray, num_negatives: int, positives: Interactions,
                     rng: np.random.Generator) -> np.ndarray:
  """For each user in `users`, `num_negatives` items it never interacted with.

  Items are uniform over the catalogue, redrawn while they hit one of the
  user's interactions in `positives`; drawn with replacement.

  Returns:
    int32 [len(users), num_negatives].
  """
  seen = np.unique(_keys(positives.users, positives.items, positives.num_items))
  counts = np.bincount(positives.users, minlength=positives.num_users)
  if len(users) and np.max(counts[users]) >= positives.num_items:
    raise ValueError("cannot sample negatives: a user has interacted with all "
                     f"{positives.num_items} items")
  items = rng.integers(0, positives.num_items, size=(len(users), num_negatives))
  row_users = np.repeat(users, num_negatives).reshape(items.shape)
  while True:
    keys = _keys(row_users, items, positives.num_items)
    pos = np.searchsorted(seen, keys).clip(max=len(seen) - 1)
    bad = seen[pos] == keys
    if not bad.any():
      return items.astype(np.int32)
    items[bad] = rng.integers(0, positives.num_items, size=int(bad.sum()))


def eval_data(train: Interactions, test: Interactions, num_negatives: int = 99,
              seed: int = 0) -> EvalData:
  """One held-out positive plus `num_negatives` unseen items per test user."""
  everything = dataclasses.replace(
      train, users=np.concatenate([train.users, test.users]),
      items=np.concatenate([train.items, test.items]),
      timestamps=np.concatenate([train.timestamps, test.timestamps]))
  rng = np.random.default_rng([seed, 99])
  negatives = sample_negatives(test.users, num_negatives, everything, rng)
  return EvalData(test.users.copy(), np.concatenate([test.items[:, None], negatives], 1))


def training_dataset(train: Interactions, batch_size: int, num_negatives: int = 4,
                     seed: int = 0, start: int = 0) -> tf.data.Dataset:
  """Endless shuffled `((users, items), labels [B,1])` batches with fresh negatives.

  An epoch is every training positive plus `num_negatives` negatives for
  it (items the user did not interact with, uniform, redrawn every epoch),
  in a seeded order of its own (`models.data.order`). Batch `b` is a
  function of `b` alone (deterministic for a seed and batch size), so the
  stream from batch `start` on is made directly, as a resumed run needs it.
  """
  order.check_start(start)
  users = np.asarray(train.users, np.int32)
  if not len(users):
    raise ValueError("no training interactions to make batches of")
  counts = np.bincount(train.users, minlength=train.num_users)
  if num_negatives and np.max(counts) >= train.num_items:
    raise ValueError("cannot sample negatives: a user has interacted with all "
                     f"{train.num_items} items")
  group = 1 + num_negatives  # a positive and its negatives
  size = len(users) * group  # examples per epoch
  seen = tf.constant(np.unique(_keys(train.users, train.items, train.num_items)))
  users_t, items_t = tf.constant(users), tf.constant(np.asarray(train.items, np.int32))
  num_items = train.num_items

  def negatives(b, u):
    """Items the users `u` never interacted with; redrawn where one did."""
    def draw(t):
      key = tf.stack([tf.constant(seed, tf.int64), b * 1024 + t])
      return tf.random.stateless_uniform(tf.shape(u), key, 0, num_items, tf.int32)

    def hit(i):
      keys = tf.cast(u, tf.int64) * num_items + tf.cast(i, tf.int64)
      pos = tf.minimum(tf.searchsorted(seen, keys, out_type=tf.int64),
                       tf.size(seen, tf.int64) - 1)
      return tf.equal(tf.gather(seen, pos), keys)

    items = draw(tf.constant(0, tf.int64))
    _, items = tf.while_loop(
        lambda t, i: tf.reduce_any(hit(i)),
        lambda t, i: (t + 1, tf.where(hit(i), draw(t), i)),
        (tf.constant(1, tf.int64), items))
    return items

  def batch(b, k):
    q = order.shuffled_indices(k, size, seed)
    p, r = q // group, q % group
    u = tf.gather(users_t, p)
    items = tf.where(r == 0, tf.gather(items_t, p), negatives(b, u))
    labels = tf.cast(r == 0, tf.float32)[:, None]
    return (u, items), labels

  positions = order.batch_positions(start, batch_size)
  indices = tf.data.Dataset.range(start, order.ENDLESS)
  return tf.data.Dataset.zip(indices, positions).map(batch).prefetch(2)


# --- synthetic data ------------------------------------------------------------


def teacher_scores(seed: int = 0, num_users: int = 400, num_items: int = 300,
                   dim: int = 8) -> np.ndarray:
  """The hidden teacher's affinity [num_users, num_items]: u·v + item bias."""
  rng = np.random.default_rng([seed, 11])
  u = rng.normal(size=(num_users, dim))
  v = rng.normal(size=(num_items, dim))
  bias = rng.normal(size=num_items) * 0.5
  return u @ v.T / np.sqrt(dim) * 2.0 + bias


def synthetic_ratings(seed: int = 0, num_users: int = 400, num_items: int = 300,
                      per_user: int = 20, dim: int = 8) -> Ratings:
  """Ratings drawn from a hidden latent-factor teacher, deterministic per seed.

  User u (id u+1) picks `per_user` distinct items (item i has id i+1) with
  probability proportional to exp(teacher_scores[u, i]), at timestamps in
  random order, so the held-out item is predictable from the others. Every
  rating is 5.
  """
  scores = teacher_scores(seed, num_users, num_items, dim)
  rng = np.random.default_rng([seed, 12])
  gumbel = scores - np.log(-np.log(rng.uniform(size=scores.shape)))
  items = np.argsort(-gumbel, axis=1)[:, :per_user]  # sampling w/o replacement
  n = num_users * per_user
  return Ratings(np.repeat(np.arange(num_users) + 1, per_user).astype(np.int64),
                 items.reshape(-1).astype(np.int64) + 1,
                 np.full(n, 5.0, np.float32),
                 rng.permutation(n).astype(np.int64) + 1_000_000_000)


def write_ratings_csv(path: str, ratings: Ratings) -> None:
  """Writes `ratings` in the `ratings.csv` format (for smoke runs of --data_dir)."""
  with open(path, "w", encoding="utf-8") as f:
    f.write(",".join(CSV_HEADER) + "\n")
    for row in zip(ratings.users, ratings.items, ratings.ratings, ratings.timestamps):
      f.write(f"{row[0]},{row[1]},{row[2]:g},{row[3]}\n")


def write_u_data(path: str, ratings: Ratings) -> None:
  """Writes `ratings` in the `u.data` format (tab-separated, no header)."""
  with open(path, "w", encoding="utf-8") as f:
    for row in zip(ratings.users, ratings.items, ratings.ratings, ratings.timestamps):
      f.write(f"{row[0]}\t{row[1]}\t{row[2]:g}\t{row[3]}\n")
