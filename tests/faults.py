"""`python tests/faults.py <overrides>`: train.py with one fault injected, for the tests of what a fault on
one rank does to a distributed run. GPTLAB_TEST_FAULT chooses it (read here only, never by gptlab):

- ``nan_loss:<rank>:<n>``: the n-th training forward pass on that rank returns a NaN loss.
- ``kill_in_save:<n>``: every rank is SIGKILLed right after its shards of the n-th sharded ``last.ckpt`` are
  written, before the save completes.
- ``kill_mid_swap:<n>``: at the n-th swap of a finished sharded ``last.ckpt`` into place, the whole run (its
  process group: start it in a session of its own) is SIGKILLed between the two renames.
- ``kill_at_step:<n>:<overrides>``: the process is SIGKILLed after the n-th optimizer step of the (multirun)
  job whose overrides include every one of ``<overrides>`` (``pos=nope&seed=1``): a sweep dies in that job.
- ``raise_at_step:<n>:<overrides>``: in the same job, a RuntimeError is raised after the n-th optimizer step
  (a bug in the code that job ran): the job crashes, the sweep goes on.
- ``die_at_step:<rank>:<n>[:stop|:hang]``: that rank alone is SIGKILLed after its n-th optimizer step (as
  the kernel's out-of-memory killer ends one process of a run); the other ranks are left to notice. With
  ``stop`` it is SIGSTOPped instead: alive but stuck (a hung file system, a lost node), answering nothing.
  With ``hang`` the other ranks' main threads then wait for ever, as in an NCCL collective whose peer is
  gone (over gloo their next collective would fail at once).
- ``kill_in_background_write:<n>``: the process is SIGKILLed while its background checkpoint writer holds the
  checkpoint of step n, unwritten, once step n + 1 is trained (rank 0 writes; the other ranks, past that save,
  are left to notice).
- ``die_in_hashing:<rank>``: that rank alone is SIGKILLed as it starts hashing its share of a sharded
  checkpoint's files, after the ranks exchanged the listing: the others wait for its digests.
- ``race_start:<folder>:<n>[:hold]``: a start raced against n - 1 others: each process waits until all n
  have reached the run directory's check (a file each in ``<folder>``), so that they claim it at the same
  moment; with ``hold``, one that got through waits there until ``<folder>/go`` exists (the test writes it once
  it has seen the others refused).
- ``ctrl_c:<n>``: the process sends itself SIGINT (a Ctrl-C) after the n-th optimizer step.
- ``sigterm:<n>``: the process sends itself SIGTERM (a ``kill``) after the n-th optimizer step.
- ``ctrl_c_twice:<n>``: as ``ctrl_c``, and again in the middle of the checkpoint save that the first one asks
  for, after its bytes are written and before the file is renamed into place.
- ``hold_word2vec_evaluation``: word2vec's evaluation, once begun (the vectors written), prints
  ``word2vec evaluation under way`` and holds there (up to 300 s, then goes on) until a signal the test sends
  ends it: the signal lands in the evaluation however slowly the test reads the line.
- ``hold_eval_length:<n>``: the length study after training (``eval_length.enabled=true``) holds in the same
  way at its n-th measurement (one context of one variant; the ones before it finished), printing ``length
  study under way``; ``hold_eval_length:passkey`` holds as the passkey study begins (the length study
  finished and written), printing ``passkey study under way``.
- ``hold_after_word2vec_checkpoint``: word2vec's first checkpoint, once written, prints ``word2vec checkpoint
  written at step <n>`` and holds there (up to 300 s, then goes on): a SIGKILL the test sends lands after it,
  before the run could end, however slowly the test reads the line.
- ``hold_at_step:<n>``: after the n-th optimizer step, before the run looks for a stop signal at that step,
  rank 0 prints ``held at step <n>`` and holds there (up to 300 s, then goes on) until a signal (SIGTERM, SIGINT
  or SIGUSR1) has reached the handler in place, which runs as it would have: the run stops at step n however
  slowly the test reads the line.
- ``hold_tokenizing``: the preparation of a token cache, its temporary folder made, prints ``tokenization under
  way`` and holds there (up to 300 s, then goes on) until a signal the test sends ends it.

Lightning starts ranks > 0 by re-running this command line, so the fault is in place in every rank.
"""

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import hydra  # noqa: E402

