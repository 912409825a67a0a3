"""The error every data reader raises for a malformed file."""

# Prefix of the in-graph check's message for files checked as they are read
# (e.g. large Criteo files), so the launcher can report it in one line.
MALFORMED = "malformed data: "


class DataError(ValueError):
  """A malformed data file; the message starts with `path:line: ` and says
  what the format expects there."""
