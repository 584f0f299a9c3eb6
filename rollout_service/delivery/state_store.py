"""Durable service state: runs, their scored groups not yet acked, and the acked ids, in an
embedded SQLite database (WAL), so that a restarted service loses nothing.

Why here: groups are the expensive part of a run (minutes of vLLM time each, at scale), and
they live in the broker until a trainer acks them. A service that restarts (a crash, a
deploy) used to drop them all, and the trainers had to start over.

What is written, and when (batched on the event loop: a transaction per flush, so the
stream is not slowed by a commit per group; ``SqliteStore`` says why not a thread):

- a run when it is created (its spec and owner) and its state and versions as they change;
- a scored group before a consumer can take it: ``put_group`` returns once the group is
  on disk, so a group handed out is never one a restart would forget. It is stored as its
  wire message (``GroupCodec``, ``edge.group_wire``), the encoding its delivery reuses, so
  durability costs the stream an insert, not a second serialisation;
- an ack as it arrives (a kill within the flush interval may forget the last acks; those
  groups come back once, and trainers skip a group id they trained: ``GroupFeed``);
- a run's rows go when it is deleted.

Leases are not stored: after a restart every unacked group is buffered again, as if its
consumer had left. ``MemoryStore`` keeps today's behaviour (nothing survives a restart).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollout_service.types import PromptItem, ScoredGroup

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.001
"""How long writes gather into one transaction (after the first one is queued)."""

CHECKPOINT_INTERVAL_S = 1.0
"""How often the maintenance thread deletes acked groups and checkpoints the WAL."""

ACKED_KEPT = 100_000
"""Acked ids kept, newest first: as many as a run's broker remembers (``broker._ACK_MEMORY``)."""

DELETE_CHUNK = 512
"""Acked groups deleted per transaction of the maintenance thread: each holds the write lock
for a few milliseconds, which is as long as a flush on the loop may have to wait."""

# The tables on the stream's path (groups, acked) are append-only B-trees with no index beside
# their rowid: an index on group ids cost the loop a third of the store's time per group.
# Acked rows carry the group's ``seq``, by which the maintenance thread deletes its row.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, created REAL, owner TEXT, spec BLOB, state BLOB);
CREATE TABLE IF NOT EXISTS groups (seq INTEGER PRIMARY KEY, group_id TEXT, run_id TEXT, body BLOB);
CREATE TABLE IF NOT EXISTS acked (run_id TEXT, group_id TEXT, status TEXT, seq INTEGER);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB);
CREATE TABLE IF NOT EXISTS prompts (run_id TEXT, prompt_index INTEGER, body BLOB, PRIMARY KEY (run_id, prompt_index));
"""


@dataclass
class StoredRun:
    """A run as the store had it: enough to recreate it, its buffer and its ack memory."""

    run_id: str
    owner: str
    spec: Any
    """The ``RunSpec`` it was created with."""
    state: dict[str, Any]
    """State that changes: versions and admission's estimate (``Run.stored_state``)."""
    groups: list[ScoredGroup] = field(default_factory=list)
    """Scored and not acked, oldest first."""
    acked: dict[str, str] = field(default_factory=dict)
    prompts: list[PromptItem] = field(default_factory=list)
    """Submitted prompts not yet made into a stored group (queued, or in flight at the stop),
    in order."""
    prompts_submitted: int = 0
    """Prompts ever submitted to the run: the next one's index."""


class GroupCodec(Protocol):
    """How a scored group becomes the bytes the store keeps, and back."""

    def encode(self, group: ScoredGroup) -> bytes: ...

    def decode(self, body: bytes) -> ScoredGroup: ...


