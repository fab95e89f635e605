"""Per-step metrics on rank 0: `metrics.jsonl` (one object per optimizer step), the experiment trackers of
--report_to (tracking.py), and on the terminal (--progress) a line per step, under a tqdm bar when stderr is a
terminal. Redirected to a file, the bar's carriage-return redraws would sit in front of each line, so `auto` prints
the lines alone there: every one starts with `step`.

Throughput, per optimizer step of the whole run (every DP group, every micro-step):

    num_positions         sequence positions processed: --seq_len x micro batch x grad_accum x DP size, padding
                          included (the work done)
    num_tokens            trained tokens: positions whose label is a target (the loss's denominator)
    tokens_per_s          num_positions / step_time_s
    trained_tokens_per_s  num_tokens / step_time_s
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from typing import Callable, Optional

import torch

KEYS = ("step", "loss", "grad_norm", "num_tokens", "num_positions", "conversations", "tokens_per_s",
        "trained_tokens_per_s", "step_time_s", "peak_mem_gib", "lr")


def progress_mode(setting: str, stream=None) -> str:
    """--progress as it applies here: auto is a bar on a terminal, else lines."""
    if setting != "auto":
        return setting
    stream = sys.stderr if stream is None else stream
    return "bar" if getattr(stream, "isatty", lambda: False)() else "lines"


def step_line(record: dict) -> str:
    return (f"step {record['step']:>5} | loss {record['loss']:.4f} | grad_norm {record['grad_norm']:.3f} | tokens "
            f"{record['num_tokens']} of {record['num_positions']} | {record['tokens_per_s']:.0f} tok/s "
            f"({record['trained_tokens_per_s']:.0f} trained) | {record['step_time_s']:.2f} s | peak "
            f"{record['peak_mem_gib']:.2f} GiB | lr {record['lr']:.2e}")


def progress_bar(total: int, initial: int):
    from tqdm.auto import tqdm

    class Bar(tqdm):
        monitor_interval = 0  # no monitor thread: it would outlive the run in a process that goes on
    return Bar(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def host_memory_bytes() -> int:
    """Physical memory of this host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_peak_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated by this process; on CPU, the host peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_peak_gib()


def records_up_to(path: str, step: int) -> tuple[list[str], int]:
    """The lines of metrics file `path` up to `step`, and the last step the file holds (a run stopped after its
    last checkpoint logged steps past it). A crash can leave the last line half written: it is dropped with a
    warning (as is any other line that is not a JSON record), so that it never blocks a resume."""
    with open(path) as f:
        lines = f.readlines()
    kept, last = [], 0
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            step_of_line = record["step"]
        except (ValueError, TypeError, KeyError):
            where = "partial last line" if number == len(lines) else f"unreadable line {number}"
            print(f"warning: {path}: dropped its {where} ({line.strip()[:60]!r})", file=sys.stderr, flush=True)
            continue
        last = max(last, step_of_line)
        if step_of_line <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept, last


def _pairs(record: dict) -> str:
    """Preference training's rewards on the metrics line (train/preference/pairs.py), nothing for SFT."""
    if "rewards/margins" not in record:
        return ""
    return (f" | rewards chosen {record['rewards/chosen']:.3f} rejected {record['rewards/rejected']:.3f} margin "
            f"{record['rewards/margins']:.3f} accuracy {record['rewards/accuracies']:.2f}")


class MetricsLogger:
    def __init__(self, output_dir: str, total_steps: int, enabled: bool, trackers=None, log_every: int = 1,
                 start_step: int = 0, progress: str = "auto"):
        """`trackers`: the run's started tracking.Trackers (or None); the logger sends them every record and closes
        them with itself; resumed (`start_step`), it tells them where the run goes on and which later steps the
        stopped run had logged (Trackers.continue_after). `progress`: --progress (progress_mode)."""
        self.enabled, self.log_every, self.progress = enabled, log_every, progress_mode(progress)
        self.bar = self.file = None
        self.trackers = trackers
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "metrics.jsonl")
        logged = start_step
        if start_step and os.path.exists(path):  # resuming: keep the steps before the checkpoint, drop later ones
            kept, logged = records_up_to(path, start_step)
            with open(path, "w") as f:
                f.writelines(kept)
        if start_step and trackers is not None:
            trackers.continue_after(start_step, logged)
        self.file = open(path, "a" if start_step else "w")
        if self.progress == "bar":
            self.bar = progress_bar(total_steps, start_step)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def log(self, record: dict, extra: Optional[dict] = None) -> None:
        if not self.enabled:
            return
        record = {k: record[k] for k in KEYS} | (extra or {})
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.trackers is not None:
            self.trackers.log({k: v for k, v in record.items() if not k.startswith("eval_")}, record["step"])
            evaluation = {k.removeprefix("eval_"): v for k, v in record.items()
                          if k.startswith("eval_") and v is not None}  # no loss where nothing was a target
            if evaluation:
                self.trackers.log(evaluation, record["step"], prefix="eval")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if self.progress == "none":
            return
        if record["step"] % self.log_every == 0 or record["step"] == 1:
            self.write(step_line(record) + _pairs(record))
        if "eval_loss" in record:
            loss = "none (no target)" if record["eval_loss"] is None else f"{record['eval_loss']:.4f}"
            evaluation = {k.removeprefix("eval_"): v for k, v in record.items() if k.startswith("eval_")}
            samples = f"{record['eval_samples']} samples" if "eval_pairs" not in record else \
                f"{record['eval_pairs']} pairs in {record['eval_samples']} rows"
            self.write(f"step {record['step']:>5} | eval loss {loss} over {record['eval_tokens']:,} tokens of "
                       f"{samples}" + _pairs(evaluation))

    def write(self, message: str) -> None:
        """A line on the terminal (above the bar, if there is one)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.trackers is not None:
            self.trackers.close()


FIRST_STEP_TICK_S = 60.0


class FirstStepTicker:
    """A line every `every` seconds while the process's first step runs (`with` around it), from a thread: that step
    compiles and autotunes kernels for minutes (219 s for Qwen3.5-9B at 64k on a fresh H100) and prints nothing of
    its own, so the terminal shows it is alive. The lines do not start with `step`, which the step lines do."""

    def __init__(self, write: Callable[[str], None], every: float = FIRST_STEP_TICK_S,
                 clock: Callable[[], float] = time.monotonic):
        self._write, self._every, self._clock = write, every, clock
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _tick(self, start: float) -> None:
        while not self._stop.wait(self._every):
            self._write(f"first step: {self._clock() - start:.0f} s so far (compiling and autotuning once; later "
                        f"steps reuse it)")

    def __enter__(self) -> "FirstStepTicker":
        self._thread = threading.Thread(target=self._tick, args=(self._clock(),), name="first-step-ticker",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
