"""Where a run's files go: the step logs (``steps/rank<r>.jsonl``), rank 0's ``evals.jsonl``,
``plans.jsonl`` and ``summary.json``.

By default they go where a Ray Train user looks for a run: its directory under the
storage path, ``RunConfig(storage_path=..., name=...)`` (Ray Train's
``<storage_path>/<name>``, beside its ``checkpoint_*`` directories). On a local
filesystem the ranks write there directly; the path is then the same on every node only
if it is a shared filesystem, as Ray Train asks of a storage path anyway. On another
filesystem (``s3://``, ``gs://``, a ``storage_filesystem`` of your own) each rank writes to
``<tmp>/raycomp/<run_id>`` while it trains and copies its files to the run's directory when
it finishes (:meth:`RunOutputs.upload`, called by :func:`raycomp.train.finish`): a crash
leaves them on the nodes. An explicit ``TrainOptions.output_dir`` always wins, and nothing
is copied from it.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunOutputs", "run_outputs"]

log = logging.getLogger("raycomp.train")

#: rank 0's files besides its step log (the other ranks write only their step log)
RANK0_FILES = ("evals.jsonl", "plans.jsonl", "summary.json")


@dataclass(frozen=True)
class RunOutputs:
    """``directory``: where this rank writes. ``filesystem``, ``remote_dir``: where the
    files are copied at the end (None: they are written in place)."""

    directory: Path
    filesystem: Any = None
    remote_dir: str | None = None

    @property
    def location(self) -> str:
        """Where the files are at the end: the storage path they are copied to, else the
        directory written."""
        return self.remote_dir if self.remote_dir is not None else str(self.directory)

    def upload(self, rank: int) -> None:
        """Copy this rank's files to the run's directory on the storage filesystem (its step
        log; rank 0 also its evaluations, plan timeline and summary). Nothing when the files
        were written in place. A failure is a warning: training has finished."""
        if self.filesystem is None or self.remote_dir is None:
            return
        import pyarrow.fs

        names = [f"steps/rank{rank}.jsonl", *(RANK0_FILES if rank == 0 else ())]
        for name in names:
            source = self.directory / name
            if not source.exists():
                continue
            target = f"{self.remote_dir}/{name}"
            try:
                self.filesystem.create_dir(target.rsplit("/", 1)[0], recursive=True)
                pyarrow.fs.copy_files(str(source), target, destination_filesystem=self.filesystem)
            except Exception as error:  # noqa: BLE001 - the local copy stays
                log.warning("could not copy %s to the run's storage (%s): %s; it stays in %s",
                            name, target, error, self.directory)


def run_outputs(output_dir: str | None, run_id: str, context: Any) -> RunOutputs:
    """Where this run's files go (the module docstring): ``output_dir`` if given, else the
    Ray Train run's directory (``context.get_storage().experiment_fs_path``) when its
    filesystem is local, else ``<tmp>/raycomp/<run_id>`` copied there at the end. Without a
    storage context (Ray Train's local mode has none): ``<tmp>/raycomp/<run_id>``."""
    if output_dir:
        return RunOutputs(Path(output_dir))
    staging = Path(tempfile.gettempdir()) / "raycomp" / run_id
    try:
        storage = context.get_storage()
        filesystem, path = storage.storage_filesystem, storage.experiment_fs_path
    except Exception as error:  # noqa: BLE001 - NotImplementedError in local mode, or an older Ray
        log.debug("no Ray Train storage context (%s): writing to %s", error, staging)
        return RunOutputs(staging)
    if getattr(filesystem, "type_name", None) == "local":
        return RunOutputs(Path(path))
    return RunOutputs(staging, filesystem, path)
