"""The LightningDataModule: windows over a prepared corpus's token shards, or over a stream.

A window is ``block_size + 1`` consecutive tokens; the input is its first ``block_size`` tokens and the
target the same window shifted by one. Windows start every ``stride`` tokens: ``stride == block_size``
tiles the corpus, a smaller stride overlaps windows (more, correlated samples), a larger one skips text.
With ``data.streaming=true`` the training windows tile the stream as it is read (stride ``block_size``).

With ``data.document_mask=true`` each batch also carries the document id of every input token
(:class:`DocumentIds`), from which the model keeps attention inside each document and restarts positions.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from gptlab.data import corpus, tokenizers
from gptlab.data.shards import TokenShards
from gptlab.errors import ConfigError, DataError

log = logging.getLogger(__name__)


class TokenWindows(Dataset):
    """Windows of ``block_size + 1`` tokens from one split's shards, starting every ``stride`` tokens; a
    window may span two shards."""

    def __init__(self, tokens: TokenShards, block_size: int, stride: int) -> None:
        self.tokens = tokens
        self.block_size, self.stride = block_size, stride
        self.n_tokens = len(tokens)

    def __len__(self) -> int:
        return corpus.num_windows(self.n_tokens, self.block_size + 1, self.stride)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.stride
        window = torch.from_numpy(self.tokens.read(start, start + self.block_size + 1).astype(np.int64))
        return window[:-1], window[1:]  # input (block_size,), target (block_size,)


def document_ids(tokens: torch.Tensor, eot_id: int) -> torch.Tensor:
    """The document of each token of ``tokens`` (B, T): 0 for the tokens before the window's first
    end-of-text token, then one more at each end-of-text token.

    The corpus is packed as ``doc EOT doc EOT ...``, and an end-of-text token *starts* the document after
    it, as a beginning-of-text token would: the target after it (the next document's first token) is then
    predicted from that token alone, as in generation from ``<|endoftext|>``, and the end-of-text target
    (the preceding document's end) from the document it ends. Every target is then predicted from exactly
    one document's tokens. (Codebases whose tokenizers add a beginning-of-text token as well as an
    end-of-text one assign the end-of-text token to the preceding document instead, with the same effect.)"""
    return (tokens == eot_id).cumsum(dim=-1)


@dataclass(frozen=True)
class DocumentIds:
    """The loader's collate function under ``data.document_mask=true``: the batch's (input, target) with the
    input's document ids as a third tensor (B, T), computed in the loader's workers."""

    eot_id: int

    def __call__(self, samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = default_collate(samples)
        return x, y, document_ids(x, self.eot_id)


class GPTDataModule(L.LightningDataModule):
    def __init__(
        self,
        spec: corpus.DataSpec,
        tokenizer: str | dict[str, Any],
        block_size: int,
        batch_size: int,
        stride: int | None = None,
        val_stride: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        document_mask: bool = False,
    ) -> None:
        super().__init__()
        for name, value, example in (
            ("data.batch_size", batch_size, 8),
            ("model.block_size", block_size, 256),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer (e.g. {name}={example}).")
        for name, optional in (("data.stride", stride), ("data.val_stride", val_stride)):
            if optional is not None and (not isinstance(optional, int) or optional <= 0):
                raise ConfigError(
                    f"{name}={optional!r} must be a positive integer, or null for model.block_size."
                )
        if spec.streaming and stride not in (None, block_size):
            raise ConfigError(
                f"data.stride={stride} with data.streaming=true: a stream is read once, its windows tile it "
                "(stride = block_size). Leave data.stride null, or prepare a cache (data.streaming=false)."
            )
        self.spec = spec
        self.tokenizer_node = {"name": tokenizer} if isinstance(tokenizer, str) else dict(tokenizer)
        tokenizers.options_of(self.tokenizer_node["name"], self.tokenizer_node)  # checked at config time
        self.block_size = block_size
        self.batch_size = batch_size
        self.stride = stride or block_size
        self.val_stride = val_stride or block_size
        self.num_workers = num_workers
        self.seed = seed
        self.document_mask = document_mask
        self.corpus: corpus.PreparedCorpus | None = None
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        # the processes of the checkpoint a resume continues: a distributed sampler's saved position that does
        # not name them (written before it did) was reached by that many ranks together
        self.resumed_world_size: int | None = None

    @property
    def tokenizer(self) -> tokenizers.Tokenizer:
        """The corpus's tokenizer (a product of preparation: a fitted vocabulary comes from the corpus)."""
        if self.corpus is None:
            self.setup("fit")
        assert self.corpus is not None
        return self.corpus.tokenizer

    def prepare_data(self) -> None:
        if self.corpus is None:  # builds the token cache once (local rank 0); a second call finds it set up
            # kept for setup() in this process: one open of the cache (its checks and its log lines), not two
            self.corpus = self._prepare()

    def _prepare(self) -> corpus.PreparedCorpus:
        if not self.spec.streaming:
            return corpus.prepare(self.spec, self.tokenizer_node)
        from gptlab.data.streaming import held_out_shards

        name = self.tokenizer_node["name"]
        cls = tokenizers.TOKENIZERS.get(name)
        if cls.fitted:
            raise ConfigError(
                f"tokenizer={name} learns its vocabulary from the whole training split, which a stream never "
                "holds: stream with a fixed vocabulary (tokenizer=gpt2), or prepare a cache (data.streaming=false)."
            )
        tok = cls.create(tokenizers.options_of(name, self.tokenizer_node))
        val = held_out_shards(self.spec, tok)
        meta = {
            "source": f"stream of {self.spec.describe()}",
            "splits": {"val": {"tokens": len(val)}},
        }
        return corpus.PreparedCorpus(TokenShards([], val.dtype), val, val.dtype, tok, meta)

    def setup(self, stage: str | None = None) -> None:
        if self.val_set is not None:
            return
        if self.corpus is None:
            self.corpus = self._prepare()
        if self.document_mask and getattr(self.corpus.tokenizer, "eot_id", None) is None:
            raise ConfigError(
                f"data.document_mask=true with tokenizer={self.corpus.tokenizer.name}, which has no end-of-text "
                "token: the documents of a window are found at that token. Use a tokenizer that has one "
                "(tokenizer=gpt2, word, char), or data.document_mask=false."
            )
        window = self.block_size + 1
        self.val_set = TokenWindows(self.corpus.val, self.block_size, self.val_stride)
        if not self.spec.streaming:
            self.train_set = TokenWindows(self.corpus.train, self.block_size, self.stride)
            if len(self.train_set) == 0:
                raise DataError(
                    f"The training split of {self.spec.describe()} has {self.train_set.n_tokens} tokens, fewer "
                    f"than one window of model.block_size + 1 = {window}. Use more text or a smaller "
                    f"model.block_size (at most {max(1, self.train_set.n_tokens - 1)})."
                )
        layout = self.corpus.meta.get("token_files")
        if len(self.val_set) == 0 and layout:
            files = "val.bin" if layout == "nanoGPT" else "*_val_*.bin"
            raise DataError(
                f"The validation tokens of data.path={self.spec.path!r} ({files}) are {self.val_set.n_tokens}, "
                f"fewer than one window of model.block_size + 1 = {window}: validation would measure nothing. "
                "Write the token files again with more validation text, or lower model.block_size (at most "
                f"{max(1, self.val_set.n_tokens - 1)})."
            )
        if len(self.val_set) == 0:
            raise DataError(
                f"The validation split of {self.spec.describe()} has {self.val_set.n_tokens} tokens, fewer than "
                f"one window of {window}. Raise data.val_fraction (now {self.spec.val_fraction})"
                + (f" or data.val_tokens (now {self.spec.val_tokens})" if self.spec.streaming else "")
                + f", use more text, or lower model.block_size (at most {max(1, self.val_set.n_tokens - 1)})."
            )
        log.info(
            "Windows of %d tokens: %s train (stride %d), %s validation (stride %d)",
            window,
            "streamed" if self.train_set is None else f"{len(self.train_set):,}",
            self.stride,
            f"{len(self.val_set):,}",
            self.val_stride,
        )

    def collate(self) -> DocumentIds | None:
        """The loaders' collate function: the default one, or with document ids under document_mask."""
        return DocumentIds(self.tokenizer.eot_id) if self.document_mask else None

    def _rank(self) -> tuple[int, int, bool]:
        from lightning.pytorch.strategies import ParallelStrategy

        trainer = self.trainer
        if trainer is not None and isinstance(trainer.strategy, ParallelStrategy):
            return trainer.global_rank, trainer.world_size, True
        return 0, 1, False

    def train_dataloader(self) -> DataLoader:
        rank, world_size, distributed = self._rank()
        common: dict[str, Any] = {
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "pin_memory": torch.cuda.is_available(),
            "persistent_workers": self.num_workers > 0,
            "collate_fn": self.collate(),
        }
        if self.spec.streaming:
            from gptlab.data.streaming import StreamingWindows

            trainer = self.trainer
            steps = trainer.max_steps if trainer is not None else -1
            if trainer is None or steps is None or steps < 1:
                raise ConfigError(
                    f"trainer.max_steps={steps}: a streaming run (data.streaming=true) has no epochs to count, "
                    "it trains for a number of steps. Set trainer.max_steps, e.g. trainer.max_steps=100000."
                )
            assert trainer is not None  # steps >= 1 came from a trainer
            windows = steps * trainer.accumulate_grad_batches * self.batch_size  # one "epoch" is the run
            stream = StreamingWindows(
                self.spec, self.tokenizer, self.block_size + 1, rank, world_size, length=windows
            )
            return stateful_loader(stream, drop_last=True, **common)
        quiet_worker_advice("train")
        # A stateful loader: a resumed run continues from the same batch, not from the epoch's start. Under a
        # distributed strategy the sampler must be stateful too (Lightning's own DistributedSampler has no
        # position to restore); each rank then takes every world_size-th sample of the same seeded permutation.
        assert self.train_set is not None, "setup() builds the training windows"
        drop_last = len(self.train_set) >= self.batch_size
        options: dict[str, Any] = {"shuffle": True, "generator": torch.Generator().manual_seed(self.seed)}
        if distributed:
            sampler = ResumableDistributedSampler(
                self.train_set,
                num_replicas=world_size,
                rank=rank,
                shuffle=True,
                seed=self.seed,
                drop_last=drop_last,
            )
            sampler.saved_num_replicas = self.resumed_world_size
            options = {"sampler": sampler}
        return stateful_loader(self.train_set, drop_last=drop_last, **common, **options)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "setup() builds the validation windows"
        quiet_worker_advice("val")  # validation reads cached windows, a stream's too
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            collate_fn=self.collate(),
        )


