"""Evaluation report: per-task summary, JSON file, console table and a PNG summary plot.

Memory tasks carry their chance level (``memory.chance_level``: the best cue-blind answer's success rate)
beside the success rate, in the summary, the table and the plot, and how their episodes answered
(``memory.answers``: presses made per N asked, the pad the hand ended over, the miss distance) in the summary
and under the table.
"""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path

import numpy as np

from ..data.durable import write_atomic, write_text_atomic
from .evaluate import EpisodeResult, episode_record
from .memory import answers, chance_level

log = logging.getLogger(__name__)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _control_totals(rs: list[EpisodeResult]) -> dict:
    """Runs on the control loop: its counters summed, and the share of ticks that had no action of their own."""
    stats = [r.control for r in rs if r.control is not None]
    if not stats:
        return {}
    totals = {k: int(sum(s[k] for s in stats)) for k in ("ticks", "fallbacks", "steps", "steps_late", "actions_skipped", "actions_blended")}
    totals["empty_tick_share"] = totals["fallbacks"] / totals["ticks"] if totals["ticks"] else 0.0
    return {"control": totals}


def summarize(results: list[EpisodeResult]) -> dict:
    """{"tasks": {task: metrics}, "overall": metrics} with success rate, chance level, control rate, latencies,
    KV bytes. ``chance_level`` is ``None`` for tasks without one (and overall unless every task has one)."""

    def metrics(rs: list[EpisodeResult]) -> dict:
        chances = [chance_level(r.task) for r in rs]
        step_ms = [v for r in rs for v in r.step_ms]
        inference_ms = [v for r in rs for v in r.inference_ms]
        steps = sum(r.steps for r in rs)
        policy_s = sum(r.policy_s for r in rs)
        return {
            "episodes": len(rs),
            "successes": int(sum(r.success for r in rs)),
            "success_rate": float(np.mean([r.success for r in rs])),
            "chance_level": None if None in chances else float(np.mean(chances)),
            "mean_steps": float(np.mean([r.steps for r in rs])),
            "control_rate_hz": steps / policy_s if policy_s > 0 else None,
            "step_latency_ms": {"p50": _pct(step_ms, 50), "p95": _pct(step_ms, 95)},
            "inference_latency_ms": {"p50": _pct(inference_ms, 50), "p95": _pct(inference_ms, 95)},
            "kv_bytes_max": int(max(r.kv_bytes_max for r in rs)),
            "kv_bytes_mean_final": float(np.mean([r.kv_final.get("bytes", 0) for r in rs])),
            "errors": int(sum(r.error is not None for r in rs)),
            **_control_totals(rs),
        }

    tasks = sorted({r.task for r in results}, key=[r.task for r in results].index)
    summary = {"tasks": {}, "overall": metrics(results)}
    for task in tasks:
        rs = [r for r in results if r.task == task]
        summary["tasks"][task] = metrics(rs)
        summary["tasks"][task]["video"] = next((r.video for r in rs if r.video), None)
        counted = answers(task, [r.final_info or {} for r in rs])
        if counted:  # memory tasks: how the episodes answered (a lost memory or a missed reach)
            summary["tasks"][task]["answers"] = counted
    return summary


def format_table(summary: dict) -> str:
    """Plain-text table, one line per task plus the overall line."""

    def fmt(v, spec):  # spec "W.Pf": a missing value is "-" in the same width
        return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))

    head = f"{'task':<32} {'success':>9} {'chance':>7} {'ctrl Hz':>8} {'p50 ms':>8} {'p95 ms':>8} {'KV MiB':>8}"
    lines = [head, "-" * len(head)]
    rows = list(summary["tasks"].items()) + [("overall", summary["overall"])]
    for name, m in rows:
        lines.append(
            f"{name:<32} {m['successes']:>4}/{m['episodes']:<4} {fmt(m['chance_level'], '7.1%')} {fmt(m['control_rate_hz'], '8.1f')} "
            f"{fmt(m['step_latency_ms']['p50'], '8.1f')} {fmt(m['step_latency_ms']['p95'], '8.1f')} "
            f"{m['kv_bytes_max'] / 2**20:8.2f}"
        )
    for name, m in summary["tasks"].items():
        if m.get("answers"):
            lines.append(f"{name} answers: " + ", ".join(f"{k}: {v}" for k, v in m["answers"].items()))
    return "\n".join(lines)


def write_report(path: Path, results: list[EpisodeResult], summary: dict, meta: dict) -> Path:
    """JSON report: ``meta`` (checkpoint, simulator, configs), the summary and every episode."""
    import torch

    report = {
        "env": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()},
        **meta,
        "summary": summary,
        "episodes": [episode_record(r) for r in results],
    }
    write_text_atomic(path, json.dumps(report, indent=2, default=str))
    return path


def plot_summary(path: Path, summary: dict, title: str) -> Path | None:
    """PNG: success rate per task and step latency p50/p95 per task. ``None`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no summary plot")
        return None
    tasks = list(summary["tasks"])
    m = [summary["tasks"][t] for t in tasks]
    x = np.arange(len(tasks))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(tasks) + 4), 4.5))
    bars = ax1.bar(x, [v["success_rate"] * 100 for v in m], color="tab:green")
    for bar, v in zip(bars, m):
        ax1.annotate(f"{v['successes']}/{v['episodes']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                     ha="center", va="bottom", fontsize=8)
    chance = [(i, v["chance_level"] * 100) for i, v in enumerate(m) if v["chance_level"] is not None]
    if chance:
        ax1.hlines([c for _, c in chance], [i - 0.4 for i, _ in chance], [i + 0.4 for i, _ in chance],
                   colors="black", linestyles="dashed", label="chance")
        ax1.legend(fontsize=8)
    ax1.set_ylim(0, 100)
    ax1.set_ylabel("success rate (%)")
    ax1.set_title(f"success (overall {summary['overall']['success_rate'] * 100:.0f}%)")
    p50 = [v["step_latency_ms"]["p50"] or 0 for v in m]
    p95 = [v["step_latency_ms"]["p95"] or 0 for v in m]
    ax2.bar(x - 0.2, p50, 0.4, label="p50")
    ax2.bar(x + 0.2, p95, 0.4, label="p95")
    ax2.set_ylabel("policy step latency (ms)")
    hz = summary["overall"]["control_rate_hz"]
    ax2.set_title(f"latency (mean control rate {hz:.1f} Hz)" if hz else "latency")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(x)
        ax.set_xticklabels(tasks, rotation=30, ha="right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return path
