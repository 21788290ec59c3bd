"""What every training run leaves behind: TensorBoard events and a metrics.json, written by rank 0 only.

    log = RunLog(run_dir, enabled=master_process)
    log.scalar("train/loss", loss, step)
    log.finish(val_accuracy=0.93, ...)
"""

import json
import os
import time
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter


class RunLog:
    def __init__(self, run_dir: str | Path, enabled: bool = True, **config):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.start = time.time()
        self.metrics = dict(config)
        self.loss_history: list[tuple[int, float]] = []
        self.writer = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # A re-run of the same cell replaces the old run instead of mixing two curves in one chart.
            for old in [*self.run_dir.glob("events.out.tfevents.*"), self.run_dir / "metrics.json"]:
                old.unlink(missing_ok=True)
            self.writer = SummaryWriter(str(self.run_dir))

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.writer:
            self.writer.add_scalar(tag, value, step)
        if tag == "train/loss":
            self.loss_history.append((step, float(value)))

    def finish(self, **results) -> dict:
        """Write metrics.json atomically (a reader never sees half a file) and close the event file."""
        self.metrics.update(results, wall_time_s=round(time.time() - self.start, 3),
                            train_loss_history=self.loss_history)
        if self.enabled:
            self.writer.close()
            tmp = self.run_dir / "metrics.json.tmp"
            tmp.write_text(json.dumps(self.metrics, indent=2))
            os.replace(tmp, self.run_dir / "metrics.json")
        return self.metrics
