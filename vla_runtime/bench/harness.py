"""What every benchmark shares (STYLE §2.5): timing, summaries and ratios, pinned threads, the environment
record, the JSON report and plotting.

    times = time_interleaved({"baseline": f, "ours": g}, warmup=5, repeats=30, device=device)
    results = ratio_table(times, "baseline")     # {name: times_ms, median_ms, p10_ms, p90_ms, ratio, baseline}
    print_ratio_table(results)                   # name | median ms | p10 | p90 | ratio vs baseline
    write_json(out.with_suffix(".json"), env=environment(device=device, threads=args.threads), args=args,
               results=results)
    plot_medians(results, out.with_suffix(".png"), title="...", xlabel="ms per step (median, p10-p90)")

Ratios are ``baseline median / row median`` (> 1: the row is faster). Timers take a ``clock`` (seconds, as
``time.perf_counter``) so that tests can feed known times. torch and matplotlib are imported inside the
functions that need them: a benchmark's client subprocess (``bench_serve.py --client``) stays light.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

Clock = Callable[[], float]
REPO = Path(__file__).resolve().parents[2]  # a source checkout's root (the git commit is read from here)


def positive_int(text: str) -> int:
    """argparse ``type`` of counts such as ``--repeats``: an integer >= 1 (0 repeats ran the whole setup, then
    failed on a median of nothing)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


# ---- timing ---------------------------------------------------------------------------------------------
def _synchronize(device) -> None:
    """Wait for queued CUDA work before reading the clock; nothing to wait for on CPU (or ``device=None``)."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], *, repeats: int, warmup: int = 0, device=None, clock: Clock = time.perf_counter) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn()`` after ``warmup`` untimed calls, synchronised on CUDA."""
    for _ in range(warmup):
        fn()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        _synchronize(device)
        times.append((clock() - start) * 1e3)
    return times


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]], *, warmup: int, repeats: int, device=None, clock: Clock = time.perf_counter,
    block: int = 1,
) -> dict[str, list[float]]:
    """Milliseconds per call of every function: ``warmup`` untimed calls each, then ``repeats`` rounds that call
    every function ``block`` times in a row, in order, so that drifting load on a shared machine hits all of them
    alike. ``block`` > 1 times each function the way a loop runs it (its code and data warm in the caches from
    its own previous call, not evicted by the others'); the first call of each block is untimed."""
    if block < 1:
        raise ValueError(f"block must be >= 1 calls, got {block}")
    for fn in fns.values():
        time_ms(fn, repeats=0, warmup=warmup, device=device, clock=clock)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name] += time_ms(fn, repeats=max(block - 1, 1), warmup=int(block > 1), device=device, clock=clock)
    return times


# ---- summaries and ratios -------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(times: Sequence[float]) -> dict[str, Any]:
    """``{"times_ms", "median_ms", "p10_ms", "p90_ms"}`` of the timed calls (milliseconds)."""
    times = [float(t) for t in times]
    return {"times_ms": times, "median_ms": statistics.median(times), "p10_ms": percentile(times, 10), "p90_ms": percentile(times, 90)}


def ratio_table(times: Mapping[str, Sequence[float]], baseline: str | Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Each row's ``summarize(...)`` plus ``baseline`` (the row it is compared with) and ``ratio`` = baseline
    median / row median (> 1: faster than the baseline). ``baseline``: one row name for all rows, or a row
    name per row (benchmarks that answer several questions, each against its own baseline)."""
    base_of = {name: baseline if isinstance(baseline, str) else baseline[name] for name in times}
    unknown = sorted({b for b in base_of.values() if b not in times})
    if unknown:
        raise KeyError(f"baseline rows {unknown} are not among the timed rows {sorted(times)}")
    summaries = {name: summarize(t) for name, t in times.items()}
    return {
        name: {**s, "baseline": base_of[name], "ratio": summaries[base_of[name]]["median_ms"] / s["median_ms"]}
        for name, s in summaries.items()
    }


def print_ratio_table(results: Mapping[str, Mapping[str, Any]]) -> None:
    """Print ``name | median ms | p10 | p90 | ratio vs baseline``, one line per ``ratio_table`` row."""
    width = max(len("name"), *(len(name) for name in results))
    print(f"{'name':{width}s} | median ms |     p10 |     p90 | ratio vs baseline")
    for name, r in results.items():
        print(f"{name:{width}s} | {r['median_ms']:9.2f} | {r['p10_ms']:7.2f} | {r['p90_ms']:7.2f} | {r['ratio']:6.2f}")


# ---- threads and environment ----------------------------------------------------------------------------
@contextmanager
def pinned_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside the block and restored after it (a benchmark's
    ``main`` may run inside another process: the CLI, a test)."""
    import torch

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def seeded_main(parse_args: Callable[[list[str] | None], argparse.Namespace], run: Callable[[argparse.Namespace], int],
                argv: list[str] | None = None) -> int:
    """A model benchmark's ``main``: parse ``argv``, log at INFO, seed torch with ``--seed``, ``run`` on
    ``--threads`` threads."""
    import torch

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    with pinned_threads(args.threads):
        return run(args)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git_sha(repo: Path = REPO) -> str | None:
    """The commit checked out in ``repo``, or None outside a git checkout (a wheel install)."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def environment(*, device="cpu", dtype=None, threads: int | None = None, **extra: Any) -> dict[str, Any]:
    """What the numbers depend on: torch and CUDA versions, device, CPU model, dtype, torch threads (the
    current setting unless given), Python and the git commit; ``extra`` adds a benchmark's own fields."""
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda" and torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if cuda else cpu_model(),
        "cpu": cpu_model(),
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
        "threads": torch.get_num_threads() if threads is None else threads,
        "python": platform.python_version(),
        "git_sha": git_sha(),
        **extra,
    }


# ---- report -------------------------------------------------------------------------------------------
def write_json(path: str | Path, *, env: Mapping[str, Any], args: argparse.Namespace | Mapping[str, Any], **sections: Any) -> Path:
    """Write ``{"env", "args", **sections}`` (usually ``results=...``) to ``path``, creating its folder; values
    JSON cannot hold (paths, dtypes) are written as strings. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"env": dict(env), "args": dict(vars(args) if isinstance(args, argparse.Namespace) else args), **sections}
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None (with a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written")
        return None
    return plt


def save_figure(fig, path: str | Path, *, dpi: int = 120) -> None:
    """Lay out, save and close ``fig``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_medians(results: Mapping[str, Mapping[str, Any]], path: str | Path, *, title: str, xlabel: str) -> None:
    """Horizontal bars of ``ratio_table`` rows: median with a p10-p90 whisker, the ratio in the label, and
    baselines in grey. Skipped (with a warning) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    names = list(results)[::-1]
    medians = [results[n]["median_ms"] for n in names]
    lo = [m - results[n]["p10_ms"] for n, m in zip(names, medians)]
    hi = [results[n]["p90_ms"] - m for n, m in zip(names, medians)]
    colors = ["tab:gray" if results[n]["baseline"] == n else "tab:blue" for n in names]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1))
    ax.barh(range(len(names)), medians, xerr=[lo, hi], color=colors, capsize=3)
    ax.set_yticks(range(len(names)), [f"{n}  x{results[n]['ratio']:.2f}" for n in names], fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    save_figure(fig, path)