class ResumableDistributedSampler(StatefulDistributedSampler):
    """torchdata's stateful distributed sampler, whose saved position names the epoch whose permutation it is in
    and the place in that permutation that all ranks together reached, so that a run can continue it on
    another number of processes.

    Each epoch's permutation depends on the seed and the epoch alone; rank ``r`` of ``W`` takes its positions
    ``r, r + W, r + 2W, ...``, and the ranks step together, so after each took ``y`` windows, the run as a
    whole has trained the permutation's first ``W * y`` positions. The saved state names that position; a
    resume on ``W'`` processes takes the rest of the permutation from there, rank ``r`` its positions
    ``position + r, position + r + W', ...`` (cut, or padded from the permutation's start, to a multiple of
    ``W'`` as torch's sampler does), and the next epochs as a run on ``W'`` processes draws them.

    Lightning counts the epochs itself, and counts the one a run's final checkpoint was written in as ended
    (``trainer.max_steps`` was reached): a run trained longer from that checkpoint would draw the next epoch's
    permutation (the seed + 1) and skip as many of its windows as the saved position, leaving the rest of the
    first permutation untrained. This one continues the permutation it saved, and numbers the epochs after it
    from there (Lightning's epoch minus the difference found on resume)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._epoch_offset = 0  # Lightning's epoch minus this sampler's
        self._restored_epoch: int | None = None  # loaded, and no iteration started since
        self.start = 0  # where in this epoch's permutation the ranks' shares begin (a resume on other ranks)
        self._next_start: int | None = None  # loaded: the position the next iteration starts at
        # the processes of a saved position that does not name them (written before it did): the checkpoint's
        self.saved_num_replicas: int | None = None

    def state_dict(self) -> dict[str, Any]:
        if self._next_start is not None:  # loaded, not yet iterated: the loaded position, in this split
            return {
                self._YIELDED: 0,
                "epoch": self.epoch,
                "num_replicas": self.num_replicas,
                "start": self._next_start,
            }
        return {
            **super().state_dict(),
            "epoch": self.epoch,
            "num_replicas": self.num_replicas,
            "start": self.start,
        }

    @classmethod
    def position(cls, state_dict: dict[str, Any], replicas: int) -> int:
        """The place in its epoch's order that a saved state's ranks reached together (``replicas``: their
        number, where a state saved before it was recorded does not name it)."""
        saved_replicas = int(state_dict.get("num_replicas") or replicas)
        return int(state_dict.get("start", 0)) + saved_replicas * int(state_dict[cls._YIELDED])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict.get(self._YIELDED, -1)) < 0:
            raise ValueError(f"Not a distributed sampler's position: {state_dict}")
        # the position all the saved ranks reached together; this rank takes its share of the rest from there
        self._next_start = self.position(state_dict, self.saved_num_replicas or self.num_replicas)
        if "epoch" in state_dict:  # a position saved before the epoch was: as loaded, Lightning's epoch
            self._restored_epoch = int(state_dict["epoch"])
            self._align(self.epoch + self._epoch_offset)

    def set_epoch(self, epoch: int) -> None:
        if self._restored_epoch is not None:
            self._align(epoch)
        else:
            super().set_epoch(epoch - self._epoch_offset)

    def _align(self, lightning_epoch: int) -> None:
        assert self._restored_epoch is not None
        self._epoch_offset = lightning_epoch - self._restored_epoch
        super().set_epoch(self._restored_epoch)

    def __iter__(self) -> Any:
        self._restored_epoch = None  # (a generator: runs at the first window, after the loads and set_epoch)
        self.start, self._next_start = self._next_start or 0, None
        self.yielded = 0
        for index in self._share(self.start):
            self.yielded += 1
            yield index

    def _share(self, start: int) -> list[int]:
        """This rank's windows of the epoch's permutation from position ``start`` on: every
        ``num_replicas``-th, from ``start + rank``, over the rest cut (``drop_last``) or padded from the
        permutation's start to a multiple of ``num_replicas`` (torch's sampler from ``start`` = 0)."""
        n = len(self.dataset)
        if self.shuffle:
            order = torch.randperm(
                n, generator=torch.Generator().manual_seed(self.seed + self.epoch)
            ).tolist()
        else:
            order = list(range(n))
        rest = order[start:]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        elif rest and len(rest) % self.num_replicas:
            padding = self.num_replicas - len(rest) % self.num_replicas
            rest += (order * math.ceil(padding / n))[:padding]
        return rest[self.rank :: self.num_replicas]


def quiet_worker_advice(split: str) -> None:
    """Lightning advises more loader workers ("does not have many workers which may be a bottleneck. Consider
    increasing ... num_workers=15") whenever a loader has at most 2 on a machine with more cores: every run on
    a GPU machine. For windows read from the token cache it is wrong: a batch is a few slices of a memory map,
    67 us for 8 x 256 tokens and 295 us for 32 x 1,024 in one process on a busy 2-core CPU, where a step of
    the small model on an H100 took 36.7 ms and of GPT-2 small 101.8 ms (under 0.3%); workers would add
    processes and copies. A stream (``data.streaming=true``) tokenizes as it reads, and there the advice
    stands: it is silenced for the cached windows' loaders alone (``split``: train or val), by their names."""
    import warnings

    warnings.filterwarnings(
        "ignore", message=f"The '{split}_dataloader' does not have many workers which may be a bottleneck"
    )


def stateful_loader(*args: Any, **kwargs: Any) -> DataLoader:
    """torchdata's ``StatefulDataLoader`` (it saves its position in the checkpoints). Its constructor calls
    ``torch.set_vital``, which torch 2.13 deprecates with a warning that every run printed and that says
    nothing about the run: that warning is silenced for this call alone."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        return StatefulDataLoader(*args, **kwargs)
