"""Train a GPT: `python train.py model=small pos=sinusoidal activation=relu trainer.devices=1`.

Every option is a Hydra override; `python train.py --help` lists the config groups and their choices.
"""

import hydra
from omegaconf import DictConfig

from gptlab.cli import prefer_launcher_yamls, register_help_resolver, state_gptlab_version, suggest_choices
from gptlab.runs.resume import register_resolvers
from gptlab.tasks.collector import exit_without_collecting

register_resolvers()  # conf/hydra chooses the run directory through them (resume=auto)
register_help_resolver()  # `--help` (conf/hydra/help/gptlab.yaml) lists Hydra's launchers through it
prefer_launcher_yamls()  # conf/hydra/launcher/joblib.yaml, without Hydra's warning of a same-named schema
suggest_choices()  # pos=sinusiodal: "Did you mean pos=sinusoidal?"
state_gptlab_version()  # --version: gptlab's, with torch's and Lightning's for a bug report (not Hydra's alone)


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from gptlab.cli import run_task

    return run_task(cfg)


if __name__ == "__main__":
    exit_without_collecting()  # the seconds Python's collector takes at exit, after the run's last line
    main()
