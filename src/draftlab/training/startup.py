"""Where `draftlab train`'s time to its first step goes, phase by phase, so that a slower start-up
names the phase that grew.

The launcher marks the end of each of its phases (`Clock.mark`); rank 0 notes when its process
started, when its imports were done, when speculators was loaded and when it called the trainer
(`rank_marks`, in rank0-done.json); step 0's own record (profile/rank0.jsonl) gives when the first
step started and ended. `breakdown` turns them into consecutive spans, in seconds, whose sum is
the time from the launcher's process start to the end of step 0 (train.json `startup`, MLflow
`startup/*`):

    launcher_process   the interpreter, the CLI's imports, params (process start to the stage's call)
    <launcher phases>  preflight, plan, folder, mlflow_run (MLflow's import, its store, the run),
                       run_params (params, tags, datasets), rank_plan, vocab, source (online: draftlab's
                       vLLM server started and healthy; a store: nothing), command (stages/train.py)
    torchrun           torchrun's start to rank 0's process start (its imports, the rendezvous)
    rank_imports       rank 0's interpreter and the modules it imports before main()
    rank_speculators   `import speculators` (its models, transformers): the bare trainer pays it too
    rank_observers     draftlab's observers in the rank (sample records, the MLflow tracker)
    trainer_setup      speculators' trainer to the start of step 0 (model, optimizer, loaders)
    first_step         step 0 itself (its step_ms: the first batch's fetch included)

A new run's MLflow work (mlflow_run, run_params) and the launcher's observers (MLflow's system
metrics, the telemetry sampler) run after torchrun is started, beside the ranks' own start: they
are `beside/<phase>`, not in the sum (a rank waits for the run only if it gets there first:
that wait is in its rank_observers). A resumed folder's run is opened before, in the sum.

`benchmarks/train_overhead.py` records the same rank marks for the bare trainer and prints both.
"""

from __future__ import annotations

import time

LAUNCHER_PROCESS = "launcher_process"
RANK_PHASES = ("torchrun", "rank_imports", "rank_speculators", "rank_observers", "trainer_setup", "first_step")


BESIDE = "beside/"  # a launcher phase after torchrun's start: beside the ranks', not in the sum


class Clock:
    """The launcher's phases: `mark(name)` ends the phase that began at the previous mark; after
    `spawned()`, as `beside/<name>`."""

    def __init__(self, process_start: float, called_at: float | None = None):
        self.process_start = process_start
        self.last = time.time() if called_at is None else called_at
        self.phases: dict[str, float] = {LAUNCHER_PROCESS: max(self.last - process_start, 0.0)}
        self.spawned_at: float | None = None

    def mark(self, name: str) -> None:
        now = time.time()
        if self.spawned_at is not None:
            name = BESIDE + name
        self.phases[name] = self.phases.get(name, 0.0) + (now - self.last)
        self.last = now

    def spawned(self) -> None:
        """torchrun was started just now: what follows is the ranks' (and the launcher's, beside them)."""
        self.mark("command")
        self.spawned_at = self.last


def process_start() -> float:
    """This process's start on time.time()'s clock, to the kernel's tick (10 ms): its start in ticks
    after boot (/proc/self/stat) against the time since boot now (CLOCK_BOOTTIME). psutil's
    create_time() adds those ticks to the boot time that /proc/stat gives in whole seconds, so it
    is up to a second early: that second showed in `launcher_process` and `rank_imports` (and as a
    negative `torchrun`) on every run of a host booted at 0.9 s past a whole second."""
    import os

    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux: the OS's record as psutil has it
        import psutil

        return psutil.Process().create_time()


def rank_marks(main_at: float, speculators_at: float, trainer_at: float) -> dict[str, float]:
    """What a rank notes of its own start (absolute times): process start, main() entered, speculators
    loaded, the trainer called."""
    return {"process_start": process_start(), "main_at": main_at, "speculators_at": speculators_at,
            "trainer_at": trainer_at}


def rank_spans(marks: dict[str, float], first_step_end: float, first_step_s: float,
               launched_at: float | None) -> dict[str, float]:
    """A rank's phases (seconds) from its marks and step 0's record; `launched_at`: when its
    torchrun was started (None: the rank's own process start is the origin)."""
    step0_start = first_step_end - first_step_s
    spans = {}
    if launched_at is not None:
        spans["torchrun"] = marks["process_start"] - launched_at
    spans.update(rank_imports=marks["main_at"] - marks["process_start"],
                 rank_speculators=marks["speculators_at"] - marks["main_at"],
                 rank_observers=marks["trainer_at"] - marks["speculators_at"],
                 trainer_setup=step0_start - marks["trainer_at"],
                 first_step=first_step_s)
    return {k: round(v, 3) for k, v in spans.items()}


def breakdown(clock: Clock, marks: dict[str, float] | None, step0: dict | None) -> dict[str, float] | None:
    """The time to the first step by phase, and its total (`total_s`); None when rank 0 left no
    marks or no step 0 (a resumed run that had nothing left, an older rank)."""
    if not marks or not step0 or clock.spawned_at is None:
        return None
    out = {k: round(v, 3) for k, v in clock.phases.items()}
    out.update(rank_spans(marks, step0["t"], step0["step_ms"] / 1000, clock.spawned_at))
    out["total_s"] = round(step0["t"] - clock.process_start, 3)
    return out


def first_step_record(records: list[dict], after: float | None = None, rank: int = 0) -> dict | None:
    """The earliest step record of `rank` (telemetry.read_step_records' lines) that ended after
    `after` (a resumed folder holds the previous launches' records too)."""
    mine = [r for r in records if r.get("rank") == rank and r.get("step_ms") is not None and "t" in r
            and (after is None or r["t"] > after)]
    return min(mine, key=lambda r: r["t"]) if mine else None


def line(phases: dict[str, float]) -> str:
    """One line: every phase in seconds, largest first, and the total; then the launcher's beside
    the ranks' start."""
    parts = sorted(((k, v) for k, v in phases.items() if k != "total_s" and not k.startswith(BESIDE)),
                   key=lambda kv: -kv[1])
    beside = sorted(((k[len(BESIDE):], v) for k, v in phases.items() if k.startswith(BESIDE)), key=lambda kv: -kv[1])
    text = f"{phases['total_s']:.1f} s to step 0: " + ", ".join(f"{k} {v:.1f}" for k, v in parts)
    return text + ("; beside the ranks' start: " + ", ".join(f"{k} {v:.1f}" for k, v in beside) if beside else "")


def in_sum(phases: dict[str, float]) -> float:
    """The phases that add up to `total_s` (not the launcher's beside the ranks')."""
    return sum(v for k, v in phases.items() if k != "total_s" and not k.startswith(BESIDE))
