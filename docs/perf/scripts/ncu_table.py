#!/usr/bin/env python3
"""Reads `ncu --csv --print-units base --metrics gpu__time_duration.sum` output and prints one
steady step's kernel time by kernel name (and the ordered list to a second file).

  ncu_table.py LOG TABLE ORDERED [WINDOW]

WINDOW, a kernel-name prefix: the step runs from its second launch to its third (our bench
with --warmup 2 --steps 1 and the cross-entropy's `ce_partials`); without it every kernel
profiled counts (the peer, profiled from its timed step's start).
"""
import collections
import csv
import re
import sys

log, table, ordered = sys.argv[1:4]
window = sys.argv[4] if len(sys.argv) > 4 else None
rows = []
with open(log) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = r["Kernel Name"]
    # CubeCL's names end in a hash of the kernel's settings; C++ names keep their templates.
    short = re.sub(r"_[0-9a-f]{8}$", "", name.split("(")[0]) if "<" not in name else name[:160]
    rows.append((short, float(r["Metric Value"].replace(",", "")) / 1e3, name))
if window:
    starts = [i for i, r in enumerate(rows) if r[0].startswith(window)]
    rows = rows[starts[1]:starts[2]] if len(starts) >= 3 else []
total = collections.defaultdict(float)
count = collections.Counter()
for short, us, name in rows:
    total[short] += us
    count[short] += 1
with open(table, "w") as t:
    t.write(f"# {len(rows)} kernels, {sum(total.values()) / 1e3:.2f} ms\n")
    for short, us in sorted(total.items(), key=lambda kv: -kv[1]):
        t.write(f"{us:10.1f} us {count[short]:5d}  {short}\n")
with open(ordered, "w") as o:
    for short, us, name in rows:
        o.write(f"{us:9.1f}  {name[:200]}\n")
print(f"{len(rows)} kernels, {sum(total.values()) / 1e3:.2f} ms of GPU time")