class StateStore(Protocol):
    """What the service writes as it goes and reads back at start-up."""

    def load(self) -> tuple[list[StoredRun], dict[str, Any]]: ...

    def save_run(self, run_id: str, owner: str, spec: Any, state: dict[str, Any]) -> None: ...

    def save_run_state(self, run_id: str, state: dict[str, Any]) -> None: ...

    def delete_run(self, run_id: str) -> None: ...

    async def put_group(self, group: ScoredGroup) -> None: ...

    async def put_prompts(self, run_id: str, prompts: list[PromptItem]) -> None: ...

    def prompt_done(self, run_id: str, prompt_index: int) -> None: ...

    def ack(self, run_id: str, group_ids: list[str], status: str) -> None: ...

    def set_meta(self, key: str, value: Any) -> None: ...

    def close(self) -> None: ...


class MemoryStore:
    """Nothing is kept: a restarted service starts empty (``state_store: memory``)."""

    def load(self) -> tuple[list[StoredRun], dict[str, Any]]:
        return [], {}

    def save_run(self, run_id: str, owner: str, spec: Any, state: dict[str, Any]) -> None:
        pass

    def save_run_state(self, run_id: str, state: dict[str, Any]) -> None:
        pass

    def delete_run(self, run_id: str) -> None:
        pass

    async def put_group(self, group: ScoredGroup) -> None:
        pass

    async def put_prompts(self, run_id: str, prompts: list[PromptItem]) -> None:
        pass

    def prompt_done(self, run_id: str, prompt_index: int) -> None:
        pass

    def ack(self, run_id: str, group_ids: list[str], status: str) -> None:
        pass

    def set_meta(self, key: str, value: Any) -> None:
        pass

    def close(self) -> None:
        pass


_Write = tuple[str, tuple[Any, ...]]
"""A statement and its arguments, queued for the next flush."""


