"""Label values as users write them (class names, indices, lists) -> class indices.

Classes come from `--classes` (fixed: anything else is an unknown label) or from the data: all
integer-like values make classes 0..max; otherwise the sorted distinct names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from data_prep.layout import DatasetError

_INT = re.compile(r"^-?\d+$")


class UnknownLabel(ValueError):
    pass


def parse_label_list(value) -> list:
    """A multi-label cell: a list, a JSON list string, or names joined by '|'."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    text = str(value).strip()
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            raise UnknownLabel(f"labels {text!r} are not a JSON list") from None
        if not isinstance(parsed, list):
            raise UnknownLabel(f"labels {text!r} are not a JSON list")
        return parsed
    return [p.strip() for p in text.split("|") if p.strip()]


def _as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INT.match(value.strip()):
        return int(value.strip())
    return None


def read_classes(spec: str) -> list[str]:
    """`--classes`: a file (one name per line, or a JSON list) or a comma-separated list."""
    path = Path(spec)
    if path.is_file():
        text = path.read_text()
        if text.lstrip().startswith("["):
            return [str(c) for c in json.loads(text)]
        return [line.strip() for line in text.splitlines() if line.strip()]
    names = [c.strip() for c in spec.split(",") if c.strip()]
    if not names:
        raise DatasetError(f"--classes {spec!r}: neither a file nor a comma-separated list of names")
    return names


class LabelTally:
    """What `LabelSpace.infer` needs to know of a set of label values: the distinct names, the largest index
    and whether every value is integer-like. Tallies of parts merge into the tally of the whole, so a
    manifest's ranges are tallied in parallel (`data_prep/ranged.py`). Memory: the distinct names."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.top, self.all_int = -1, True

    def add(self, values: Iterable) -> LabelTally:
        for v in values:
            if v is None or (isinstance(v, str) and not v.strip()):
                continue
            i = _as_int(v)
            if i is None:
                self.all_int = False
                self.names.add(str(v).strip())
            elif i >= 0:
                self.top = max(self.top, i)
                self.names.add(str(v).strip())
        return self

    def merge(self, other: LabelTally) -> LabelTally:
        self.names |= other.names
        self.top, self.all_int = max(self.top, other.top), self.all_int and other.all_int
        return self

    def space(self) -> LabelSpace:
        if self.all_int:
            return LabelSpace([str(i) for i in range(self.top + 1)], by_index=True, fixed=False)
        return LabelSpace(sorted(self.names), by_index=False, fixed=False)


class LabelSpace:
    """Resolves one label value to a class index, or raises UnknownLabel with the reason."""

    def __init__(self, classes: list[str], by_index: bool, fixed: bool):
        self.classes = classes
        self.by_index = by_index  # values are indices (integer-like), not names
        self.fixed = fixed
        self._index = {c: i for i, c in enumerate(classes)}
        if len(self._index) != len(classes):
            raise DatasetError(f"class names repeat: {classes}")

    @classmethod
    def infer(cls, values: Iterable, fixed: list[str] | None) -> LabelSpace:
        """From `--classes`, or from every label value (a streaming pass; memory: the distinct names)."""
        if fixed is not None:
            return cls(list(fixed), by_index=False, fixed=True)
        tally = LabelTally()
        tally.add(values)
        return tally.space()

    def resolve(self, value) -> int:
        if value is None or (isinstance(value, str) and not value.strip()):
            raise UnknownLabel("no label")
        name = str(value).strip()
        if not self.by_index and name in self._index:
            return self._index[name]
        i = _as_int(value)
        if i is not None and (self.by_index or self.fixed):
            if 0 <= i < len(self.classes):
                return i
            raise UnknownLabel(f"label index {i} outside 0..{len(self.classes) - 1}")
        raise UnknownLabel(f"unknown label {name!r}")

    def resolve_all(self, values: Iterable) -> tuple[int, ...]:
        return tuple(sorted({self.resolve(v) for v in values}))
