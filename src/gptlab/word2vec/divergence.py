"""Whether word2vec's training loss diverged, said where the loss is shown (the log, the closing line and
result.json), without Lightning (the GPT task's spike handling, :mod:`gptlab.training.spikes`, is a Lightning
callback).

Training starts at a known loss: the output table is zero, so every score is 0 and each output row costs
ln 2 (negative sampling: ``(1 + negatives) ln 2`` a pair, 4.16 at 5 negatives). SGD lowers it from there;
a run whose logged loss is non-finite, or more than :data:`DIVERGED_FACTOR` times its loss at the start, has
made the vectors worse than untrained ones: its updates overshoot (a learning rate too large for the batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# How many times its starting loss a logged loss must reach to count as diverged: training only lowers the
# loss from the start (the untrained model's), by a nat or two; the runs that diverged on the embedded corpus
# before the per-row step bound (skip-gram, batches of 2,048 and 4,096 at lr 0.025) logged 12x to 800x it.
DIVERGED_FACTOR = 2.0


@dataclass
class DivergenceWatch:
    """The loss at the start (the first one logged, kept in checkpoints) and the first logged step whose loss
    diverged, if any."""

    start_loss: float | None = None
    diverged_step: int | None = None
    diverged_loss: float = math.nan

    def observe(self, step: int, loss: float) -> bool:
        """Note a logged loss; True when it is the first that diverged (the caller warns once)."""
        if self.start_loss is None and math.isfinite(loss):
            self.start_loss = loss
        if self.diverged_step is not None or not self.is_diverged(loss):
            return False
        self.diverged_step, self.diverged_loss = step, loss
        return True

    def is_diverged(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        return self.start_loss is not None and loss > DIVERGED_FACTOR * self.start_loss

    @property
    def diverged(self) -> bool:
        return self.diverged_step is not None

    def line(self, final_loss: float | None = None) -> str:
        """The warning, as training logs the loss (and, with ``final_loss``, at the end): the numbers that say
        so, and the fix."""
        start = f"{self.start_loss:.4g}" if self.start_loss is not None else "unknown"
        final = f" (final {final_loss:.4g})" if final_loss is not None else ""
        return (
            f"word2vec diverged: the training loss was {self.diverged_loss:.4g} per pair at step "
            f"{self.diverged_step}{final}, more than {DIVERGED_FACTOR:g}x its {start} at the start (untrained "
            "vectors): the vectors are worse than untrained ones and their scores are no result. result.json "
            "says diverged: true. Lower word2vec.lr or word2vec.batch_size."
        )

    def record(self) -> dict[str, object]:
        """result.json's ``diverged`` and, when it did, the numbers that say so."""
        if not self.diverged:
            return {"diverged": False}
        loss = self.diverged_loss if math.isfinite(self.diverged_loss) else str(self.diverged_loss)
        return {
            "diverged": True,
            "divergence": {"train/loss": loss, "step": self.diverged_step, "start_loss": self.start_loss},
        }
