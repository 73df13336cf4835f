"""Build many specializations ahead of time, in parallel worker processes."""
from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass

from jitattn.jit.spec import KernelSpec

# One build peaks at roughly this much memory (nvcc + cicc + ptxas on a decode module).
MEMORY_PER_BUILD = 1.5 * 2**30


@dataclass
class Outcome:
    spec: KernelSpec
    status: str  # "built" | "cached" | "pulled" (from the fleet tier) | "failed"
    seconds: float
    detail: str = ""


def default_jobs() -> int:
    """Parallel builds: bounded by cores and by available memory."""
    cores = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
        by_memory = max(1, int(available // MEMORY_PER_BUILD))
    except (OSError, KeyError, ValueError):
        by_memory = cores
    return max(1, min(cores, by_memory))


def build_one(spec: KernelSpec, force: bool) -> Outcome:
    """Build (or find) one spec in this process and say how it went: a prewarm worker's whole job,
    never raising for the spec's own failure."""
    from jitattn.jit import loader

    start, pulls = time.perf_counter(), loader.PULL_COUNT
    try:
        _, compiled = loader.build_spec(spec, force=force)  # a build is also published to the fleet tier
    except Exception as exc:  # reported per spec; the run goes on with the others
        return Outcome(spec, "failed", time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    status = "built" if compiled else "pulled" if loader.PULL_COUNT > pulls else "cached"
    return Outcome(spec, status, time.perf_counter() - start)


def prewarm(specs: list[KernelSpec], jobs: int, force: bool = False, on_done=None, on_start=None) -> list[Outcome]:
    """Build every spec (skipping cached ones unless force); calls on_start(spec) as a build
    starts and on_done(outcome) as each spec is settled (ConsoleProgress prints both)."""
    from jitattn.jit.loader import is_cached

    outcomes: list[Outcome] = []
    if not force:  # cached specs are settled here, cheaply: no worker process for them
        missing = []
        for spec in specs:
            start = time.perf_counter()
            try:
                cached = is_cached(spec)
            except ValueError as exc:  # e.g. a wgmma spec for a target without sm_90
                outcomes.append(Outcome(spec, "failed", time.perf_counter() - start, f"{type(exc).__name__}: {exc}"))
                if on_done:
                    on_done(outcomes[-1])
                continue
            if cached:
                outcomes.append(Outcome(spec, "cached", time.perf_counter() - start))
                if on_done:
                    on_done(outcomes[-1])
            else:
                missing.append(spec)
        specs_to_build = missing
    else:
        specs_to_build = specs
    order = {spec: i for i, spec in enumerate(specs)}
    built = _build_all(specs_to_build, jobs, force, on_done, on_start) if specs_to_build else []
    return sorted(outcomes + built, key=lambda o: order[o.spec])


def _build_all(specs: list[KernelSpec], jobs: int, force: bool, on_done, on_start=None) -> list[Outcome]:
    outcomes: list[Outcome] = []
    if jobs <= 1 or len(specs) <= 1:
        for spec in specs:
            if on_start:
                on_start(spec)
            outcomes.append(build_one(spec, force))
            if on_done:
                on_done(outcomes[-1])
        return outcomes
    # Each worker builds one module at a time; give each an even share of the cores for ninja.
    os.environ["JITATTN_BUILD_JOBS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    context = multiprocessing.get_context("spawn")  # no forked CUDA or lock state
    queue = list(specs)
    with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        pending: dict = {}
        while queue or pending:
            # At most `jobs` submitted at a time: a build then starts when it is submitted, so
            # on_start reports it when it really begins.
            while queue and len(pending) < jobs:
                spec = queue.pop(0)
                if on_start:
                    on_start(spec)
                pending[pool.submit(build_one, spec, force)] = spec
            done, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
            for future in done:
                spec = pending.pop(future)
                try:
                    outcome = future.result()
                except Exception as exc:  # a worker died (killed, out of memory)
                    outcome = Outcome(spec, "failed", 0.0, f"worker died: {exc}")
                outcomes.append(outcome)
                if on_done:
                    on_done(outcome)
    return outcomes


class ConsoleProgress:
    """What a prewarm prints as it goes: a line as each build starts, a line about every `every`
    seconds for each build still running, and as each spec settles a bar with the totals so far
    and an ETA (mean build time so far, over the builds left, `jobs` at a time): a long build
    must not look like a hang (issue 45)."""

    def __init__(self, total: int, jobs: int, out=None, every: float = 10.0, clock=time.monotonic):
        self.total, self.jobs, self.every, self.clock = total, max(1, jobs), every, clock
        self.out = out if out is not None else sys.stdout
        self.running: dict[KernelSpec, float] = {}
        self.done = 0
        self.build_seconds: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> "ConsoleProgress":
        self._ticker = threading.Thread(target=self._tick_loop, name="jitattn-prewarm-progress", daemon=True)
        self._ticker.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def started(self, spec: KernelSpec) -> None:
        with self._lock:
            self.running[spec] = self.clock()
            self._print(f"building {spec.name} ({len(self.running)} running, {self.done}/{self.total} done)")

    def tick(self) -> None:
        """One line per build running for `every` seconds or more."""
        with self._lock:
            now = self.clock()
            for spec, since in self.running.items():
                if now - since >= self.every:
                    self._print(f"  still building {spec.name}: {now - since:.0f} s")

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.every):
            self.tick()

    def eta(self) -> float | None:
        """Seconds left by the mean build so far (None before the first build ends)."""
        if not self.build_seconds:
            return None
        left = self.total - self.done
        mean = sum(self.build_seconds) / len(self.build_seconds)
        return -(-left // self.jobs) * mean

    def finished(self, outcome: Outcome) -> None:
        with self._lock:
            self.running.pop(outcome.spec, None)
            self.done += 1
            if outcome.status in ("built", "failed"):
                self.build_seconds.append(outcome.seconds)
            width = 30
            filled = width * self.done // max(1, self.total)
            eta = self.eta()
            left = "" if self.done == self.total else f"  ETA {eta:.0f} s" if eta is not None else "  ETA after the first build"
            self._print(f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                        f"{outcome.status:7s} {outcome.seconds:6.1f}s {outcome.spec.name}{left}")
