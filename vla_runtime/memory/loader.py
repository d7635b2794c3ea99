"""Layer-balanced loading of stored KV into a running prefill (KEEP §4.3).

The prefill tells the loader, as soon as it knows, that segments ``ms`` need their stored KV from layer
``l`` on (they are no longer recomputed; the selected set only shrinks, so it is needed for every deeper
layer too). The segments that drop out together form one job per layer -- one transfer of their KV of
that layer, not one per segment (on a throttled link a job per ``(segment, layer)`` woke the loader
thread about a thousand times per KEEP prefill, each wake-up competing with the compute thread for the
interpreter: 844 against 710 ms per prefill, README "KEEP memory"). The loader runs those ``(ms, layer)`` jobs lowest layer first on its own thread:

* ``balanced``: every known job is runnable at once, so while layer ``i`` computes the loader first
  finishes layer ``i+1`` and then, instead of idling, preloads deeper layers of segments that can no
  longer be recomputed -- the work moves from the load-heavy late layers to the idle early ones;
* ``next_layer``: only jobs of the next layer are runnable (the classic one-layer-ahead pipeline);
* ``serial``: no thread; each layer's jobs run on the compute thread right before the layer.

Nothing is loaded speculatively: the log of ``(segment, layer)`` loads is exactly the needed set.
On CUDA the copies run on a side stream from pinned host memory; the compute stream waits on a
per-layer event, so the host thread never blocks the GPU.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

LoadFn = Callable[[tuple[str, ...], int], int]  # (module ids, layer) -> bytes moved


class LayerLoader:
    def __init__(self, load: LoadFn, n_layers: int, schedule: str, *, device: torch.device) -> None:
        self._load = load
        self.n_layers = n_layers
        self.schedule = schedule
        self.device = device
        self.log: list[tuple[str, int]] = []  # (module, layer) in load order (a job's modules in its order)
        self.ahead: list[int] = []  # per load: its layer minus the layer computing when it finished
        self._computing = 0
        self.bytes = 0
        self.stall_s = 0.0  # time the compute thread waited for loads
        self._cv = threading.Condition()
        self._heap: list[tuple[int, int, tuple[str, ...]]] = []  # (layer, order of arrival, modules)
        self._held: dict[int, list[tuple[str, ...]]] = defaultdict(list)  # jobs not yet runnable (next_layer / serial)
        self._pending = [0] * n_layers  # jobs added and not finished, per layer
        self._seq = 0
        self._horizon = -1  # highest runnable layer
        self._error: BaseException | None = None
        self._closed = False
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready = None  # CUDA: the compute stream's work so far (the loads' destination memory may be in its use)
        if self._stream is not None:
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))
        self._events: dict[int, torch.cuda.Event] = {}
        self._thread = None
        if schedule != "serial":
            self._horizon = n_layers - 1 if schedule == "balanced" else 0
            self._thread = threading.Thread(target=self._worker, name="kv-loader", daemon=True)
            self._thread.start()

    # ---- compute-thread side --------------------------------------------------------------------
    def need(self, modules: Sequence[str], layers) -> None:
        """``modules`` need their stored KV at ``layers`` (segments dropped together: every layer from the
        drop on); one job per layer loads them all."""
        job = tuple(modules)
        if not job:
            return
        with self._cv:
            for layer in layers:
                self._pending[layer] += 1
                if layer <= self._horizon:
                    heapq.heappush(self._heap, (layer, self._seq, job))
                    self._seq += 1
                else:
                    self._held[layer].append(job)
            self._cv.notify_all()

    def begin_layer(self, layer: int) -> None:
        """The compute thread starts ``layer``: with ``next_layer``, layer + 1 becomes runnable."""
        with self._cv:
            self._computing = layer
        if self.schedule != "next_layer":
            return
        with self._cv:
            self._horizon = max(self._horizon, layer + 1)
            for lay in [x for x in self._held if x <= self._horizon]:
                for job in self._held.pop(lay):
                    heapq.heappush(self._heap, (lay, self._seq, job))
                    self._seq += 1
            self._cv.notify_all()

    def wait(self, layer: int) -> None:
        """Return once every job of ``layer`` is done (and, on CUDA, ordered before later kernels)."""
        t0 = time.perf_counter()
        if self.schedule == "serial":
            for job in self._held.pop(layer, []):
                self._finish(job, layer, *self._execute(job, layer))
            self.stall_s += time.perf_counter() - t0
            return
        with self._cv:
            while self._pending[layer] and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise RuntimeError(f"loading stored KV failed: {self._error}") from self._error
            event = self._events.get(layer)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self.stall_s += time.perf_counter() - t0

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()  # after an error nothing queued is needed any more
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ---- loader-thread side ---------------------------------------------------------------------
    def _execute(self, job: tuple[str, ...], layer: int) -> tuple[int, "torch.cuda.Event | None"]:
        if self._stream is None:
            return self._load(job, layer), None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._ready)  # without it a copy can land before a pending write to its buffer
            nbytes = self._load(job, layer)
            event = torch.cuda.Event()
            event.record(self._stream)
        return nbytes, event

    def _finish(self, job: tuple[str, ...], layer: int, nbytes: int, event) -> None:
        with self._cv:
            if event is not None:
                self._events[layer] = event  # a layer's jobs run in order on one stream: the last event covers them
            self.log.extend((module, layer) for module in job)
            self.ahead.extend([layer - self._computing] * len(job))
            self.bytes += nbytes
            self._pending[layer] -= 1
            self._cv.notify_all()

    @torch.no_grad()
    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                layer, _, job = heapq.heappop(self._heap)
            try:
                result = self._execute(job, layer)
            except Exception as e:  # handed to the compute thread, which re-raises it in wait()
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                return
            self._finish(job, layer, *result)
