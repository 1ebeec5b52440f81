"""One training step's GPU time by kernel, from Nsight Compute's per-kernel durations.

  ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw --print-units base \
      PROGRAM ... > kernels.csv
  python3 kernel_times.py kernels.csv MARKER [TOP]
  python3 kernel_times.py kernels.csv - [TOP]      every kernel profiled (a decoding run, say)

PROGRAM runs at least three steps (two warm-up and a timed one): the first step's optimizer
makes the parameters compact (CubeCL allocates some shapes with padded rows), and their
flattening copies launch after its optimizer block, inside the next step's window. MARKER is a regular expression naming
the optimizer's kernels (ours: `adamw`; PyTorch's fused AdamW: `[Aa]dam`): the last step is the
kernels after the optimizer block before the last one, up to the end of the last one (a block:
markers no more than 64 launches apart). Prints the step's total, then its kernels grouped by name
(launch arguments cut off), largest first.
"""
import csv
import re
import sys


def rows(path):
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    table = list(csv.reader(lines))
    header = table[0]
    name, time = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    out = []
    for row in table[1:]:
        try:
            out.append((row[name], float(row[time].replace(",", ""))))
        except ValueError:
            continue  # a units row
    return out


def blocks(indices, gap=64):
    """Runs of indices no more than `gap` apart, as (first, last)."""
    runs = []
    for i in indices:
        if runs and i - runs[-1][1] <= gap:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def main():
    path, marker = sys.argv[1], sys.argv[2]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    kernels = rows(path)
    if marker == "-":
        return table(kernels, "all kernels", top)
    runs = blocks([i for i, (n, _) in enumerate(kernels) if re.search(marker, n)])
    if len(runs) < 2:
        sys.exit(f"{len(runs)} optimizer block(s) among {len(kernels)} kernels: need two steps")
    table(kernels[runs[-2][1] + 1 : runs[-1][1] + 1], "last step", top)


def table(step, what, top):
    total = sum(t for _, t in step)
    print(f"{what}: {len(step)} kernels, {total / 1e6:.2f} ms of GPU time")
    groups = {}
    for n, t in step:
        key = re.sub(r"[(<].*$", "", n)[:90]
        count, ns = groups.get(key, (0, 0.0))
        groups[key] = (count + 1, ns + t)
    print(f"{'ms':>9} {'share':>6} {'calls':>6}  kernel")
    for key, (count, ns) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{ns / 1e6:9.3f} {100 * ns / total:5.1f}% {count:6d}  {key}")


if __name__ == "__main__":
    main()
