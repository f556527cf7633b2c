"""`python tests/spiking_train.py <overrides>`: train.py with a synthetic loss spike, for the spike detector's
test. At optimizer step GPTLAB_TEST_SPIKE_AT_STEP (1-based) the loss that is backpropagated is multiplied by
1e4 (the logged loss is not), and the model's weights after that step and the one before are saved in the run
directory as weights_step<k>.pt (k: steps done)."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import hydra  # noqa: E402
import torch  # noqa: E402

from gptlab.runs.resume import register_resolvers  # noqa: E402
from gptlab.training.module import GPTLitModule  # noqa: E402

register_resolvers()
AT = int(os.environ["GPTLAB_TEST_SPIKE_AT_STEP"])
original_training_step = GPTLitModule.training_step


def training_step(self, batch, batch_idx):
    loss = original_training_step(self, batch, batch_idx)
    return loss * 1e4 if self.global_step + 1 == AT else loss


def on_train_batch_end(self, outputs, batch, batch_idx):
    if self.global_step in (AT - 1, AT):
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        torch.save(state, Path(self.trainer.default_root_dir) / f"weights_step{self.global_step}.pt")


GPTLitModule.training_step = training_step
GPTLitModule.on_train_batch_end = on_train_batch_end


@hydra.main(config_path=str(ROOT / "conf"), config_name="train", version_base="1.3")
def main(cfg):
    from gptlab.cli import run_task

    return run_task(cfg)


if __name__ == "__main__":
    main()
