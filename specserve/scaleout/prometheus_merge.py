"""Several replicas' Prometheus text in one exposition, each sample labelled with its replica.

The text format allows one HELP/TYPE block per metric family, so samples are grouped by family across
replicas rather than concatenated. A sample belongs to the family whose TYPE line came last before it
(a histogram's `_bucket`, `_sum` and `_count` lines follow their family's header).
"""
from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s+.*)$")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def with_label(line: str, name: str, value: str) -> str:
    """`metric{a="1"} 2` -> `metric{a="1",name="value"} 2` (also for a sample without labels)."""
    m = _SAMPLE.match(line)
    if not m:
        return line
    metric, labels, rest = m.groups()
    label = f'{name}="{_escape(value)}"'
    inner = labels[1:-1] if labels else ""
    return f"{metric}{{{inner + ',' if inner else ''}{label}}}{rest}"


def merge(texts: dict[str, str], label: str = "replica") -> str:
    """{replica: exposition text} -> one exposition with `label="replica"` on every sample."""
    headers: dict[str, list[str]] = {}  # family -> its HELP/TYPE lines (from the first replica that has it)
    samples: dict[str, list[str]] = {}  # family -> samples of every replica
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    block = headers.setdefault(family, [])
                    if len(block) < 2 and not any(l.split(None, 2)[1] == parts[1] for l in block):
                        block.append(line)
                continue
            name = _SAMPLE.match(line).group(1) if _SAMPLE.match(line) else ""
            key = family if family is not None and name.startswith(family) else name
            samples.setdefault(key, []).append(with_label(line, label, replica))
            headers.setdefault(key, [])
    out = []
    for family, block in headers.items():
        out.extend(block)
        out.extend(samples.get(family, []))
    return "\n".join(out) + "\n"
