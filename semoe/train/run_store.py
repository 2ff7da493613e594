"""A training run's store, opened once per process and handed down.

A run keeps its model, optimizer states, position and settings as versions of one store
(`--out/store`). The command line asks it for the settings a resume starts from and the model it
trains; each rank's trainer checks it, restores from it, stages every checkpoint in a writer (on
rank 0), commits, and drops the versions no longer needed. `RunStore` is that store opened once:
the run's side file (`trainer.json`, or `pipeline.json` for a pipeline run) and the model config
are read in one place, and it follows its own commits (a writer and `gc` update the handle they
came from). Other ranks keep the version they opened; none of them reads the store after its start.
"""

from __future__ import annotations

import json
import os

from semoe.checkpoints.hf_config import store_model_config
from semoe.model.config import MoEConfig
from semoe.train.config import TrainingError
from storage.errors import BadInputError
from storage.reader import MANIFEST
from storage.store import GcResult, Store, StoreWriter

TRAINER_FILE = "trainer.json"  # the side file that makes a store a run of the trainer
OPTIMIZER_FILE = "optimizer.pt"
PIPELINE_FILE = "pipeline.json"  # ... of the pipeline trainer
PIPELINE_OPTIMIZER_FILE = "pipeline_optimizer.pt"


class RunStore:
    """One run's store (or, for `--init-from`, the model store a run starts from), open."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._config: MoEConfig | None = None

    @staticmethod
    def exists(root: str) -> bool:
        """Whether `root` holds a store (a run to resume, or to refuse to overwrite)."""
        return os.path.isfile(os.path.join(root, MANIFEST))

    @classmethod
    def open(cls, root: str) -> "RunStore":
        return cls(Store.open(root))

    @classmethod
    def create(cls, root: str) -> "RunStore":
        """A new run's empty store, in a directory that is absent or empty."""
        return cls(Store.create(root))

    @property
    def root(self) -> str:
        return self.store.root

    def model_config(self, what: str | None = None) -> MoEConfig:
        """The model the store holds (`what` names it in errors; default the store's path)."""
        if self._config is None:
            self._config = store_model_config(self.store, what)
        return self._config

    def state(self, run_file: str) -> dict | None:
        """The committed contents of the run's side file `run_file`, or None where it has none."""
        if not self.store.manifest.has_file(run_file):
            return None
        return json.loads(self.store.read_file(run_file))

    def check_resumable(self, run_file: str) -> None:
        """Refuse to resume a store that is not a run of the trainer whose side file is `run_file`."""
        m = self.store.manifest
        if m.has_file(run_file) and m.has_file("config.json"):
            return
        if m.has_file(PIPELINE_FILE) and run_file == TRAINER_FILE:
            raise BadInputError(f"{self.root}: a pipeline run; resume it with --pipeline N")
        if m.has_file(TRAINER_FILE):
            raise BadInputError(f"{self.root}: not a pipeline run; resume it without --pipeline")
        raise TrainingError(f"{self.root}: a store without {run_file} is not a training run")

    def resume_settings(self, run_file: str, given: dict) -> dict:
        """The training settings a resumed run starts from: those saved in `run_file`, overridden by
        `given` (the command line's)."""
        saved = (self.state(run_file) or {}).get("train_config", {})
        return {**saved, **given}

    def saved_schedule(self) -> str | None:
        """A pipeline run's schedule, kept when resuming unless another is given."""
        return (self.state(PIPELINE_FILE) or {}).get("schedule")

    def saved_step(self, run_file: str) -> int:
        """The step of the last checkpoint (0 without one)."""
        return int((self.state(run_file) or {}).get("step", 0))

    def writer(self) -> StoreWriter:
        """The next version's transaction (one at a time; its commit updates this handle)."""
        return self.store.writer()

    def gc(self, keep: int = 1) -> GcResult:
        """Drop the files of versions older than the newest `keep`."""
        return self.store.gc(keep=keep)
