"""What the chunked cache's gate kept over an episode, as data and as a picture.

    trace = RetentionTrace()
    trace.record(session.retained_chunks(), result.kv.tokens_seen, tick=k)   # after every inference step (seeing tick k)
    plot_retention(trace, "retention.png", cue_steps=[3], title="...")  # x: control step, y: source step

Chunks are located by their first token (``EpisodeSession.retained_chunks``); ``tokens_seen`` after each
step gives the token range every step appended, so a chunk maps to the control step it came from. The
picture's cell (x, y) is how many chunks from step y the cache held after step x, averaged over layers
(retention is per layer); cue steps (a task's metadata, or given by hand) are marked, so a person sees
whether the cue survived to the end of the episode.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

RetainedStarts = tuple[tuple[int, ...], ...]  # per layer, first token of each retained chunk


@dataclass
class RetentionTrace:
    """Per policy step: the control step (simulator tick) whose frame it saw, tokens seen after it and the
    chunks held (per layer, by first token). Steps are counted in control steps throughout, so a policy that
    steps once per chunk (``execution_horizon``, ``eval --control-rate``) lines up with the cue steps a task
    reports in ticks.

    Args:
        step_ends: [policy steps] tokens seen after each step (``KVStats.tokens_seen``).
        retained: [policy steps] per layer, the first token of each chunk held after the step.
        ticks: [policy steps] the control step whose frame each one saw.
    """

    step_ends: list[int] = field(default_factory=list)
    retained: list[RetainedStarts] = field(default_factory=list)
    ticks: list[int] = field(default_factory=list)

    def record(self, retained: RetainedStarts, tokens_seen: int, *, tick: int) -> None:
        if self.ticks and tick < self.ticks[-1]:
            raise ValueError(f"tick {tick} comes before the last step's ({self.ticks[-1]}); steps are recorded in order")
        self.retained.append(tuple(tuple(layer) for layer in retained))
        self.step_ends.append(int(tokens_seen))
        self.ticks.append(int(tick))

    @property
    def policy_steps(self) -> int:
        return len(self.step_ends)

    @property
    def steps(self) -> int:
        """Control steps the trace spans (the last step's tick + 1)."""
        return self.ticks[-1] + 1 if self.ticks else 0

    def source_step(self, token: int) -> int:
        """The control step whose policy step appended ``token`` (the prompt counts as the first one's)."""
        return self.ticks[min(bisect.bisect_right(self.step_ends, token), self.policy_steps - 1)]

    def held_by_step(self) -> np.ndarray:
        """[steps (source, y), steps (control step, x)] chunks from step y held after step x, mean over layers
        (between two policy steps the cache holds what the earlier one left)."""
        grid = np.zeros((self.steps, self.steps))
        for i, layers in enumerate(self.retained):
            x, until = self.ticks[i], self.ticks[i + 1] if i + 1 < self.policy_steps else self.steps
            for starts in layers:
                for start in starts:
                    grid[self.source_step(start), x:max(until, x + 1)] += 1.0 / len(layers)
        return grid

    def held_sources(self, *, at: int = -1) -> dict[int, float]:
        """Source control step -> chunks from it held after policy step ``at`` (default: the last), mean over
        layers."""
        layers = self.retained[at] if self.retained else ()
        held: dict[int, float] = {}
        for starts in layers:
            for start in starts:
                step = self.source_step(start)
                held[step] = held.get(step, 0.0) + 1.0 / len(layers)
        return dict(sorted(held.items()))

    def cue_held(self, cue_step: int, *, at: int = -1) -> float:
        """Fraction of layers holding at least one chunk from control step ``cue_step`` after policy step ``at``
        (default: the last). A cue step no policy step saw (it stepped before and after) is held by none."""
        layers = self.retained[at] if self.retained else ()
        if not layers:
            return 0.0
        return sum(any(self.source_step(s) == cue_step for s in starts) for starts in layers) / len(layers)


def format_steps(steps: Sequence[int]) -> str:
    """Steps as runs of consecutive ones, e.g. ``0-3, 6-9`` or ``27, 45, 63``."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def describe_sources(held: dict[int, float], cue_steps: Sequence[int] = ()) -> str:
    """One line: runs of consecutive source steps with the chunks held from them, cue steps flagged,
    e.g. ``steps 0-5 (cue): 3.5 chunks; steps 40-47: 8.0 chunks``."""
    if not held:
        return "no chunks held"
    cues, runs, steps = set(cue_steps), [], sorted(held)
    for step in steps:
        if runs and step == runs[-1][1] + 1 and (step in cues) == (runs[-1][0] in cues):
            runs[-1][1] = step
        else:
            runs.append([step, step])
    parts = []
    for first, last in runs:
        chunks = sum(held[s] for s in range(first, last + 1) if s in held)
        span = f"step {first}" if first == last else f"steps {first}-{last}"
        parts.append(f"{span}{' (cue)' if first in cues else ''}: {chunks:.1f} chunks")
    return "; ".join(parts)


def plot_retention(trace: RetentionTrace, path: str | Path, *, cue_steps: Sequence[int] = (), title: str = "") -> Path | None:
    """Write the retention picture (PNG); ``None`` when matplotlib is missing or nothing was recorded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no retention picture")
        return None
    if not trace.steps:
        return None
    grid = trace.held_by_step()
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    image = ax.imshow(grid, origin="lower", aspect="auto", cmap="Blues", interpolation="nearest",
                      extent=(-0.5, trace.steps - 0.5, -0.5, trace.steps - 0.5))  # fmt: skip
    fig.colorbar(image, ax=ax, label="chunks held from that step (mean over layers)")
    for i, cue in enumerate(cue_steps):
        held = trace.cue_held(cue)
        ax.axhline(cue, color="tab:red", linestyle="--", linewidth=1.2,
                   label=f"cue step {cue}: held by {held:.0%} of layers at the end" if i < 4 else None)  # fmt: skip
    ax.plot([-0.5, trace.steps - 0.5], [-0.5, trace.steps - 0.5], color="0.6", linewidth=0.8, label="now (raw window)")
    ax.set(xlabel="control step", ylabel="step the retained chunk came from", title=title or "what the gate kept",
           xlim=(-0.5, trace.steps - 0.5), ylim=(-0.5, trace.steps - 0.5))  # fmt: skip
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_episodes(results, directory: str | Path, *, cue_steps: Sequence[int] | None = None) -> list[Path]:
    """One picture per traced ``EpisodeResult``: ``directory/<task>-seed<seed>.png``. Cue steps: ``cue_steps``
    if given, else what the task reported (``EpisodeResult.cue_steps``), else none."""
    paths = []
    for r in results:
        if r.retention is None:
            continue
        cues = list(cue_steps) if cue_steps is not None else (r.cue_steps or [])
        outcome = "success" if r.success else "failure"
        title = f"{r.task}, seed {r.seed}: {outcome} after {r.steps} steps"
        path = plot_retention(r.retention, Path(directory) / f"{r.task}-seed{r.seed}.png", cue_steps=cues, title=title)
        if path is not None:
            paths.append(path)
    return paths
