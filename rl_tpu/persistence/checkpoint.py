"""Checkpoints that resume a run exactly: the sharded train state, its metadata, a checksum.

One checkpoint is one orbax step directory `<directory>/<step>/` holding three items:

- `state`: the pytree of arrays (a TrainState, dicts...), written by every process for the
  shards it holds and read back straight into the target's shardings;
- `meta`: a JSON dict (task-iterator state, schedule state, rng seed, the config), written once;
- `integrity`: per-array checksums of the bits (checkpoint_integrity.py). Tensorstore
  checks its index but not the array bytes, so a flipped bit in a data file would restore
  silently; the checksum turns that into a read error, which makes `restore` fall back to the
  previous step like any other.

Orbax writes a step under a temporary name and renames it when complete, so a process killed
mid-save leaves the previous steps intact and the partial one invisible (the next run's first
save deletes its folder; a Checkpointer that only restores never deletes anything).

Steps saved after a restore continue the restored timeline: the checkpoints on disk above the
one restored (or at or above the one being saved) belong to an abandoned timeline and are moved
to `<directory>/superseded/` at the next save, never deleted, and never mixed into `keep`; the
steps the run saves itself after the restore are its timeline, never set aside.

A pytree that never changes during a run (the frozen reference policy of a KL term) is saved
once, as `<directory>/static/<name>/` (`save_static`, `restore_static`), with the same items
and checksums as a step, rather than into every step. Orbax writes it under a temporary name
too, so a kill mid-save leaves nothing readable (the next `save_static` of that name clears
it); neither `keep` nor the superseded-timeline handling touches `static/`. A step saved
after a static item always finds it complete: `save` first waits for any static save in flight.

Host-side state (a trainer's producer and replay buffer: Python objects of one process, no
arrays to shard) is saved per process per step in `<directory>/host/` by `save_host_state`,
in host_state.py's checksummed format (never a pickle). It is part of its step: once a
process has saved host state, `restore` treats a step whose host-state file is missing or
fails its checksum as damaged and falls back to the step before it, like an unreadable array.
A directory holding host state pickled by an earlier rl_tpu is refused, never unpickled.

A step that cannot be written (a full disk, no permission, a read-only filesystem: an OSError
here or a write tensorstore refuses in orbax's background threads) raises one
`CheckpointWriteError` naming the step, its path, the cause and the last good step, from `save`
or from the `wait` that finds the background write failed; the steps before it stay intact.
The background threads' own reports of that failure (orbax logs each with its traceback,
tensorstore's late callbacks print "Event loop is closed") are cut to one line or dropped,
so the error is the one thing a user reads.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import threading
import time
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from rl_tpu import parallel
from rl_tpu.persistence import host_state
from rl_tpu.persistence.checkpoint_errors import (  # noqa: F401 - CheckpointWriteError: public
    CheckpointWriteError, is_storage_error, quiet_background_failure_reports)
from rl_tpu.persistence.checkpoint_integrity import (  # noqa: F401 - CheckpointCorruptError: public
    CheckpointCorruptError, check_savable, flat, path_name)
from rl_tpu.persistence.checkpoint_integrity import compile_record
from rl_tpu.persistence.checkpoint_integrity import record as integrity_record
from rl_tpu.persistence.checkpoint_integrity import verify as verify_integrity

log = logging.getLogger(__name__)

SUPERSEDED_DIR = "superseded"
STATIC_DIR = "static"
HOST_DIR = "host"
_ITEMS = ("state", "meta", "integrity")
_WRITER_THREADS_GRACE_S = 60.0  # a failed save's other writer threads, to end after it


class CheckpointTargetMismatchError(ValueError):
    """The restore target's structure or shapes differ from what the checkpoint holds."""




