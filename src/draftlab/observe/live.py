"""The bottleneck verdict while a training runs: every `window_s` the launcher's telemetry samples
and the ranks' step records of the last window are classified (draftlab.observe.bottleneck),
as `conclude` does for the whole run at its end.

Each window's verdict goes to MLflow as it is computed (tag `draftlab.bottleneck.window`, metrics
`bottleneck/<figure>` at the window's last step) and to `<run>/bottleneck-live.json` (for
`draftlab status`). The first window after the convergence watch's first trend check prints the
go/no-go line (at the first trend check, if that comes after the first window):

    train: 2% — learning (loss −18% since warmup), compute-bound, ETA 34.6 h (33.9–35.2)

A daemon thread at the lowest priority (threads.yield_cpu); it reads only the new lines of the
step records each window. The end-of-run verdict (`conclude`) is unchanged.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from pathlib import Path

from draftlab.rundir import RunDir

TAG = "draftlab.bottleneck.window"
FIGURES = ("data_wait_frac", "step_ms", "disk_read_mb_s", "disk_busy_pct", "cpu_busy_pct", "cpu_iowait_pct",
           "comm_frac", "gpu_util_pct", "gpu_power_frac")


def _hours(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def go_no_go(progress, label: str) -> str:
    """`train: 2% — learning (loss −18% since warmup), compute-bound, ETA 34.6 h (33.9–35.2)`."""
    pct = 100.0 * (progress.step + 1) / progress.total_steps if progress.total_steps else 0.0
    change = (progress.trend or {}).get("overall_change")
    trend = progress.convergence + ("" if change is None else f" (loss {change * 100:+.0f}% since warmup)".replace("-", "−"))
    eta = f"ETA {_hours(progress.eta_s)}"
    if progress.eta_p10_s is not None and progress.eta_p90_s is not None:
        lo, hi = _hours(progress.eta_p10_s), _hours(progress.eta_p90_s)
        unit = lo.split()[-1]
        eta += f" ({lo.rsplit(' ', 1)[0]}–{hi})" if hi.endswith(unit) else f" ({lo}–{hi})"
    return f"train: {pct:.0f}% — {trend}, {label}, {eta}"


class _Tail:
    """New complete lines of the ranks' profile files since the last read."""

    def __init__(self, run_dir: Path):
        self.rd, self.offsets = RunDir(run_dir), {}

    def read(self) -> list[dict]:
        out = []
        for path in self.rd.profile_files():
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written waits for the next read
            self.offsets[path] = self.offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out


class LiveVerdict:
    SAY_POLL_S = 2.0  # how often, once a window has a verdict, progress.json is read for the first trend

    def __init__(self, sampler, run_dir: Path, tracker, *, window_s: float = 60.0, console=None,
                 device: str | None = None, wait=None):
        self.sampler, self.run_dir, self.tracker, self.window_s = sampler, Path(run_dir), tracker, window_s
        self.device = device  # "cuda", "cpu": what trains (the verdict names only what was measured there)
        self.wait = wait  # store.hidden_states.DataWait: what the source's loaders wait on (None: a store)
        self.console = console
        self.tail = _Tail(run_dir)
        self.taken = 0  # samples already in a window
        self.said = False
        self.windows: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LiveVerdict:
        self._thread = threading.Thread(target=self._run, name="draftlab-live-verdict", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        from draftlab.threads import yield_cpu

        yield_cpu()
        next_window = time.monotonic() + self.window_s
        while not self._stop.wait(min(self.SAY_POLL_S, self.window_s)):
            try:
                if time.monotonic() >= next_window:
                    next_window += self.window_s
                    self.window()
                if self.windows and not self.said:  # the trend may be judged after the first window
                    self._say(self.windows[-1]["label"])
            except Exception:  # noqa: BLE001 — the verdict must never stop the run it watches
                continue

    def window(self) -> dict | None:
        """Classify what arrived since the last window; None when nothing trained in it."""
        from draftlab.observe.bottleneck import build_windows, classify
        from draftlab.util import write_json_atomic

        samples = self.sampler.samples[self.taken:]
        self.taken += len(samples)
        steps = self.tail.read()
        if not steps:
            return None
        built = build_windows(samples, steps, window_s=1e12, device=self.device)
        if not built:
            return None
        w = built[0]
        v = classify(w, self.wait)
        rec = {"label": v.label, "evidence": v.evidence, "remedy": v.remedy, "t_end": time.time(),
               "window": f"last {self.window_s:.0f} s", "last_step": w.last_step,
               "figures": {k: getattr(w, k) for k in FIGURES if getattr(w, k) is not None}}
        self.windows.append({k: rec[k] for k in ("label", "t_end", "last_step")})
        write_json_atomic(RunDir(self.run_dir).live_verdict_path, {**rec, "history": self.windows[-50:], "detail": asdict(w)})
        self.tracker.set_tags({TAG: v.label})
        if rec["figures"] and w.last_step is not None:
            self.tracker.log_metrics({f"bottleneck/{k}": float(x) for k, x in rec["figures"].items()}, step=w.last_step)
        return rec

    def _say(self, label: str) -> None:
        if self.said or self.console is None:
            return
        progress = RunDir(self.run_dir).progress.peek()
        if progress is None or progress.convergence in ("warming up",):
            return
        self.said = True
        self.console.print(go_no_go(progress, label), soft_wrap=True)
