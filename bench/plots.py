"""The PNG beside a suite's results JSON, for the suites whose numbers read better as a picture.

    python -m bench.plots bench/results/decode.json     # (re)draw from a results file

bench.cli calls `write` after every run; suites without a plot get none.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def roofline(result: dict, fig) -> None:
    """decode: arithmetic intensity vs achieved FLOP/s of every case under the measured
    roofs (bandwidth x intensity, sloped; the GEMM rate, flat). Decode sits far left of the
    ridge: bandwidth-bound."""
    fig.set_size_inches(9, 6)
    ax = fig.subplots()
    rows, ceil = result["rows"], result["ceilings"]
    ai = np.array([r["intensity_flop_per_byte"] for r in rows])
    xs = np.geomspace(min(ai.min(), 0.5) / 2,
                      max(ai.max() * 4, 4 * ceil["gemm_TFLOPs"] / ceil["read_TBps"]), 200)
    for name, bw in (("read", ceil["read_TBps"]), ("copy", ceil["copy_TBps"])):
        ax.plot(xs, np.minimum(xs * bw, ceil["gemm_TFLOPs"]), "--",
                label=f"roof: {name} {bw:.3g} TB/s, GEMM {ceil['gemm_TFLOPs']:.4g} TFLOP/s")

    def series(r):
        return (r["model"], r["weights"], r["kv_dtype"]) + (
            ("unrolled",) if r.get("unroll_layers") else ()) + (
            (f"{r['lm_head']} head",) if r.get("lm_head") else ())

    for key in sorted({series(r) for r in rows}):
        sel = [r for r in rows if series(r) == key]
        ax.scatter([r["intensity_flop_per_byte"] for r in sel],
                   [r["achieved_TFLOPs"] for r in sel], label="/".join(key), zorder=3)
        for r in sel:
            ax.annotate(f"B{r['batch']} C{r['context']}", (r["intensity_flop_per_byte"],
                        r["achieved_TFLOPs"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte moved)",
           ylabel="achieved TFLOP/s", title=f"decode roofline, {result['device']}")


def latency(result: dict, fig) -> None:
    """serving: e2e and TTFT p99 vs offered rate per workload, under the latency budget."""
    fig.set_size_inches(9, 6)
    ax = fig.subplots()
    for workload in sorted({r["workload"] for r in result["rows"]}):
        rows = sorted((r for r in result["rows"] if r["workload"] == workload),
                      key=lambda r: r["rate"])
        for key, style in (("e2e_p99_ms", "-o"), ("ttft_p99_ms", ":x")):
            ax.plot([r["rate"] for r in rows], [r[key] for r in rows], style,
                    label=f"{workload} {key.removesuffix('_ms')}")
    if result.get("e2e_budget_ms"):
        ax.axhline(result["e2e_budget_ms"], color="gray", ls="--", label="e2e budget")
    ax.set(yscale="log", xlabel="offered rate (requests/s)", ylabel="ms",
           title=f"serving {result.get('model', '')}, {result.get('device', '')}")


def _panels(fig, rows, panel, x: str, series, y, ylabel: str, title: str,
            xlabel: str) -> None:
    """y(row) vs row[x], one panel per panel(row) (sort key, title), one line per
    series(row); rows without a time (errors) are left out."""
    rows = [r for r in rows if "us" in r and x in r]
    panels = sorted({panel(r) for r in rows})
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, name in zip(axes, panels):
        mine = [r for r in rows if panel(r) == name]
        for key in sorted({series(r) for r in mine}):
            sel = sorted((r for r in mine if series(r) == key), key=lambda r: r[x])
            ax.plot([r[x] for r in sel], [y(r) for r in sel], "-o", ms=3,
                    label=" ".join(k for k in key if k))
        ticks = sorted({r[x] for r in mine})
        ax.set(xscale="log", xlabel=xlabel, title=name[1])
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
        ax.minorticks_off()
    axes[0].set_ylabel(ylabel)
    fig.suptitle(title)


def attention_bandwidth(result: dict, fig) -> None:
    """paged_attention: TB/s vs context per impl and KV form, one panel per batch size."""
    rows = [r for r in result["rows"] if r.get("impl") != "write_kv"]
    _panels(fig, rows, lambda r: (r["batch"], f"batch {r['batch']}"), "context",
            lambda r: (r["impl"], r["kv_dtype"], r.get("kv_scales", "")),
            lambda r: r.get("TBps_device") or r["TBps"], "TB/s (device time where measured)",
            f"paged decode attention, {result['device']}", "context tokens")


def matmul_time(result: dict, fig) -> None:
    """fp8_matmul: microseconds per op vs M per impl, one panel per weight shape."""
    _panels(fig, result["rows"], lambda r: ((r["K"], r["N"]), f"K x N {r['K']}x{r['N']}"),
            "M", lambda r: (r["impl"],), lambda r: r.get("us_device") or r["us"],
            "us per op (device time where measured)",
            f"FP8-weight matmul, {result['device']}", "tokens M")
    fig.axes[0].set_yscale("log")


PLOTS = {"decode": ("roofline", roofline), "serving": ("latency", latency),
         "paged_attention": ("bandwidth", attention_bandwidth),
         "fp8_matmul": ("time", matmul_time)}


def write(json_path) -> Path | None:
    """Draw the suite's plot beside its results file (`<stem>_<kind>.png`); None when the
    suite has no plot, the file no rows, or matplotlib is missing."""
    json_path = Path(json_path)
    result = json.loads(json_path.read_text())
    if result.get("suite") not in PLOTS or not result.get("rows"):
        return None
    try:
        import matplotlib
    except ImportError:
        print("no plot: install matplotlib", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind, draw = PLOTS[result["suite"]]
    fig = plt.figure(figsize=(14, 5.5))
    draw(result, fig)
    for ax in fig.axes:
        ax.grid(True, which="both", alpha=0.3)
    fig.axes[0].legend(fontsize=6)
    fig.tight_layout()
    png = json_path.with_name(f"{json_path.stem}_{kind}.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


if __name__ == "__main__":
    for arg in sys.argv[1:] or sys.exit(__doc__):
        print(write(arg))