class SqliteStore:
    """The state in one SQLite file (WAL), written on the event loop in batched
    transactions, checkpointed by a thread.

    Why writes run on the loop, not on a writer thread: a writer thread made the stream
    clearly slower than the memory store (``benchmarks/bench_state_store.py``). Each time it
    needed the GIL back (after its sleep, after each statement) it waited up to the
    interpreter's switch interval while the loop encoded groups, so the puts waiting for its
    commit stalled. On the loop, a batch commit is short (a WAL append, no fsync with
    ``synchronous=NORMAL``). The slow parts run on a maintenance thread with
    its own connection, each one statement in C with the GIL released: deleting the rows
    of acked groups (so the file holds what a restart needs, not every group ever made),
    trimming the acked ids to the last ``ACKED_KEPT``, and the checkpoint that copies the
    WAL into the database and fsyncs."""

    def __init__(
        self,
        path: Path,
        codec: GroupCodec,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S,
    ) -> None:
        self.path = path
        self.codec = codec
        path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_interval_s = flush_interval_s
        self._db = _connect(path)
        self._db.execute("PRAGMA wal_autocheckpoint=0")  # the maintenance thread does it, off the loop
        self._db.executescript(_SCHEMA)
        self._pending: list[_Write] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._seq = int(self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM groups").fetchone()[0])
        self._seq_of: dict[str, dict[str, int]] = {}
        """Per run, the row of each stored group not yet acked (put, or loaded at start-up)."""
        self.flushes = 0
        self.writes = 0
        self.checkpoints = 0
        self.deleted_groups = 0
        self._prompt_runs: set[str] = set()
        """Runs with submitted prompts stored: only their groups and drops delete a prompt row."""
        self._stop = threading.Event()
        self._maintainer = threading.Thread(
            target=self._maintain, args=(checkpoint_interval_s,), name="state-store-maintenance", daemon=True
        )
        self._maintainer.start()

    # -- reading (at start-up, before anything is written) ----------------------------------
    def load(self) -> tuple[list[StoredRun], dict[str, Any]]:
        db = self._db
        db.execute("DELETE FROM groups WHERE group_id IN (SELECT group_id FROM acked)")
        runs: dict[str, StoredRun] = {}
        for run_id, owner, spec, state in db.execute("SELECT run_id, owner, spec, state FROM runs ORDER BY created"):
            runs[run_id] = StoredRun(run_id, owner, pickle.loads(spec), pickle.loads(state))
        for seq, run_id, body in db.execute("SELECT seq, run_id, body FROM groups ORDER BY seq"):
            if run_id in runs:
                group = self.codec.decode(body)
                runs[run_id].groups.append(group)
                self._seq_of.setdefault(run_id, {})[group.group_id] = seq
        for run_id, group_id, status in db.execute("SELECT run_id, group_id, status FROM acked ORDER BY rowid"):
            if run_id in runs:
                runs[run_id].acked[group_id] = status
        for run_id, body in db.execute("SELECT run_id, body FROM prompts ORDER BY run_id, prompt_index"):
            if run_id in runs:
                runs[run_id].prompts.append(pickle.loads(body))
                self._prompt_runs.add(run_id)
        meta = {key: pickle.loads(value) for key, value in db.execute("SELECT key, value FROM meta")}
        for run in runs.values():
            run.prompts_submitted = meta.pop(_submitted_key(run.run_id), 0)
        return list(runs.values()), meta

    # -- writing -------------------------------------------------------------------------
    def save_run(self, run_id: str, owner: str, spec: Any, state: dict[str, Any]) -> None:
        self._enqueue(
            "INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?)",
            (run_id, time.time(), owner, pickle.dumps(spec), pickle.dumps(state)),
        )

    def save_run_state(self, run_id: str, state: dict[str, Any]) -> None:
        self._enqueue("UPDATE runs SET state = ? WHERE run_id = ?", (pickle.dumps(state), run_id))

    def delete_run(self, run_id: str) -> None:
        for table in ("runs", "groups", "acked", "prompts"):
            self._enqueue(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))
        self._enqueue("DELETE FROM meta WHERE key = ?", (_submitted_key(run_id),))
        self._prompt_runs.discard(run_id)
        self._seq_of.pop(run_id, None)

    async def put_group(self, group: ScoredGroup) -> None:
        """Returns once the group is committed: only then may a consumer take it. Its
        prompt's row (a submitted prompt's) goes in the same transaction, so after a kill a
        prompt is either a stored group or queued again, never both or neither."""
        self._seq += 1
        done = self._committed()
        self.prompt_done(group.run_id, group.prompt.index)
        seq = self._seq_of.setdefault(group.run_id, {})[group.group_id] = self._seq
        row = (seq, group.group_id, group.run_id, self.codec.encode(group))
        self._enqueue("INSERT INTO groups VALUES (?, ?, ?, ?)", row)
        await done

    async def put_prompts(self, run_id: str, prompts: list[PromptItem]) -> None:
        """Submitted prompts, and the run's count of them; returns once committed, so a
        client told its prompts were queued is never told so by a service that forgets
        them. The writes are queued before the first await: a group made from one of them
        later deletes its row after it is written."""
        done = self._committed()
        self._prompt_runs.add(run_id)
        for prompt in prompts:
            self._enqueue(
                "INSERT OR REPLACE INTO prompts VALUES (?, ?, ?)", (run_id, prompt.index, pickle.dumps(prompt))
            )
        submitted = max(prompt.index for prompt in prompts) + 1
        self._enqueue("INSERT OR REPLACE INTO meta VALUES (?, ?)", (_submitted_key(run_id), pickle.dumps(submitted)))
        await done

    def prompt_done(self, run_id: str, prompt_index: int) -> None:
        """The prompt left the run without a group (dropped): it is not queued again after a restart."""
        if run_id in self._prompt_runs:
            self._enqueue("DELETE FROM prompts WHERE run_id = ? AND prompt_index = ?", (run_id, prompt_index))

    def ack(self, run_id: str, group_ids: list[str], status: str) -> None:
        """One small row per ack; the acked group's own 4 KB row is deleted by the
        maintenance thread, off the loop (deleting it in the flush made the store's cost per
        group much higher: ``benchmarks/bench_state_store.py``)."""
        for group_id in group_ids:
            seq = self._seq_of.get(run_id, {}).pop(group_id, None)  # None: acked before (a repeat)
            self._enqueue("INSERT INTO acked VALUES (?, ?, ?, ?)", (run_id, group_id, status, seq))

    def set_meta(self, key: str, value: Any) -> None:
        self._enqueue("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, pickle.dumps(value)))

    def close(self) -> None:
        """Write what is queued, checkpoint, and close the file."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._stop.set()
        self._maintainer.join(timeout=30)
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()

    def _committed(self) -> asyncio.Future[None]:
        """Done when the next flush commits (or fails with its error)."""
        done = asyncio.get_running_loop().create_future()
        self._waiters.append(done)
        return done

    def _enqueue(self, sql: str, args: tuple[Any, ...]) -> None:
        """Queue a write for the next flush, ``flush_interval_s`` after the first queued one
        (at once when no event loop runs: start-up, shutdown, scripts)."""
        if self._closed:
            raise RuntimeError("the state store is closed")
        self._pending.append((sql, args))
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._timer = loop.call_later(self.flush_interval_s, self.flush)

    def flush(self) -> None:
        """One transaction for everything queued; consecutive writes of one statement go in
        one ``executemany``. Then the puts awaiting it (``_committed``) return, or raise."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        waiters, self._waiters = self._waiters, []
        if not batch:
            return
        error: BaseException | None = None
        try:
            self._db.execute("BEGIN")
            for sql, writes in itertools.groupby(batch, key=lambda write: write[0]):
                self._db.executemany(sql, [args for _, args in writes])
            self._db.execute("COMMIT")
            self.flushes += 1
            self.writes += len(batch)
        except sqlite3.Error as exc:  # a full disk, say: the service goes on in memory, loudly
            error = exc
            logger.error("state store: a batch of %d writes failed (%s); they are not durable", len(batch), exc)
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
        for done in waiters:
            if not done.done():
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)

    def _maintain(self, interval_s: float) -> None:
        """Now and then: delete acked groups' rows, trim the acked ids, checkpoint the WAL
        (PASSIVE: it never blocks the loop's writes)."""
        db = _connect(self.path)
        acks_done = 0  # acked rows (by rowid) whose groups are deleted
        try:
            while not self._stop.wait(interval_s):
                try:
                    deleted, acks_done = _delete_acked_groups(db, acks_done)
                    self.deleted_groups += deleted
                    db.execute("DELETE FROM acked WHERE rowid <= (SELECT MAX(rowid) FROM acked) - ?", (ACKED_KEPT,))
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                    self.checkpoints += 1
                except sqlite3.Error as exc:
                    logger.warning("state store: maintenance failed (%s); the next round tries again", exc)
        finally:
            db.close()


def _delete_acked_groups(db: sqlite3.Connection, after: int) -> tuple[int, int]:
    """Rows of the groups acked since acked row ``after``, ``DELETE_CHUNK`` acks per
    transaction; returns how many were deleted and the newest acked row now done."""
    newest = db.execute("SELECT COALESCE(MAX(rowid), 0) FROM acked").fetchone()[0]
    deleted = 0
    while after < newest:
        upto = min(after + DELETE_CHUNK, newest)
        cursor = db.execute(
            "DELETE FROM groups WHERE seq IN (SELECT seq FROM acked WHERE rowid > ? AND rowid <= ?)",
            (after, upto),
        )
        deleted, after = deleted + cursor.rowcount, upto
    return deleted, after


def _submitted_key(run_id: str) -> str:
    return f"prompts_submitted/{run_id}"


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=5.0)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a crash of the process loses nothing committed
    return db


def open_store(setting: str, codec: GroupCodec) -> StateStore:
    """``memory`` or the path of the SQLite file (created if missing)."""
    if setting == "memory":
        return MemoryStore()
    return SqliteStore(Path(setting), codec)