from gptlab.cli import suggest_choices  # noqa: E402
from gptlab.runs.layout import LAST_CHECKPOINT  # noqa: E402
from gptlab.runs.resume import register_resolvers  # noqa: E402

register_resolvers()
# The tests send SIGINT as a terminal's Ctrl-C reaches a foreground command, which Python turns into a
# KeyboardInterrupt. A suite run in the background (`pytest &`, a CI script) starts its commands with SIGINT
# ignored, which Python then leaves ignored (as a background job should): put back the foreground's handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
suggest_choices()  # as train.py: gptlab reports what Hydra would (a mistyped choice, a sweep's failed jobs)
kind, *args = os.environ["GPTLAB_TEST_FAULT"].split(":")
rank = int(os.environ.get("LOCAL_RANK", "0")) + int(os.environ.get("NODE_RANK", "0"))

if kind == "nan_loss":
    from gptlab.model.gpt import GPT

    fault_rank, fault_call = int(args[0]), int(args[1])
    original_forward = GPT.forward
    calls = 0

    def forward(self, idx, targets=None, *args, **kwargs):
        global calls
        logits, loss = original_forward(self, idx, targets, *args, **kwargs)
        if self.training and loss is not None and rank == fault_rank:
            calls += 1
            if calls == fault_call:
                loss = loss * float("nan")
        return logits, loss

    GPT.forward = forward
elif kind == "kill_in_save":
    import lightning.pytorch.strategies.model_parallel as model_parallel

    fault_save = int(args[0])
    original_save = model_parallel._distributed_checkpoint_save
    saves = 0

    def save(state, path):
        global saves
        original_save(state, path)
        if LAST_CHECKPOINT in str(path):
            saves += 1
            if saves == fault_save:
                os.kill(os.getpid(), signal.SIGKILL)

    model_parallel._distributed_checkpoint_save = save
elif kind == "kill_mid_swap":
    from gptlab.parallel import checkpoint_io as atomic

    if rank == 0 and os.getpgid(0) != os.getpid():
        raise SystemExit(
            "kill_mid_swap kills its process group: start this script with start_new_session=True"
        )
    fault_swap = int(args[0])
    original_swap_in = atomic.swap_in
    swaps = 0

    def swap_in(staging, target):
        global swaps
        swaps += target.name == LAST_CHECKPOINT
        if swaps == fault_swap and target.name == LAST_CHECKPOINT:
            os.rename(target, target.parent / atomic.ASIDE.format(name=target.name))
            os.killpg(0, signal.SIGKILL)
        original_swap_in(staging, target)

    atomic.swap_in = swap_in