def _abstract_target(target):
    """ShapeDtypeStructs with shardings (what orbax restores into), checked leaf by leaf."""
    def one(path, leaf):
        name = path_name(path)
        if isinstance(leaf, np.ndarray):
            return leaf  # restored as a numpy array on the host
        sharding = getattr(leaf, "sharding", None)
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(f"restore target leaf {name!r} is a {type(leaf).__name__}; give "
                            "jax.Arrays or jax.ShapeDtypeStruct(shape, dtype, sharding=...)")
        if sharding is None:
            raise ValueError(f"restore target leaf {name!r} has no sharding; build the target "
                             "with jax.ShapeDtypeStruct(shape, dtype, sharding=...) so each "
                             "device reads only its own part")
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(one, target)


def _check_against_metadata(abstract, saved_tree, what: str) -> None:
    want = {n: tuple(x.shape) for n, x in flat(abstract).items()}
    have = {n: tuple(m.shape) for n, m in flat(saved_tree).items()}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    shapes = [f"{n}: target {want[n]} vs saved {have[n]}" for n in sorted(set(want) & set(have))
              if want[n] != have[n]]
    if missing or extra or shapes:
        parts = ([f"not in the checkpoint: {missing}"] if missing else []) + \
                ([f"in the checkpoint but not the target: {extra}"] if extra else []) + \
                ([f"shapes differ: {shapes}"] if shapes else [])
        raise CheckpointTargetMismatchError(
            f"{what} does not match the restore target ("
            + "; ".join(parts) + "). Build the target from the same model/optimizer config "
            "as the run that saved it.")


# ---------------------------------------------------------------------------------------------
# Checkpointer
# ---------------------------------------------------------------------------------------------

