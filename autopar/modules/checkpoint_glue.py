"""ParallelModule's checkpoint and weight entry points, each delegating to its runtime module
(sharded checkpoints, Hugging Face checkpoints, replayed initialization) under the module's
communication timeout."""
from __future__ import annotations

from autopar.core.comm_timeout import using

class CheckpointGlue:
    """Checkpoints and weights (a mixin of ``ParallelModule``)."""

    def load_pretrained(self, path, *, prefix: str | None = None, rename=None, strict: bool = True):
        """Load a Hugging Face checkpoint directory (safetensors, sharded or not) or a torch state-dict
        file: each rank reads only its pieces, names mapped by ``prefix`` / ``rename``, values cast to
        the model's dtypes; all or nothing (runtime/pretrained_load.py). Optimizer state is untouched."""
        from autopar.runtime.pretrained_load import load_pretrained

        with self._guard("pmodel.load_pretrained"), using(self.comm_timeout_s):
            return load_pretrained(self, path, prefix=prefix, rename=rename, strict=strict)

    def save_pretrained(self, directory, *, max_shard_size="5GB", config=True, prefix: str | None = None,
                        rename=None, dtype=None):
        """Write a Hugging Face checkpoint (safetensors + ``config.json``) that ``from_pretrained`` loads,
        streamed one tensor at a time to rank 0, never the whole model on one rank; atomic
        (runtime/pretrained_save.py)."""
        from autopar.runtime.pretrained_save import save_pretrained

        with self._guard("pmodel.save_pretrained"), using(self.comm_timeout_s):
            return save_pretrained(self, directory, max_shard_size=max_shard_size, config=config, prefix=prefix,
                                   rename=rename, dtype=dtype)

    def init_weights(self, seed: int = 0) -> None:
        """For a model given on the meta device: fill this rank's pieces with what building the model on
        one CPU under ``torch.manual_seed(seed)`` gives, bit for bit (runtime/init_weights.py)."""
        from autopar.runtime.init_weights import init_weights

        init_weights(self, seed)

    def save(self, path, optimizer=None, *, step: int | None = None, async_: bool = False):
        """Save a sharded checkpoint (a directory): each rank writes its pieces of the model and of
        ``optimizer``'s state, with its RNG state and ``step`` (default: the optimizer's). It loads under
        any plan and world size (``load``). Atomic: a failed save leaves the previous checkpoint. With
        ``async_=True`` it returns once the state is copied, with a future that completes when the
        checkpoint is in place (runtime/checkpoint.py)."""
        from autopar.runtime.checkpoint import save_checkpoint

        with using(self.comm_timeout_s):
            return save_checkpoint(self, path, optimizer, step=step, async_=async_)

    def load(self, path, optimizer=None) -> int | None:
        """Load a checkpoint saved by ``save`` under any plan and world size: this rank's pieces of the
        model (and of the optimizer state, into ``optimizer``, built like the saving one) and its RNG
        state. Returns the step the checkpoint recorded."""
        from autopar.runtime.checkpoint import load_checkpoint

        with using(self.comm_timeout_s):
            return load_checkpoint(self, path, optimizer)
