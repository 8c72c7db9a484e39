"""`dew.lazy.kept`: a result kept per hashable arguments, computed again for unhashable ones."""

from __future__ import annotations

from dew.lazy import kept


def test_kept_computes_once_per_hashable_argument_and_each_time_otherwise():
    calls = []

    @kept(maxsize=2)
    def traced(value):
        calls.append(value)
        return len(calls)

    assert [traced(("a",)), traced(("a",)), traced(("b",))] == [1, 1, 2]
    assert traced(["a"]) == 3 and traced(["a"]) == 4  # a list cannot be hashed: no key to keep it under
    assert traced(("c",)) == 5  # a third argument pushes out the least recently used, ("a",)
    assert traced(("b",)) == 2 and traced(("a",)) == 6
    assert calls == [("a",), ("b",), ["a"], ["a"], ("c",), ("a",)]
