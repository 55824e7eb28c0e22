"""The check's report: JSON (every row) and Markdown (what passed, the timing table)."""

from __future__ import annotations

import platform

from difflet_tpu import checks

SECTIONS = ("ports", "streaming", "sites", "steps")


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "libtpu", "flax", "difflet-tpu"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def annotate(report: dict, factors) -> None:
    """Adds the calibrated estimate and estimate / measured to every row with a breakdown."""
    from difflet_tpu.tools import calibration

    for sec in ("sites", "steps"):
        for r in report.get(sec, []):
            if r.get("breakdown_raw"):
                r["expected_ms"] = round(calibration.expected_ms(r["breakdown_raw"], factors), 4)
                if r.get("measured_ms"):
                    r["expected_over_measured"] = round(r["expected_ms"] / r["measured_ms"], 3)


def failures(report: dict) -> list:
    return [f"{sec}: {label(r)}: {r['error']}" for sec in SECTIONS for r in report.get(sec, []) if "error" in r]


def label(r: dict) -> str:
    if r["what"] == "port":
        return f"{r['port']} {r['mode']} {r['dtype']}"
    if r["what"] == "streaming":
        return f"{r['kind']} {r['rows']} rows, {r['chunks_expected']} chunks"
    return f"{r['name']} ({r['impl']})"


def section(title: str, *columns: str) -> list:
    """A Markdown section's heading and its table's header rows."""
    return ["", f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def markdown(report: dict) -> str:
    fmt = lambda v, spec=".3f": "" if v is None else format(v, spec)
    L = [f"# difflet-tpu check: {report['platform']}", ""]
    L.append(report["note"])
    L += ["", f"- devices: {report['devices']}", f"- chip constants: {(report.get('chip') or {}).get('name')}",
          "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
          f"- calibration: {report['calibration']}", f"- command: `{report['command']}`", ""]
    fails = failures(report)
    counts = {sec: len(report.get(sec, [])) for sec in SECTIONS}
    L.append(f"**{'PASSED' if not fails else 'FAILED'}**: " + ", ".join(f"{n} {sec} rows" for sec, n in counts.items())
             + f"; {len(fails)} failed.")
    L += [f"- {f}" for f in fails]
    if report.get("ports"):
        L += section("Ports (tiny presets) against float64", "port", "mode", "mesh", "dtype", "rel. error", "tol",
                     "result")
        for r in report["ports"]:
            L.append(f"| {r['port']} | {r['mode']} | {r['mesh']} | {r['dtype']} | {fmt(r.get('rel_err'), '.2e')} | "
                     f"{r['tol']:g} | {r.get('error', 'ok')} |")
    if report.get("streaming"):
        L += section("Streaming kernels: credit / semaphore paths", "kernel", "rows", "widths", "chunks",
                     "max abs err", "result")
        for r in report["streaming"]:
            L.append(f"| {r['kind']} | {r['rows']} | {r['widths']} | {r.get('chunks')} | {r.get('max_abs_err', '')} | "
                     f"{r.get('error', 'ok')} |")
    for sec, title in (("sites", "Collective-matmul sites"), ("steps", "Denoise steps")):
        if not report.get(sec):
            continue
        L += section(title, "what", "impl", "rel. error vs plain", "measured ms", "est. raw ms", "expected ms",
                     "expected / measured", "result")
        for r in report[sec]:
            L.append(f"| {r['name']} | {r['impl']} | {fmt(r.get('rel_err_vs_plain'), '.2e')} | {fmt(r.get('measured_ms'))} | "
                     f"{fmt(r.get('estimate_raw_ms'))} | {fmt(r.get('expected_ms'))} | "
                     f"{fmt(r.get('expected_over_measured'), '.2f')} | "
                     f"{r.get('error') or r.get('skipped') or r.get('note') or 'ok'} |")
    return "\n".join(L) + "\n"


def write(path: str, text: str) -> None:
    """Writes atomically (`checks.write_atomic`): no partial file is left behind."""
    checks.write_atomic(path, text, "report")
