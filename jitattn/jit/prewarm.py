"""Build many specializations ahead of time, in parallel worker processes."""
from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
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


def _build_one(spec: KernelSpec, force: bool) -> Outcome:
    from jitattn.jit import loader

    start, pulls = time.perf_counter(), loader.PULL_COUNT
    try:
        _, compiled = loader.build_spec(spec, force=force)  # a build is also published to the fleet tier
    except Exception as exc:  # reported per spec; the run goes on with the others
        return Outcome(spec, "failed", time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    status = "built" if compiled else "pulled" if loader.PULL_COUNT > pulls else "cached"
    return Outcome(spec, status, time.perf_counter() - start)


def prewarm(specs: list[KernelSpec], jobs: int, force: bool = False, on_done=None) -> list[Outcome]:
    """Build every spec (skipping cached ones unless force); calls on_done(outcome) as each ends."""
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
    built = _build_all(specs_to_build, jobs, force, on_done) if specs_to_build else []
    return sorted(outcomes + built, key=lambda o: order[o.spec])


def _build_all(specs: list[KernelSpec], jobs: int, force: bool, on_done) -> list[Outcome]:
    outcomes: list[Outcome] = []
    if jobs <= 1 or len(specs) <= 1:
        for spec in specs:
            outcomes.append(_build_one(spec, force))
            if on_done:
                on_done(outcomes[-1])
        return outcomes
    # Each worker builds one module at a time; give each an even share of the cores for ninja.
    os.environ["JITATTN_BUILD_JOBS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    context = multiprocessing.get_context("spawn")  # no forked CUDA or lock state
    with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        pending = {pool.submit(_build_one, spec, force): spec for spec in specs}
        for done in futures.as_completed(pending):
            try:
                outcome = done.result()
            except Exception as exc:  # a worker died (killed, out of memory)
                outcome = Outcome(pending[done], "failed", 0.0, f"worker died: {exc}")
            outcomes.append(outcome)
            if on_done:
                on_done(outcome)
    return outcomes
