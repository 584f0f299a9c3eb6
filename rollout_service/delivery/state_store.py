"""Durable service state, so that a restarted service loses nothing: runs, their unacked scored
groups (as their wire message, the encoding delivery reuses) and the acked ids, in SQLite (WAL).
Leases are not stored: after a restart every unacked group is buffered again, as if its
consumer had left.
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

from rollout_service.errors import StartupError
from rollout_service.types import PromptItem, ScoredGroup

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.001
"""How long writes gather into one transaction."""

CHECKPOINT_INTERVAL_S = 1.0
"""How often the maintenance thread deletes acked groups and checkpoints the WAL."""

ACKED_KEPT = 100_000
"""Acked ids kept, in the file and in each run's broker (late acks of those are no-ops)."""

DELETE_CHUNK = 512
"""Acked groups deleted per maintenance transaction: bounds how long a flush waits for the write lock."""

# groups and acked have no index beside their rowid (cheap appends on the loop); acked rows carry
# the group's ``seq``, by which the maintenance thread deletes its row.
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
    state: dict[str, Any]
    """``Run.stored_state``: versions and admission's estimate."""
    groups: list[ScoredGroup] = field(default_factory=list)
    """Scored and not acked, oldest first."""
    acked: dict[str, str] = field(default_factory=dict)
    prompts: list[PromptItem] = field(default_factory=list)
    """Submitted prompts not yet made into a stored group, in order."""
    prompts_submitted: int = 0
    """The next submitted prompt's index."""


class GroupCodec(Protocol):
    def encode(self, group: ScoredGroup) -> bytes: ...
    def decode(self, body: bytes) -> ScoredGroup: ...


class StateStore:
    """Where the service's state survives a restart. This base keeps nothing: a restarted
    service starts empty (``state_store: memory``)."""

    def load(self) -> tuple[list[StoredRun], dict[str, Any]]:
        return [], {}

    def save_run(self, run_id: str, owner: str, spec: Any, state: dict[str, Any]) -> None: ...
    def save_run_state(self, run_id: str, state: dict[str, Any]) -> None: ...
    def delete_run(self, run_id: str) -> None: ...
    async def put_group(self, group: ScoredGroup) -> None: ...
    async def put_prompts(self, run_id: str, prompts: list[PromptItem]) -> None: ...
    def prompt_done(self, run_id: str, prompt_index: int) -> None: ...
    def ack(self, run_id: str, group_ids: list[str], status: str) -> None: ...
    def set_meta(self, key: str, value: Any) -> None: ...
    def close(self) -> None: ...


MemoryStore = StateStore


class SqliteStore(StateStore):
    """The state in one SQLite file, written on the event loop in batched transactions.

    Writes stay on the loop because a writer thread stalls on the GIL switch interval while
    the loop encodes groups; the slow parts (deleting acked groups, trimming acked ids,
    checkpoints) run on a maintenance thread with its own connection."""

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
        self._pending: list[tuple[str, tuple[Any, ...]]] = []  # statements and their arguments
        self._waiters: list[asyncio.Future[None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._seq = int(self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM groups").fetchone()[0])
        self._seq_of: dict[str, dict[str, int]] = {}
        """Per run, the row of each stored group not yet acked."""
        self.flushes = 0
        self.writes = 0
        self.checkpoints = 0
        self.deleted_groups = 0
        self._prompt_runs: set[str] = set()
        """Runs with stored submitted prompts: only theirs delete a prompt row."""
        self._stop = threading.Event()
        self._maintainer = threading.Thread(
            target=self._maintain, args=(checkpoint_interval_s,), name="state-store-maintenance", daemon=True
        )
        self._maintainer.start()

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
        """Returns once committed, with its prompt's row deleted in the same transaction."""
        self._seq += 1
        done = self._committed()
        self.prompt_done(group.run_id, group.prompt.index)
        seq = self._seq_of.setdefault(group.run_id, {})[group.group_id] = self._seq
        row = (seq, group.group_id, group.run_id, self.codec.encode(group))
        self._enqueue("INSERT INTO groups VALUES (?, ?, ?, ?)", row)
        await done

    async def put_prompts(self, run_id: str, prompts: list[PromptItem]) -> None:
        """Submitted prompts and the run's count of them; returns once committed. The writes are
        queued before the first await, so a later group's delete of its row comes after them."""
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
        """The prompt left the run without a group: it is not queued again after a restart."""
        if run_id in self._prompt_runs:
            self._enqueue("DELETE FROM prompts WHERE run_id = ? AND prompt_index = ?", (run_id, prompt_index))

    def ack(self, run_id: str, group_ids: list[str], status: str) -> None:
        """One small row per ack; the maintenance thread deletes the group's row, off the loop."""
        for group_id in group_ids:
            seq = self._seq_of.get(run_id, {}).pop(group_id, None)  # None: acked before (a repeat)
            self._enqueue("INSERT INTO acked VALUES (?, ?, ?, ?)", (run_id, group_id, status, seq))

    def set_meta(self, key: str, value: Any) -> None:
        self._enqueue("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, pickle.dumps(value)))

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._stop.set()
        self._maintainer.join(timeout=30)
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()

    def _committed(self) -> asyncio.Future[None]:
        """Done when the next flush commits (or fails)."""
        done = asyncio.get_running_loop().create_future()
        self._waiters.append(done)
        return done

    def _enqueue(self, sql: str, args: tuple[Any, ...]) -> None:
        """Queue a write for the next flush (at once when no event loop runs)."""
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
        """Delete acked groups' rows, trim the acked ids, checkpoint the WAL (PASSIVE: never blocks the loop)."""
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
    """Delete the groups acked since acked row ``after``; returns how many, and the newest row done."""
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
    try:
        return SqliteStore(Path(setting), codec)
    except (OSError, sqlite3.Error) as exc:
        raise StartupError(
            f"state_store {setting} cannot be opened ({exc}); give the path of an SQLite file in a writable "
            "folder, or memory to keep nothing"
        ) from None
