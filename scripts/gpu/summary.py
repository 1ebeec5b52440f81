#!/usr/bin/env python3
"""The table at the end of scripts/gpu/rows.sh: one row a RESULT line of each run, with the
GPU memory nvidia-smi saw and the clock the GPU held while busy; then the kernel benchmarks'
lines (GEMM, GROUPED, ATTENTION), one row a shape, each kernel's TFLOP/s.

  python3 scripts/gpu/summary.py OUT/runs.tsv

runs.tsv: NAME, exit code, seconds, one run a line; its output is OUT/NAME.log, its nvidia-smi
samples (index, memory used MiB, SM clock MHz, power W, utilization %) OUT/NAME.smi.
"""
import json
import os
import re
import statistics
import sys


def results(log):
    """(kind, fields) of each `KIND {json}` line of a log."""
    out = []
    for line in open(log, errors="replace"):
        match = re.match(r"^(RESULT|GEMM|GROUPED|ATTENTION) (\{.*\})\s*$", line)
        if match:
            try:
                out.append((match[1], json.loads(match[2])))
            except json.JSONDecodeError:
                pass
    return out


def gpu_samples(smi):
    """Peak memory (MiB) over the GPUs; median SM clock and mean power while a GPU was busy."""
    peak, clocks, power = {}, [], []
    if not os.path.exists(smi):
        return "", ""
    for line in open(smi, errors="replace"):
        cells = [c.strip() for c in line.split(",")]
        try:
            gpu, memory = cells[0], float(cells[1])
        except (IndexError, ValueError):
            continue
        peak[gpu] = max(peak.get(gpu, 0.0), memory)
        try:
            if float(cells[4]) >= 90:
                clocks.append(float(cells[2]))
                power.append(float(cells[3]))
        except (IndexError, ValueError):
            pass
    memory = "/".join(f"{peak[g]:.0f}" for g in sorted(peak))
    busy = f"{statistics.median(clocks):.0f} MHz {statistics.mean(power):.0f} W" if clocks else ""
    return memory, busy


def describe(r):
    """What ran: the peer, its recipe, its parallel sizes above 1."""
    words = [r.get("peer", "?")]
    if r.get("recipe") not in (None, "bf16-fp32-master"):
        words.append(r["recipe"])
    words += [f"{k}{r[k]}" for k in ("tp", "dp", "cp", "ep", "pp", "vpp") if (r.get(k) or 1) > 1]
    if "op" in r:
        words.append(f"{r['op']} {r['bytes'] / 2**20:.0f}MiB")
    if "stepping" in r:
        words.append(str(r["stepping"]))
    return " ".join(words)


def figure(r):
    if "tokens_per_s" in r:
        return f"{r['tokens_per_s'] / 1e3:.1f}k tok/s"
    if "decode_tokens_per_s" in r:
        return f"{r['decode_tokens_per_s']} decode tok/s b{r.get('batch')}"
    if "busbw_gbps" in r:
        return f"{r['busbw_gbps']} GB/s"
    return ""


def note(log, found):
    """A run without a RESULT line: its kernel lines, its test count, its training loss, or its
    last error (else its last line)."""
    if found:
        return f"{len(found)} {found[0][0]} lines: the table below"
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    counts = re.findall(r"^(?:\S*:\s*)?(\d+ passed, \d+ failed.*)$", text, re.M)
    if counts:
        return counts[-1]
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)", text, re.M)]
    if losses:
        tail = losses[-20:]
        return f"{len(losses)} steps, loss {losses[-1]:.4f}, mean of the last {len(tail)} {sum(tail) / len(tail):.4f}"
    errors = re.findall(r"^.*(?:panicked|Error|error:|Killed|FAILED|not found).*$", text, re.M)
    last = [line for line in text.splitlines() if line.strip()]
    return (errors[-1] if errors else last[-1] if last else "no output")[:110]


def main():
    runs_path = sys.argv[1]
    folder = os.path.dirname(runs_path)
    rows, kernels = [], {}
    for line in open(runs_path):
        name, rc, seconds = (line.rstrip("\n").split("\t") + ["", ""])[:3]
        log, smi = os.path.join(folder, name + ".log"), os.path.join(folder, name + ".smi")
        memory, busy = gpu_samples(smi)
        found = results(log) if os.path.exists(log) else []
        lines = [r for kind, r in found if kind == "RESULT"]
        for kind, r in found:
            if kind != "RESULT" and "shape" in r:
                key = (kind, r["shape"], r.get("pass", ""))
                value = r.get("tflops", r.get("forward_tflops"))
                if "backward_tflops" in r:
                    value = f"{value}/{r['backward_tflops']}"
                kernels.setdefault(key, {})[str(r.get("kernel"))] = value if value is not None else "error"
        if not lines:
            rows.append([name, rc, seconds, note(log, found), "", "", "", "", "", "", memory, busy])
        for r in lines:
            mfu = r.get("mfu")
            rows.append([name, rc, seconds, describe(r), r.get("preset", ""), figure(r),
                         f"{100 * mfu:.1f}%" if mfu is not None else "", r.get("step_ms", ""),
                         r.get("peak_mem_gib", ""), r.get("loss", ""), memory, busy])
    header = ["run", "rc", "s", "what", "preset", "figure", "MFU", "step ms", "GiB", "loss", "smi MiB", "busy"]
    table = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if kernels:
        print("\nkernel benchmarks (TFLOP/s; attention: forward/backward):")
        for (kind, shape, part), by_kernel in kernels.items():
            cells = " ".join(f"{k}={v}" for k, v in by_kernel.items() if k != "burn")
            print(f"  {kind.lower():9} {shape:18} {part:6} {cells}")


if __name__ == "__main__":
    main()
