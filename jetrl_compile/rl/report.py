"""Where the driver's per-step metrics go besides metrics.jsonl and metrics.png.

``--report-to tensorboard`` writes TensorBoard event files to ``--out/tensorboard`` (view them
with ``tensorboard --logdir <out>/tensorboard``): every numeric metric of a step as a scalar,
under ``train/`` (``train/reward_mean``, ``train/mismatch_kl``, ...) and the held-out accuracy of
``--eval-every`` under ``eval/accuracy``. A resumed run appends to the same folder.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import UsageValueError

REPORTS = ("none", "tensorboard")


class TensorBoardReport:
    def __init__(self, folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise UsageValueError(
                f"--report-to tensorboard needs the tensorboard package ({e}); pip install tensorboard "
                "(make venv installs it with the examples extra)"
            ) from e
        self.writer = SummaryWriter(str(folder))

    def log(self, row: dict, step: int) -> None:
        for key, value in row.items():
            if key == "step" or not isinstance(value, (int, float)):
                continue
            tag = "eval/accuracy" if key == "eval_accuracy" else f"train/{key}"
            if math.isfinite(float(value)):
                self.writer.add_scalar(tag, float(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class NoReport:
    def log(self, row: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def make_report(kind: str, out: Path):
    if kind not in REPORTS:
        raise UsageValueError(f"--report-to {kind!r}: choose one of {', '.join(REPORTS)}")
    return TensorBoardReport(out / "tensorboard") if kind == "tensorboard" else NoReport()
