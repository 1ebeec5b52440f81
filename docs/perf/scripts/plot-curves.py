#!/usr/bin/env python3
"""Loss curves of `train` (or `distill`) logs as one SVG (no plotting library needed), and the
mean loss of each run over windows of 20 steps against the first run's.

    python3 docs/perf/scripts/plot-curves.py OUT.svg NAME=LOG[,LOG...][@FIELD] [NAME=... ...]

FIELD is the word before the value plotted in each `step N ...` line (`loss` by default;
`data` for distill's cross-entropy on the batch). Several logs a name (runs from several
seeds) plot their mean at each step, over the steps all of them ran.
"""
import sys

W, H, PAD = 720, 400, 50
COLORS = ["#000000", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e"]


def losses(spec):
    paths, _, field = spec.partition("@")
    field = field or "loss"
    runs = []
    for path in paths.split(","):
        values = []
        for line in open(path):
            if line.startswith("step "):
                words = line.split()
                values.append(float(words[words.index(field) + 1]))
        runs.append(values)
    steps = min(len(r) for r in runs)
    return [sum(r[i] for r in runs) / len(runs) for i in range(steps)]


def smooth(values, k=10):
    return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


def main():
    out, runs = sys.argv[1], [a.split("=", 1) for a in sys.argv[2:]]
    curves = [(name, losses(path)) for name, path in runs]
    steps = max(len(c) for _, c in curves)
    lo = min(min(c) for _, c in curves)
    hi = max(max(c[5:]) for _, c in curves)
    x = lambda i: PAD + (W - 2 * PAD) * i / (steps - 1)
    y = lambda v: H - PAD - (H - 2 * PAD) * (min(v, hi) - lo) / (hi - lo)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 15}" text-anchor="middle">step</text>',
           f'<text x="12" y="{H / 2}" transform="rotate(-90 12 {H / 2})" text-anchor="middle">loss (mean of 10 steps)</text>']
    for t in range(5):
        v = lo + (hi - lo) * t / 4
        svg.append(f'<text x="{PAD - 5}" y="{y(v) + 4}" text-anchor="end">{v:.2f}</text>')
    for t in range(0, steps + 1, 50):
        svg.append(f'<text x="{x(min(t, steps - 1))}" y="{H - PAD + 15}" text-anchor="middle">{t}</text>')
    for n, (name, c) in enumerate(curves):
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(smooth(c)) if i >= 5)
        color = COLORS[n % len(COLORS)]
        svg.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        svg.append(f'<text x="{W - PAD - 150}" y="{PAD + 16 * n}" fill="{color}">{name} ({len(c)} steps)</text>')
    open(out, "w").write("\n".join(svg + ["</svg>"]) + "\n")
    base_name, base = curves[0]
    for name, c in curves:
        ends = [e for e in (100, 200, 220, 300) if e <= len(c)]
        cells = [f"{e}: {sum(c[e - 20:e]) / 20:.4f} ({(sum(c[e - 20:e]) - sum(base[e - 20:e])) / sum(base[e - 20:e]) * 100:+.1f}%)" for e in ends]
        print(f"{name}: " + ", ".join(cells))


main()
