"""Print a model's card before running it: parameters, training FLOPs per token, memory per device under
each parallel strategy, and whether the run fits its devices.

    python scripts/model_card.py model=gpt3 pos=rope activation=swiglu
    python scripts/model_card.py model=gpt2-xl --devices 8 --device-memory 80 --precision bf16-mixed
    python scripts/model_card.py model=gpt3-6.7b strategy=fsdp trainer.devices=64 data.batch_size=1

Arguments of the form key=value are Hydra overrides of conf/train.yaml, exactly as for train.py; the options
below override what the composed config says (strategy, trainer.devices x trainer.num_nodes,
trainer.precision, data.batch_size, the model's context).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gptlab import planning  # noqa: E402
from gptlab.api import build_model_config  # noqa: E402
from gptlab.cli import ArgumentParser, unknown_choice, unknown_key  # noqa: E402
from gptlab.errors import ConfigError  # noqa: E402
from gptlab.model.head_loss import HeadLoss  # noqa: E402
from gptlab.parallel import choose_precision  # noqa: E402
from gptlab.preflight import training_device_type  # noqa: E402
from gptlab.registry import import_plugins  # noqa: E402


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt3 activation=swiglu")
    parser.add_argument("--devices", type=int, help="data-parallel devices in all (default: the config's)")
    parser.add_argument("--device-memory", type=float, help="GiB per device (default: this machine's device)")
    parser.add_argument(
        "--precision", help="32-true, bf16-mixed, 16-mixed, bf16-true... (default: the config's)"
    )
    parser.add_argument(
        "--micro-batch", type=int, help="sequences per device per step (default: data.batch_size)"
    )
    parser.add_argument("--context", type=int, help="tokens per sequence (default: model.block_size)")
    parser.add_argument(
        "--strategy", help="a strategy= choice: ddp, fsdp, deepspeed_stage_3... (default: the config's)"
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each block in the backward pass"
    )
    parser.add_argument("--short", action="store_true", help="the short form printed at training start")
    args = parser.parse_intermixed_args(argv)
    return args, args.overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
    except HydraException as err:  # a mistyped choice or key: the closest one, as train.py names it
        print(f"Error: {unknown_choice(err) or unknown_key(err) or err}", file=sys.stderr)
        return 2
    try:
        import_plugins(cfg.get("plugins"))
        config = build_model_config(cfg)
        # the terms the loss adds (z-loss, softcap); whether its kernel runs here is the run's check
        loss = HeadLoss(**OmegaConf.to_container(cfg.loss, resolve=True))
    except (ConfigError, ValueError) as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    devices = args.devices
    if devices is None:
        per_node = trainer.get("devices", 1)
        devices = (per_node if isinstance(per_node, int) and per_node > 0 else 1) * int(
            trainer.get("num_nodes", 1)
        )
    # As a run would choose: fp32 on CPU, bf16 mixed on GPUs that have it.
    precision = str(choose_precision(args.precision or trainer.get("precision"), trainer.get("accelerator")))
    strategy = args.strategy or OmegaConf.to_container(cfg.strategy, resolve=True)
    micro_batch = args.micro_batch or int(cfg.data.get("batch_size", 1))
    if args.device_memory:
        memory, device = args.device_memory * planning.GiB, f"{args.device_memory:g} GiB per device (given)"
    else:
        memory, device = planning.device_memory_bytes(trainer.get("accelerator"))
    try:
        plan = planning.TrainingPlan(
            strategy=strategy,
            n_devices=devices,
            precision=precision,
            micro_batch=micro_batch,
            context=args.context,
            activation_checkpointing=args.activation_checkpointing
            or bool(cfg.get("activation_checkpointing")),
            # the output layer and loss the run would take on this machine's device
            head=planning.HeadPlan.of(loss, training_device_type(trainer), precision),
        )
        text = planning.model_card(
            config, plan, device_memory=memory, device_name=device, short=args.short, loss=loss
        )
    except ConfigError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
