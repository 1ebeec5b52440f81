#!/usr/bin/env python3
"""Loss curves from training runs' metrics files as one SVG (no plotting library needed), and
each curve's mean loss over windows of 20 steps against the first curve's.

    python3 scripts/plot-curves.py OUT.svg CURVE...

A CURVE is
  NAME=FILE[,FILE...][@FIELD]  the step lines of `train` or `distill` metrics files (`--metrics
                               FILE`, JSON lines): FIELD is `loss` by default, or a part of the
                               loss (`data` for distill's cross-entropy on the batch); several
                               files (seeds) plot their mean at each step, over the steps all of
                               them ran;
  FILE                         the same with the file's name as NAME; or, for a file of `LOSSES
                               {json}` lines (examples/bench/peers/fp8_curves.py), one curve a
                               recipe, the mean over its seeds.

  e.g. python3 scripts/plot-curves.py curves.svg bf16=seed1.jsonl,seed2.jsonl fp8=fp8-seed1.jsonl
"""
import json
import os
import sys

W, H, PAD = 720, 400, 50
COLORS = ["#000000", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]


def mean_curve(runs):
    steps = min(len(r) for r in runs)
    return [sum(r[i] for r in runs) / len(runs) for i in range(steps)]


def step_values(path, field):
    """FIELD (a top-level key, or a part of the loss) of each step line of a metrics file, in
    step order."""
    values = {}
    for line in open(path, errors="replace"):
        line = line.strip()
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if "loss" not in entry:  # an evaluation's line
            continue
        value = entry.get(field, entry.get("parts", {}).get(field))
        if value is not None:
            values[entry["step"]] = float(value)
    return [values[step] for step in sorted(values)]


def peer_curves(path):
    """{recipe: [losses of each seed]} from `LOSSES {json}` lines."""
    runs = {}
    for line in open(path, errors="replace"):
        if line.startswith("LOSSES "):
            run = json.loads(line[len("LOSSES "):])
            runs.setdefault(run["recipe"], []).append(run["losses"])
    return runs


def curves(spec):
    """[(name, curve)] of one CURVE argument."""
    name, eq, rest = spec.partition("=")
    if not eq:
        name, rest = os.path.splitext(os.path.basename(spec))[0], spec
    paths, _, field = rest.partition("@")
    paths = paths.split(",")
    if not eq and len(paths) == 1:
        by_recipe = peer_curves(paths[0])
        if by_recipe:
            return [(f"{name} {recipe}", mean_curve(runs)) for recipe, runs in by_recipe.items()]
    runs = [step_values(p, field or "loss") for p in paths]
    runs = [r for r in runs if r]
    if not runs:
        sys.exit(f"no step lines with {field or 'loss'} in {', '.join(paths)}")
    return [(name, mean_curve(runs))]


def smooth(values, k=10):
    return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


def svg(out, named):
    steps = max(len(c) for _, c in named)
    lo = min(min(c) for _, c in named)
    hi = max(max(c[5:] or c) for _, c in named)
    hi = hi if hi > lo else lo + 1
    x = lambda i: PAD + (W - 2 * PAD) * i / max(steps - 1, 1)
    y = lambda v: H - PAD - (H - 2 * PAD) * (min(v, hi) - lo) / (hi - lo)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
             f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
             f'<text x="{W / 2}" y="{H - 15}" text-anchor="middle">step</text>',
             f'<text x="12" y="{H / 2}" transform="rotate(-90 12 {H / 2})" text-anchor="middle">loss (mean of 10 steps)</text>']
    for t in range(5):
        v = lo + (hi - lo) * t / 4
        parts.append(f'<text x="{PAD - 5}" y="{y(v) + 4}" text-anchor="end">{v:.2f}</text>')
    for t in range(0, steps + 1, 50):
        parts.append(f'<text x="{x(min(t, steps - 1))}" y="{H - PAD + 15}" text-anchor="middle">{t}</text>')
    for n, (name, c) in enumerate(named):
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(smooth(c)) if i >= 5 or len(c) <= 5)
        color = COLORS[n % len(COLORS)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<text x="{W - PAD - 190}" y="{PAD + 16 * n}" fill="{color}">{name} ({len(c)} steps)</text>')
    with open(out, "w") as f:
        f.write("\n".join(parts + ["</svg>"]) + "\n")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    named = [curve for spec in sys.argv[2:] for curve in curves(spec)]
    svg(sys.argv[1], named)
    base_name, base = named[0]
    print(f"mean loss over the 20 steps up to each mark, and against {base_name}'s:")
    for name, c in named:
        marks = sorted({m for m in range(100, len(c) + 1, 100)} | ({len(c)} if len(c) >= 20 else set()))
        cells = []
        for m in marks:
            mean = sum(c[m - 20:m]) / 20
            if m <= len(base):
                ref = sum(base[m - 20:m]) / 20
                cells.append(f"{m}: {mean:.4f} ({(mean - ref) / ref * 100:+.2f}%)")
            else:
                cells.append(f"{m}: {mean:.4f}")
        print(f"  {name}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
