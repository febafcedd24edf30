"""The policies of an eval or bench run: ``--policies`` entries, their labels and settings.

An entry names a policy and, optionally, fields of its own::

  --policies=full,sablock,paged_eviction:candidates=3,sablock:window=8:gamma=0.5

Each value parses as an int, a float, a bool (true/false) or else a string, in
that order, and must then fit its field: an int field takes an int, a float
field an int or a float, a bool field true or false, a string field the text
as written. A field an entry sets wins over ``--window``; a policy whose
fields no entry or ``--window`` sets runs at its own defaults. The same
policy may appear twice with different fields (a before/after comparison in
one run); an entry that repeats another's fields is refused, since its rows
would be the same work counted twice.

Rows record a policy twice over: ``policy_fields``, the fields set
explicitly (by ``--window`` or the entry; what labels a row,
``sablock (window=8)``), and ``policy_settings``, every field of the policy
as it ran, so that a row says what it used whatever the defaults were then.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from kvjax import policies


@dataclasses.dataclass(frozen=True)
class PolicyEntry:
  """One ``--policies`` entry: a policy name and its own fields, sorted by field name.

  Build it with ``parse`` (which checks the fields against the policy);
  ``fields`` is a tuple of (field, value) pairs so that an entry is hashable.
  """

  name: str
  fields: tuple[tuple[str, Any], ...] = ()

  def run_fields(self, window: int) -> dict:
    """The fields set explicitly: ``--window``'s (when nonzero), then the entry's, which win."""
    return {**policies.window_fields(self.name, window), **dict(self.fields)}

  def make(self, window: int) -> policies.Policy:
    """The policy this entry runs under ``--window`` (not yet bound to a tokenizer)."""
    return policies.get(self.name, **self.run_fields(window))

  def __str__(self) -> str:
    return ":".join([self.name, *(f"{k}={text(v)}" for k, v in self.fields)])


def parse_value(raw: str) -> Any:
  """``raw`` as an int, else a float, else a bool (true/false, any case), else the string."""
  for kind in (int, float):
    try:
      return kind(raw)
    except ValueError:
      pass
  if raw.lower() in ("true", "false"):
    return raw.lower() == "true"
  return raw


def _fit(entry: str, name: str, field: dataclasses.Field, raw: str) -> Any:
  """The value of ``raw`` for ``field`` of policy ``name``, or ValueError if it cannot be one.

  The field's default says its type (every policy field has one).
  """
  value = parse_value(raw)
  default = field.default
  if default is dataclasses.MISSING:
    return value
  kind = type(default)
  if kind is str or isinstance(default, policies.Policy):
    return raw  # "group=1" means the text "1"; a wrapped policy is given by name
  if kind is bool and isinstance(value, bool):
    return value
  if kind is int and isinstance(value, int) and not isinstance(value, bool):
    return value
  if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  if kind not in (bool, int, float):
    raise ValueError(f"--policies entry {entry!r}: {name}'s {field.name} (a "
                     f"{kind.__name__}) cannot be set on the command line")
  wanted = {bool: "true or false", int: "an int", float: "a number"}[kind]
  raise ValueError(f"--policies entry {entry!r}: {name}'s {field.name} takes {wanted}, "
                   f"got {raw!r}")


def parse(entry: str) -> PolicyEntry:
  """The entry ``name[:field=value...]``, its fields checked against the policy.

  Raises:
    ValueError: an empty entry or field, a part without ``=``, a field given
      twice, an unknown policy or field (``kvjax.policies.get``'s message), a
      value that does not fit its field, or one the policy refuses.
  """
  name, *parts = [p.strip() for p in entry.strip().split(":")]
  if not name:
    raise ValueError(f"--policies has an entry without a policy name: {entry!r} "
                     "(entries are name[:field=value...], comma separated)")
  raw = {}
  for part in parts:
    field, eq, value = part.partition("=")
    field = field.strip()
    if not eq or not field:
      raise ValueError(f"--policies entry {entry!r}: expected field=value after "
                       f"{name!r}, got {part!r}")
    if field in raw:
      raise ValueError(f"--policies entry {entry!r} sets {field} twice")
    raw[field] = value.strip()
  known = {f.name: f for f in dataclasses.fields(policies.get(name))}  # unknown name: raises
  if set(raw) - set(known):
    policies.get(name, **raw)  # raises the ValueError naming the unknown and the known fields
  fields = {k: _fit(entry, name, known[k], v) for k, v in raw.items()}
  try:
    policies.get(name, **fields)  # the policy's own checks (a bad variant, a negative size)
  except ValueError as e:
    raise ValueError(f"--policies entry {entry!r}: {e}") from None
  return PolicyEntry(name, tuple(sorted(fields.items())))


def parse_all(entries: Iterable[str], window: int = 0) -> tuple[PolicyEntry, ...]:
  """Every entry parsed; ValueError for a bad one, or for two that set the same fields.

  Two entries of one policy repeat each other when the fields they run with
  (``--window``'s included) are equal: ``sablock,sablock:window=16`` with
  ``--window=16``, ``x:a=1:b=2,x:b=2:a=1``.
  """
  parsed, seen = [], {}
  for raw in entries:
    entry = parse(raw)
    fields = entry.run_fields(window)
    key = (entry.name, tuple(sorted(fields.items())))
    if key in seen:
      what = label(entry.name, fields)
      if seen[key] != raw:
        what += f" ({seen[key]} and {raw}" + (f" with --window={window}" if window else "") + ")"
      raise ValueError(f"--policies repeats {what}")
    seen[key] = raw
    parsed.append(entry)
  return tuple(parsed)


def text(value: Any) -> str:
  """A setting's value as the command line writes it (true/false for bools)."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (list, tuple)):
    return "(" + ", ".join(text(v) for v in value) + ")"
  if isinstance(value, Mapping) and "name" in value:  # a wrapped policy's settings
    fields = {k: v for k, v in value.items() if k != "name"}
    return f"{value['name']}[{settings_text(fields)}]"
  return str(value)


def label(name: str, fields: Mapping[str, Any] | None) -> str:
  """``name (field=value, ...)``: a policy and the fields set explicitly, sorted by field."""
  fields = fields or {}
  return name + (f" ({', '.join(f'{k}={text(v)}' for k, v in sorted(fields.items()))})"
                 if fields else "")


def settings(policy: policies.Policy, given: Iterable[str] = ()) -> dict:
  """Every dataclass field of ``policy`` (as it runs: bound) with its value, for a row.

  Delimiter ids taken from the tokenizer (not among ``given``) are recorded as
  their count, ``"tokenizer (57 ids)"``, not as the long list; other tuples
  become lists (JSON); a wrapped policy (AdaKV's ``inner``) becomes its name
  and settings.
  """
  given = set(given)
  out = {}
  for field in dataclasses.fields(policy):
    value = getattr(policy, field.name)
    if field.name == "delimiter_ids" and field.name not in given:
      value = f"tokenizer ({len(value)} ids)"
    elif isinstance(value, policies.Policy):
      value = {"name": value.name, **settings(value)}
    elif isinstance(value, tuple):
      value = list(value)
    out[field.name] = value
  return out


def settings_text(values: Mapping[str, Any] | None) -> str:
  """``window=16, kernel=5, ...`` in the policy's field order ("no fields" for none)."""
  if values is None:
    return "not recorded"
  return ", ".join(f"{k}={text(v)}" for k, v in values.items()) or "no fields"