elif kind == "kill_at_step":
    from hydra.core.hydra_config import HydraConfig

    from gptlab.training.callbacks import ValidateAtLastStep

    fault_step, fault_overrides = int(args[0]), args[1].split("&")
    original_batch_end = ValidateAtLastStep.on_train_batch_end

    def on_train_batch_end(self, trainer, pl_module, *rest):
        if trainer.global_step == fault_step and set(fault_overrides) <= set(
            HydraConfig.get().overrides.task
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        original_batch_end(self, trainer, pl_module, *rest)

    ValidateAtLastStep.on_train_batch_end = on_train_batch_end
elif kind == "raise_at_step":
    from hydra.core.hydra_config import HydraConfig

    from gptlab.training.callbacks import ValidateAtLastStep

    fault_step, fault_overrides = int(args[0]), args[1].split("&")
    original_batch_end = ValidateAtLastStep.on_train_batch_end

    def on_train_batch_end(self, trainer, pl_module, *rest):
        if trainer.global_step == fault_step and set(fault_overrides) <= set(
            HydraConfig.get().overrides.task
        ):
            raise RuntimeError(f"a fault injected at step {fault_step}")
        original_batch_end(self, trainer, pl_module, *rest)

    ValidateAtLastStep.on_train_batch_end = on_train_batch_end
elif kind == "die_at_step":
    import threading

    from gptlab.training.callbacks import ValidateAtLastStep

    fault_rank, fault_step = int(args[0]), int(args[1])
    fault_signal = signal.SIGSTOP if args[2:] == ["stop"] else signal.SIGKILL
    original_batch_end = ValidateAtLastStep.on_train_batch_end

    def on_train_batch_end(self, trainer, pl_module, *rest):
        if trainer.global_step == fault_step and trainer.global_rank == fault_rank:
            os.kill(os.getpid(), fault_signal)
        elif trainer.global_step == fault_step and args[2:] == ["hang"]:
            threading.Event().wait()
        original_batch_end(self, trainer, pl_module, *rest)

    ValidateAtLastStep.on_train_batch_end = on_train_batch_end
elif kind == "die_in_hashing":
    from gptlab.runs import digests

    fault_rank = int(args[0])
    original_compute_shared = digests.compute_shared

    def compute_shared(checkpoint, name, this_rank, ranks, gather, before_hashing=None):
        def die_first(path):
            if this_rank == fault_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if before_hashing is not None:
                before_hashing(path)

        return original_compute_shared(checkpoint, name, this_rank, ranks, gather, die_first)

    digests.compute_shared = compute_shared
elif kind == "kill_in_background_write":
    import threading

    from gptlab.parallel.checkpoint_io import AtomicCheckpointIO
    from gptlab.training.callbacks import ValidateAtLastStep

    fault_step = int(args[0])
    original_write = AtomicCheckpointIO._write
    original_batch_end = ValidateAtLastStep.on_train_batch_end
    next_step_done = threading.Event()

    def write(self, checkpoint, target):
        # the writer thread, holding the checkpoint of that step until the ranks have trained the step after
        # it (every rank past the save's barrier), then killed before writing a byte
        in_writer = threading.current_thread() is not threading.main_thread()
        if checkpoint.get("global_step") == fault_step and in_writer:
            next_step_done.wait(timeout=600)
            os.kill(os.getpid(), signal.SIGKILL)
        original_write(self, checkpoint, target)

    def on_train_batch_end(self, trainer, pl_module, *rest):
        original_batch_end(self, trainer, pl_module, *rest)
        if trainer.global_step == fault_step + 1:
            next_step_done.set()

    AtomicCheckpointIO._write = write
    ValidateAtLastStep.on_train_batch_end = on_train_batch_end
elif kind == "race_start":
    import time

    from gptlab.runs.resume import CheckRunDirectory

    folder, starters, hold = Path(args[0]), int(args[1]), args[2:] == ["hold"]
    original_run_start = CheckRunDirectory.on_run_start

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 300
        while not condition():
            if time.monotonic() > deadline:
                raise SystemExit(f"race_start: gave up waiting for {what}")
            time.sleep(0.01)

    def on_run_start(self, config, **kwargs):
        (folder / f"ready-{os.getpid()}").touch()
        wait_for(lambda: len(list(folder.glob("ready-*"))) >= starters, f"{starters} starters")
        original_run_start(self, config, **kwargs)
        if hold:
            wait_for((folder / "go").exists, "the go file")

    CheckRunDirectory.on_run_start = on_run_start
elif kind in ("ctrl_c", "ctrl_c_twice", "sigterm"):
    from gptlab.parallel import checkpoint_io
    from gptlab.training.callbacks import ValidateAtLastStep

    fault_step = int(args[0])
    original_batch_end = ValidateAtLastStep.on_train_batch_end
    original_torch_save = checkpoint_io.torch.save
    first_sent = False

    def on_train_batch_end(self, trainer, pl_module, *rest):
        global first_sent
        if trainer.global_step == fault_step:
            first_sent = True
            os.kill(os.getpid(), signal.SIGTERM if kind == "sigterm" else signal.SIGINT)
        original_batch_end(self, trainer, pl_module, *rest)

    def save(obj, f, *rest, **kwargs):
        original_torch_save(obj, f, *rest, **kwargs)
        if first_sent:
            os.kill(os.getpid(), signal.SIGINT)

    ValidateAtLastStep.on_train_batch_end = on_train_batch_end
    if kind == "ctrl_c_twice":
        checkpoint_io.torch.save = save
elif kind == "hold_word2vec_evaluation":
    import time

    from gptlab.word2vec import evaluation

    original_evaluate = evaluation.evaluate

    def evaluate(*args, **kwargs):
        print("word2vec evaluation under way", flush=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return original_evaluate(*args, **kwargs)

    evaluation.evaluate = evaluate
elif kind == "hold_eval_length":
    import time

    from gptlab.evaluation import length, passkey

    def hold(what: str) -> None:
        print(f"{what} under way", flush=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(0.05)

    if args[0] == "passkey":
        original_passkey = passkey.evaluate_passkey

        def evaluate_passkey(*args, **kwargs):
            hold("passkey study")
            return original_passkey(*args, **kwargs)

        passkey.evaluate_passkey = evaluate_passkey
    else:
        original_measure, hold_at, measured = length.loss_by_position, int(args[0]), 0

        def loss_by_position(*args, **kwargs):
            global measured
            measured += 1
            if measured == hold_at:
                hold("length study")
            return original_measure(*args, **kwargs)

        length.loss_by_position = loss_by_position
elif kind == "hold_after_word2vec_checkpoint":
    import time

    from gptlab.word2vec.task import Trainer as Word2VecTrainer

    original_save_checkpoint = Word2VecTrainer.save_checkpoint
    held = False

    def save_checkpoint(self):
        global held
        path = original_save_checkpoint(self)
        if not held:
            held = True
            print(f"word2vec checkpoint written at step {self.global_step}", flush=True)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                time.sleep(0.05)
        return path

    Word2VecTrainer.save_checkpoint = save_checkpoint
elif kind == "hold_at_step":
    import threading
    import time

    from gptlab.training.checkpointing import StopOnSignal

    hold_step = int(args[0])
    original_batch_end = StopOnSignal.on_train_batch_end

    def hold_until_signalled() -> None:
        signalled = threading.Event()
        handlers = {
            signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
        }

        def note(signum, frame) -> None:
            signalled.set()
            handler = handlers[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:  # as it would have ended the process
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        for signum in handlers:
            signal.signal(signum, note)
        try:
            print(f"held at step {hold_step}", flush=True)
            deadline = time.monotonic() + 300
            while not signalled.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)

    def on_train_batch_end(self, trainer, pl_module, *rest):
        # rank 0 only (the process the test signals): the other ranks wait for it in the stop check's collective
        if trainer.global_step == hold_step and trainer.global_rank == 0:
            hold_until_signalled()
        original_batch_end(self, trainer, pl_module, *rest)

    StopOnSignal.on_train_batch_end = on_train_batch_end
elif kind == "hold_tokenizing":
    import time

    from gptlab.data.tokenize_pool import TokenizeJob

    original_pieces = TokenizeJob.pieces

    def pieces(self):
        print("\ntokenization under way", flush=True)  # on a line of its own, after the progress bar's
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(0.05)
        yield from original_pieces(self)

    TokenizeJob.pieces = pieces
else:
    raise SystemExit(f"unknown GPTLAB_TEST_FAULT {kind!r}")


@hydra.main(config_path=str(ROOT / "conf"), config_name="train", version_base="1.3")
def main(cfg):
    from gptlab.cli import run_task

    return run_task(cfg)


if __name__ == "__main__":
    main()