class Checkpointer:
    """Save/restore the train state and a JSON meta dict under `directory`, keeping `keep`.

    Every process calls every method (orbax synchronises them). `checksums=False` skips the
    integrity record (one extra pass over the state on device per save and restore).
    """

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
                 checksums: bool = True):
        if keep is None or int(keep) < 1:
            raise ValueError(f"checkpoint keep={keep!r}; keep at least 1 checkpoint")
        directory = str(directory)
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self.keep = int(keep)
        self.async_save = bool(async_save)
        self.checksums = bool(checksums)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, enable_async_checkpointing=self.async_save, create=True,
            # Not at start-up: a reader (an eval job beside a running trainer) would delete the
            # trainer's save in flight. The first save of this instance cleans up instead.
            cleanup_tmp_directories=False)
        # Handlers named up front: a manager that has not saved yet must still read metadata.
        handlers = {"state": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler(), "integrity": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=_ITEMS, item_handlers=handlers)
        self._name_format = ocp.step.standard_name_format()
        self._pending: Optional[int] = None  # step of the async save in flight, if any
        self._static_writer = None  # made by the first save_static
        self._static_pending: Optional[str] = None  # name of the async static save in flight
        # Steps on disk past the one restored when it was restored: an abandoned timeline,
        # set aside by the next save. Steps this instance wrote since are never among them.
        self._abandoned: set[int] = set()
        self._host_dir = os.path.join(self.directory, HOST_DIR)
        self._restored_host_state: Optional[tuple[int, Any]] = None  # (step, its host state)
        self._saved_here: set[int] = set()
        self._tmp_cleaned = False
        self._closed = False
        self._write_failed: Optional[CheckpointWriteError] = None
        quiet_background_failure_reports()

    # -- listing ------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Complete checkpoints on disk, oldest first (a save still in flight is not one)."""
        return sorted(m.step for m in self._name_format.find_all(epath.Path(self.directory)))

    def latest_step(self) -> Optional[int]:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- saving -------------------------------------------------------------------------------

    def prepare(self, state) -> None:
        """Compiles what saving a state like `state` runs on its devices (the checksums), so
        that the first `save` compiles nothing: call it once the state exists, before the
        steps. Nothing is written."""
        if self.checksums:
            compile_record(state)

    def save(self, step: int, state, meta: dict) -> None:
        """Write `state` and `meta` as checkpoint `step`.

        Async: returns once the arrays are copied off the devices (the caller may donate or
        change them), the files are written in the background. Saving a step this
        Checkpointer already saved, or the step it just restored, is a no-op.
        """
        self._check_open()
        step = int(step)
        if step in self._saved_here:
            log.info("checkpoint step %d already saved to %s; not saving it again", step,
                     self.directory)
            return
        check_savable(state)
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as err:
            raise TypeError(f"checkpoint meta for step {step} is not JSON-serialisable ({err}); "
                            "keep it to dicts, lists, strings, numbers, bools and None") from err
        self.wait()  # the previous save must land before this one's garbage collection
        items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if self.checksums:
            items["integrity"] = ocp.args.JsonSave(integrity_record(state))
        start = time.perf_counter()
        with self._writing(f"checkpoint step {step}", os.path.join(self.directory, str(step))):
            self._set_aside_abandoned(step)
            # force: the trainer decides when to save; orbax's interval policy must not skip
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._saved_here.add(step)
        self._pending = step if self.async_save else None
        log.info("checkpoint step %d: %s in %.2fs", step,
                 "handed to the background writer" if self.async_save else "written",
                 time.perf_counter() - start)

    def host_state_path(self, step: int) -> str:
        """This process's host-state file of checkpoint `step`."""
        return host_state.path(self._host_dir, step, jax.process_index())

    def save_host_state(self, step: int, state) -> None:
        """Write this process's host-side state of checkpoint `step` (host_state.py's
        format), before `save(step, ...)`: a step on disk then always has its host state.
        Host states of earlier steps whose checkpoints are gone (retention, a save that never
        completed) are deleted; call it after `wait()`, so the step in flight is not one."""
        self._check_open()
        path = self.host_state_path(step)
        with self._writing(f"the host state of checkpoint step {step}", path):
            host_state.write(path, state)
        host_state.prune(self._host_dir, jax.process_index(), set(self.all_steps()) | {step},
                         below=int(step))

    def restore_host_state(self, step: int):
        """This process's host state of checkpoint `step` (the one `restore` verified when it
        restored that step), or None if this process never saved host state here (an older
        checkpoint). Host state pickled by an earlier rl_tpu is refused, never unpickled."""
        self._check_open()

        def read():
            host_state.refuse_pickles(self._host_dir)
            if self._restored_host_state is not None and self._restored_host_state[0] == step:
                return self._restored_host_state[1]
            return host_state.read_if_saved(self._host_dir, step, jax.process_index())
        return _on_every_process(read, f"host state of step {step}")

    def _set_aside_abandoned(self, step: int) -> None:
        """Move checkpoints of an abandoned timeline to `superseded/`, keeping them: those
        past the restored step when it was restored, and any other at or above `step`; never
        one this instance wrote on the timeline it continues."""
        stale = [s for s in self.all_steps() if s not in self._saved_here
                 and (s >= step or s in self._abandoned)]
        self._abandoned = set()  # once: later saves only add to the restored timeline
        if not self._tmp_cleaned and jax.process_index() == 0:
            self._remove_partial_saves()
        self._tmp_cleaned = True
        # Every process has listed before any moves, so all agree on `stale` (and on whether
        # to meet at the second barrier).
        ocp.multihost.sync_global_processes("rl_tpu_checkpoint_listed")
        if not stale:
            return
        log.warning("saving step %d in %s: checkpoints %s are from a timeline this run does "
                    "not continue (a restore of an earlier step); moving them to %s/ (delete "
                    "them there if not needed)", step, self.directory, stale, SUPERSEDED_DIR)
        if jax.process_index() == 0:
            root = epath.Path(self.directory)
            aside = root / SUPERSEDED_DIR
            aside.mkdir(parents=True, exist_ok=True)
            for s in stale:
                dest, n = aside / str(s), 1
                while dest.exists():
                    dest, n = aside / f"{s}-{n}", n + 1
                (root / str(s)).rename(dest)
        ocp.multihost.sync_global_processes("rl_tpu_checkpoint_set_aside")
        self._manager.reload()

    def _remove_partial_saves(self) -> None:
        """Delete `<step>.orbax-checkpoint-tmp` folders: saves killed mid-way, never readable.

        Run by the first save of a run, when this process is the directory's one writer."""
        root = epath.Path(self.directory)
        for name in ocp.step.tmp_checkpoints(root):
            log.info("removing %s, a checkpoint save that never completed", root / name)
            (root / name).rmtree()

    def wait(self) -> None:
        """Block until the saves in flight (a step's, a static item's) are complete on disk."""
        if self._static_pending is not None:
            name, self._static_pending = self._static_pending, None
            self._finish(self._static_writer, f"static item {name!r}", self._static_path(name))
        if self._pending is not None:
            step, self._pending = self._pending, None
            self._finish(self._manager, f"checkpoint step {step}",
                         os.path.join(self.directory, str(step)))

    def _finish(self, writer, what: str, path) -> None:
        """Waits for `writer`'s save; one that failed in the background raises
        CheckpointWriteError (whatever orbax raised: the write was not completed)."""
        try:
            writer.wait_until_finished()
            writer.check_for_errors()
        except Exception as err:  # pylint: disable=broad-except
            raise self._write_error(what, str(path), err) from err

    @contextlib.contextmanager
    def _writing(self, what: str, path: str):
        """A storage error (an OSError, a tensorstore write error) in the block raises
        CheckpointWriteError naming `what` and `path`; anything else passes unchanged."""
        try:
            yield
        except CheckpointWriteError:
            raise
        except Exception as err:  # pylint: disable=broad-except
            if not is_storage_error(err):
                raise
            raise self._write_error(what, path, err) from err

    def _write_error(self, what: str, path: str, err: BaseException) -> CheckpointWriteError:
        # Orbax's other writer threads of the failed save may outlive the one that failed
        # first: they end (each logging its line) before the error is raised, so that the
        # error is the last thing said. Then its abandoned write coroutines are finalised,
        # while the interpreter can still run their cleanup, not at exit (each would print
        # a traceback there).
        deadline = time.monotonic() + _WRITER_THREADS_GRACE_S
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and \
                    type(thread).__module__.startswith("orbax."):
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        gc.collect()
        try:
            last_good = self.latest_step()
        except Exception:  # pylint: disable=broad-except - an unreadable directory
            last_good = None
        self._write_failed = CheckpointWriteError(what, path, err, last_good)
        return self._write_failed

    # -- restoring ----------------------------------------------------------------------------

    def restore(self, target, step: Optional[int] = None) -> tuple[int, Any, dict]:
        """(step, state, meta) read straight into the shardings of `target`.

        step=None takes the latest readable checkpoint: one that fails to read or verify is
        logged and the one before it tried. An explicit step is read or fails, no fallback.
        """
        self._check_open()
        self.wait()
        self._manager.reload()
        abstract = _abstract_target(target)
        steps = self.all_steps()
        if step is not None:
            if int(step) not in steps:
                raise FileNotFoundError(f"no complete checkpoint for step {step} in "
                                        f"{self.directory}; the complete ones are {steps}")
            candidates = [int(step)]
        else:
            candidates = steps[::-1]
        if not candidates:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory} to restore "
                                    "(start from scratch, or point to the run's directory)")
        errors = []
        # Host state is part of a step once this process has saved any (older checkpoints
        # have none: their producer state is in meta).
        with_host_state = bool(host_state.saved_steps(self._host_dir, jax.process_index()))
        for candidate in candidates:
            try:
                state, meta = self._read(candidate, abstract, with_host_state)
            except CheckpointTargetMismatchError:
                raise
            except Exception as err:  # pylint: disable=broad-except
                if step is not None:
                    raise RuntimeError(f"checkpoint step {candidate} in {self.directory} could "
                                       f"not be read: {_short(err)}") from err
                errors.append((candidate, err))
                log.warning("checkpoint step %d in %s is unreadable, trying the one before it: "
                            "%s", candidate, self.directory, _short(err))
                continue
            self._abandoned = {s for s in steps if s > candidate}
            # steps above it saved earlier in this run are now superseded, not done; saving
            # the restored step itself again would only rewrite the same state
            self._saved_here = {s for s in self._saved_here if s < candidate} | {candidate}
            return candidate, state, meta
        detail = "; ".join(f"step {s}: {_short(e)}" for s, e in errors)
        raise RuntimeError(f"none of the checkpoints in {self.directory} could be read ({detail})."
                           " Restore from a backup or start from scratch.")

    def _read(self, step: int, abstract, with_host_state: bool = False):
        saved = self._manager.item_metadata(step)
        _check_against_metadata(abstract, saved["state"].tree,
                                f"checkpoint step {step} in {self.directory}")
        step_dir = epath.Path(self.directory) / str(step)
        items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        verify = self.checksums and (step_dir / "integrity").exists()
        if verify:
            items["integrity"] = ocp.args.JsonRestore()

        def read():
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
            if verify:
                verify_integrity(restored["state"], restored["integrity"], f"step {step}")
            # a damaged host state damages its step, on every process
            host = host_state.read_if_saved(self._host_dir, step, jax.process_index()) \
                if with_host_state else None
            return restored, host
        restored, host = _on_every_process(read, f"step {step}")
        self._restored_host_state = (step, host) if with_host_state else None
        return restored["state"], restored["meta"]

    # -- static items: saved once per run ------------------------------------------------------

    def has_static(self, name: str) -> bool:
        """Whether a complete static item `name` is on disk (a save in flight is not one)."""
        path = self._static_path(name)
        return path.exists() and ocp.step.is_path_finalized(path)

    def save_static(self, name: str, tree) -> bool:
        """Write `tree` once as `<directory>/static/<name>/`; True if written, False if kept.

        For a pytree that does not change during a run, so that steps need not hold it. An
        item already there with the same arrays (names, shapes, dtypes and, with checksums,
        bits) is kept as it is. One with other arrays is from an earlier run in this
        directory: it is replaced when no step checkpoint exists (that run stopped before its
        first one, so nothing refers to the item), else this raises. Async like `save`.
        """
        self._check_open()
        path = self._static_path(name)
        check_savable(tree)
        record = integrity_record(tree) if self.checksums else None
        self.wait()
        if self.has_static(name):
            differs = self._static_differs(path, tree, record)
            if not differs:
                log.info("static item %r is already in %s; not writing it again", name, path)
                return False
            if self.all_steps():
                raise ValueError(
                    f"static item {name!r} in {path} holds other arrays than the ones being "
                    f"saved ({differs}), and its run saved checkpoints {self.all_steps()} "
                    "beside it. A directory holds one run: resume it with its own config, or "
                    "use a new --workdir for a new run")
            log.warning("static item %r in %s holds other arrays (%s) and no checkpoint "
                        "refers to it (its run stopped before its first checkpoint); "
                        "replacing it", name, path, differs)
        items = {"state": ocp.args.StandardSave(tree)}
        if record is not None:
            items["integrity"] = ocp.args.JsonSave(record)
        if self._static_writer is None:
            self._static_writer = (ocp.AsyncCheckpointer if self.async_save else
                                   ocp.Checkpointer)(_static_handler())
        start = time.perf_counter()
        with self._writing(f"static item {name!r}", str(path)):
            self._clear_static(name)
            self._static_writer.save(path, args=ocp.args.Composite(**items))
        self._static_pending = name if self.async_save else None
        log.info("static item %r: %s in %.2fs", name,
                 "handed to the background writer" if self.async_save else "written",
                 time.perf_counter() - start)
        return True

    def restore_static(self, name: str, target):
        """The static item `name`, read straight into the shardings of `target`.

        Raises FileNotFoundError if it was never saved completely, CheckpointTargetMismatchError
        if its structure or shapes differ from `target`, CheckpointCorruptError if its bytes
        differ from their checksums. There is no earlier copy to fall back to.
        """
        self._check_open()
        self.wait()
        path = self._static_path(name)
        if not self.has_static(name):
            raise FileNotFoundError(f"no complete static item {name!r} in "
                                    f"{path.parent}; save_static saves it at the start of a run")
        abstract = _abstract_target(target)
        what = f"static item {name!r} in {self.directory}"
        reader = ocp.Checkpointer(_static_handler())
        try:
            saved = reader.metadata(path).item_metadata["state"].tree
            _check_against_metadata(abstract, saved, what)
            verify = self.checksums and (path / "integrity").exists()
            items = {"state": ocp.args.StandardRestore(abstract)}
            if verify:
                items["integrity"] = ocp.args.JsonRestore()

            def read():
                restored = reader.restore(path, args=ocp.args.Composite(**items))
                if verify:
                    verify_integrity(restored["state"], restored["integrity"], what)
                return restored["state"]
            return _on_every_process(read, what)
        finally:
            reader.close()

    def _static_path(self, name: str) -> epath.Path:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise ValueError(f"static item name {name!r}: use letters, digits, '_' and '-'")
        return epath.Path(self.directory) / STATIC_DIR / name

    def _static_differs(self, path: epath.Path, tree, record: Optional[dict]) -> str:
        """What differs between the saved item and `tree` ("" if nothing), without reading the
        arrays: the saved checksums stand for the bits (restore checks the bytes against them)."""
        reader = ocp.Checkpointer(_static_handler())
        try:
            if record is not None and (path / "integrity").exists():
                saved = reader.restore(path, args=ocp.args.Composite(
                    integrity=ocp.args.JsonRestore()))["integrity"]["arrays"]
                want = record["arrays"]
            else:
                tree_metadata = reader.metadata(path).item_metadata["state"].tree
                saved = {n: (tuple(m.shape), str(np.dtype(m.dtype)))
                         for n, m in flat(tree_metadata).items()}
                want = {n: (tuple(x.shape), str(np.dtype(x.dtype))) for n, x in flat(tree).items()}
        except Exception as err:  # pylint: disable=broad-except
            return f"unreadable: {_short(err)}"
        finally:
            reader.close()
        names = sorted(n for n in set(saved) | set(want) if saved.get(n) != want.get(n))
        return f"arrays {names[:5]}{' ...' if len(names) > 5 else ''}" if names else ""

    def _clear_static(self, name: str) -> None:
        """Remove an earlier copy of item `name` and its partial saves (killed mid-way)."""
        if jax.process_index() == 0:
            root = epath.Path(self.directory) / STATIC_DIR
            if root.exists():
                for partial in root.glob(f"{name}.*"):
                    if ocp.step.TMP_DIR_SUFFIX in partial.name:
                        partial.rmtree()
            old = root / name
            if old.exists():
                # Renamed out of the way first: a kill while deleting must not leave a
                # half-deleted item under the name has_static looks for.
                doomed = root / f"{name}{ocp.step.TMP_DIR_SUFFIX}-replaced"
                old.rename(doomed)
                doomed.rmtree()
        ocp.multihost.sync_global_processes("rl_tpu_checkpoint_static_cleared")

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the saves in flight, then stops orbax's writers. After a failed write
        (raised already), closing reports nothing more: orbax's writers would raise the same
        failure again."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            for writer in (self._manager, self._static_writer):
                if writer is None:
                    continue
                try:
                    writer.close()
                except Exception:  # pylint: disable=broad-except
                    if self._write_failed is None:
                        raise
                    log.debug("closing the checkpoint writer after a failed write",
                              exc_info=True)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Checkpointer({self.directory!r}) is closed; make a new one")


def _static_handler() -> ocp.CompositeCheckpointHandler:
    return ocp.CompositeCheckpointHandler(state=ocp.StandardCheckpointHandler(),
                                          integrity=ocp.JsonCheckpointHandler())


def _all_processes_agree(ok: bool) -> bool:
    """All processes must restore the same step, so one process's failure fails them all."""
    return parallel.across_hosts(ok, "all")


def _on_every_process(read, what: str):
    """read(), raising on every process if it failed on any (its own error where it failed)."""
    ok, error, result = True, None, None
    try:
        result = read()
    except Exception as err:  # pylint: disable=broad-except
        ok, error = False, err
    if not _all_processes_agree(ok):
        raise error or RuntimeError(f"{what} failed to read on another process")
    return result


def _short(err: BaseException, limit: int = 300) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."
