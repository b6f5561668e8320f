"""Test suite wall time before and after a change, compared on the tests both have (by module and name).

    pytest -q --junitxml=/tmp/after.xml                                   # this checkout
    cd OLD && PYTHONPATH=. pytest -q --junitxml=/tmp/before.xml           # the old checkout
    python bench/suite_time.py /tmp/before.xml /tmp/after.xml
"""
import sys
import xml.etree.ElementTree as ET


def load(path: str) -> tuple[float, dict]:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return float(suite.get("time")), {(c.get("classname"), c.get("name")): float(c.get("time"))
                                      for c in suite.iter("testcase")}


def main(before_xml: str, after_xml: str) -> None:
    (bt, b), (at, a) = load(before_xml), load(after_xml)
    common = set(a) & set(b)
    sb, sa = sum(b[k] for k in common), sum(a[k] for k in common)
    print(f"before suite: {len(b)} tests, {bt:.0f} s wall; after suite: {len(a)} tests, {at:.0f} s wall")
    print(f"tests in both (same module and name): {len(common)}; their summed time before {sb:.0f} s, "
          f"after {sa:.0f} s, ratio {sa / sb:.3f}")
    only_b, only_a = set(b) - set(a), set(a) - set(b)
    print(f"before-only tests: {len(only_b)} ({sum(b[k] for k in only_b):.0f} s); "
          f"after-only: {len(only_a)} ({sum(a[k] for k in only_a):.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python bench/suite_time.py BEFORE.xml AFTER.xml")
    main(*sys.argv[1:])
