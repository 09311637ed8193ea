"""The controller's durable state: runs, nodes, incidents and the action timeline (SQLAlchemy Core).

SQLite by default (a file, in WAL mode, so the CLI can read while the controller writes), PostgreSQL by URL
(``postgresql+psycopg://user@host/db``). What must survive a controller crash lives here; what is rebuilt within
seconds from the agents' heartbeats (liveness, rank progress, compute samples) does not.

Exactly-once recovery: every action of a recovery has a request id and is recorded (``record_action``) before it
is carried out, then marked done (``complete_action``). A controller that restarts mid-recovery finds the
incident still open and its actions recorded: it carries out only those not done (each action is idempotent, so
one interrupted half-way is safe to redo), and the incident stays one row. Incidents have a unique ``key`` too,
so the same failure reported again (an agent resends an unacknowledged XID) does not open a second one.

Node rows are read on every heartbeat: they are loaded once and kept in memory, written through (a write that
fails leaves them as they were). This holds because the controller is the only writer of its state store (one
controller per store: ``opsd run`` takes a lock, and the CLI goes through the API).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Any

import msgspec
from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Table,
    insert,
    select,
    update,
)
from sqlalchemy.engine import RowMapping
from sqlalchemy.exc import IntegrityError, OperationalError

from opsd.controller.rows import (
    FlightDumpRow,
    LaunchRow,
    LaunchSample,
    PublishedCadence,
    RunRow,
    RunSpec,
    decode_bubble,
    decode_cadence,
    decode_groups,
    decode_spec,
    encode_cadence,
    encode_groups,
    encode_spec,
)
from opsd.controller.schema import actions, flight_dumps, incidents, launches, nodes, open_engine, runs
from opsd.errors import TransientError
from opsd.protocol.records import Action, IncidentRow, NodeRow
from opsd.protocol.states import ActionKind, ActionState, IncidentKind, IncidentState, NodeRole, RunState

log = logging.getLogger(__name__)

__all__ = ["Action", "LaunchSample", "StateStore"]


class StateStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._nodes: dict[str, NodeRow] | None = None  # name -> row, once loaded
        self._nodes_lock = threading.Lock()
        self._launches_lock = threading.Lock()  # a launch's record is read, added to and written back

    @classmethod
    def open(cls, url: str) -> StateStore:
        return cls(open_engine(url))

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        try:
            with self.engine.begin() as conn:
                yield conn
        except OperationalError as exc:  # database locked or unreachable: worth retrying
            raise TransientError(f"state store: {exc.orig}", retry_after_s=1.0) from exc

    # -- runs --------------------------------------------------------------------------------------------------
    def create_run(self, run: str, spec: RunSpec, now_s: float) -> bool:
        """Record a run (running, generation 0); False when it exists already (nothing changed)."""
        row = {"id": run, "state": RunState.RUNNING, "spec": encode_spec(spec), "created_s": now_s, "updated_s": now_s}
        try:
            with self._tx() as c:
                c.execute(insert(runs).values(generation=0, last_step=0, **row))
        except IntegrityError:
            return False
        return True

    def run(self, run: str) -> RunRow | None:
        with self._tx() as c:
            row = c.execute(select(runs).where(runs.c.id == run)).mappings().first()
        return _run_row(row) if row else None

    def runs(self) -> list[RunRow]:
        with self._tx() as c:
            rows = c.execute(select(runs).order_by(runs.c.created_s)).mappings().all()
        return [_run_row(r) for r in rows]

    def update_run(self, run: str, now_s: float, **fields: Any) -> None:
        allowed = {"state", "generation", "last_step", "final_step", "spec", "first_productive_s", "groups"}
        if not set(fields) <= allowed:
            raise ValueError(f"update_run: unknown fields {sorted(set(fields) - allowed)}")
        if "spec" in fields:
            fields["spec"] = encode_spec(fields["spec"])
        if "groups" in fields:
            fields["groups"] = encode_groups(fields["groups"])
        with self._tx() as c:
            c.execute(update(runs).where(runs.c.id == run).values(updated_s=now_s, **fields))

    def publish_cadence(self, run: str, cadence: PublishedCadence) -> None:
        """Keep the cadence published to ``run``'s ranks (the run's ``updated_s`` stays: its state did not change)."""
        with self._tx() as c:
            c.execute(update(runs).where(runs.c.id == run).values(cadence=encode_cadence(cadence)))

    # -- nodes -------------------------------------------------------------------------------------------------
    def upsert_node(self, name: str, now_s: float, **fields: Any) -> None:
        allowed = {"run", "role", "domain", "reason", "events_acked"}
        if not set(fields) <= allowed:
            raise ValueError(f"upsert_node: unknown fields {sorted(set(fields) - allowed)}")
        if "role" in fields:
            fields["role"] = NodeRole(fields["role"])
        with self._nodes_lock:
            cached = self._node_rows()
            row = cached.get(name)
            if row is not None and not fields:
                return
            with self._tx() as c:
                if row is not None:
                    c.execute(update(nodes).where(nodes.c.name == name).values(updated_s=now_s, **fields))
                    row = replace(row, **fields, updated_s=now_s)
                else:
                    defaults = {"run": None, "role": NodeRole.SPARE, "domain": "", "reason": "", "events_acked": 0}
                    values = {"name": name, **defaults, **fields, "updated_s": now_s}
                    c.execute(insert(nodes).values(**values))
                    row = NodeRow(**values)
            cached[name] = row  # committed: the copy in memory follows

    def activate_nodes(self, run_of: Mapping[str, str], now_s: float) -> None:
        """Nodes made active members of a run (``node -> run``) in one transaction: for each, what
        ``upsert_node(node, now_s, run=run, role=ACTIVE)`` does. The first heartbeats of a job of thousands of nodes
        come within seconds, and a commit each would keep the store busy for as long."""
        with self._nodes_lock:
            cached = self._node_rows()
            added = {n: run for n, run in run_of.items() if n not in cached}
            changed = {n: run for n, run in run_of.items() if n in cached}
            with self._tx() as c:
                if added:
                    new = [_active(n, run, now_s) for n, run in added.items()]
                    c.execute(insert(nodes), [asdict(row) for row in new])
                for name, run in changed.items():
                    c.execute(
                        update(nodes).where(nodes.c.name == name).values(run=run, role=NodeRole.ACTIVE, updated_s=now_s)
                    )
            for name, run in added.items():  # committed: the copy in memory follows
                cached[name] = _active(name, run, now_s)
            for name, run in changed.items():
                cached[name] = replace(cached[name], run=run, role=NodeRole.ACTIVE, updated_s=now_s)

    def ack_events(self, name: str, seq: int, now_s: float) -> None:
        """Record that a node's GPU events are handled up to ``seq`` (a node not seen yet is added, as a spare);
        never moves back."""
        with self._nodes_lock:
            row = self._node_rows().get(name)
            if row is not None:
                if row.events_acked < seq:
                    with self._tx() as c:
                        c.execute(
                            update(nodes)
                            .where(nodes.c.name == name, nodes.c.events_acked < seq)
                            .values(events_acked=seq, updated_s=now_s)
                        )
                    self._node_rows()[name] = replace(row, events_acked=seq, updated_s=now_s)
                return
        self.upsert_node(name, now_s, events_acked=seq)

    def node(self, name: str) -> NodeRow | None:
        """A node's row, from memory once it is read: without the lock, which a write holds for its transaction
        (a row in memory is a committed one), so that the heartbeats on the API's event loop never wait on one."""
        rows = self._nodes
        if rows is not None:
            return rows.get(name)
        with self._nodes_lock:
            return self._node_rows().get(name)

    def nodes(self, run: str | None = None) -> list[NodeRow]:
        with self._nodes_lock:
            rows = self._node_rows()
            return [rows[n] for n in sorted(rows) if run is None or rows[n].run == run]

    def node_names(self, run: str, role: str) -> set[str]:
        """The names of the nodes of ``run`` in ``role``."""
        with self._nodes_lock:
            return {n for n, row in self._node_rows().items() if row.run == run and row.role == role}

    def reload(self) -> None:
        """Forget the node rows kept in memory: the next read is the database's (a replica that becomes the leader:
        the one before it wrote there meanwhile)."""
        with self._nodes_lock:
            self._nodes = None

    def _node_rows(self) -> dict[str, NodeRow]:
        """The node rows, read from the database the first time (the caller holds ``_nodes_lock``)."""
        if self._nodes is None:
            with self._tx() as c:
                self._nodes = {r["name"]: _node_row(r) for r in c.execute(select(nodes)).mappings().all()}
        return self._nodes

    # -- incidents ---------------------------------------------------------------------------------------------
    def open_incident(
        self,
        *,
        key: str,
        run: str,
        kind: str,
        node: str,
        rank: int | None,
        detail: str,
        failed_s: float,
        detected_s: float,
        replica_group: int | None = None,
    ) -> tuple[int, bool]:
        """The incident's id, and whether it is new (False: the same failure was recorded before);
        ``replica_group``: the group a replica recovery is confined to."""
        row = {
            "key": key,
            "run": run,
            "kind": kind,
            "node": node,
            "rank": rank,
            "detail": detail,
            "state": IncidentState.OPEN,
            "failed_s": failed_s,
            "detected_s": detected_s,
            "replica_group": replica_group,
        }
        try:
            with self._tx() as c:
                result = c.execute(insert(incidents).values(**row))
                key_id = result.inserted_primary_key
                assert key_id is not None
                return int(key_id[0]), True
        except IntegrityError:
            with self._tx() as c:
                found = c.execute(select(incidents.c.id).where(incidents.c.key == key)).scalar_one()
            return int(found), False

    def update_incident(self, incident_id: int, **fields: Any) -> None:
        allowed = {"state", "resumed_s", "resumed_from_step", "lost_steps", "spare", "detail", "node", "rank"}
        allowed |= {"trace_id", "gpu_trace_id", "gpu_span_id", "replica_group", "missed_steps", "stall_s"}
        if not set(fields) <= allowed:
            raise ValueError(f"update_incident: unknown fields {sorted(set(fields) - allowed)}")
        with self._tx() as c:
            c.execute(update(incidents).where(incidents.c.id == incident_id).values(**fields))

    def incident(self, incident_id: int) -> IncidentRow | None:
        with self._tx() as c:
            row = c.execute(select(incidents).where(incidents.c.id == incident_id)).mappings().first()
        return _incident_row(row) if row else None

    def incidents(self, run: str | None = None, state: str | None = None) -> list[IncidentRow]:
        query = select(incidents).where(*_matching(incidents, run=run, state=state)).order_by(incidents.c.id)
        with self._tx() as c:
            return [_incident_row(r) for r in c.execute(query).mappings().all()]

    # -- the action timeline -----------------------------------------------------------------------------------
    def record_action(
        self,
        request_id: str,
        *,
        run: str,
        incident_id: int | None,
        seq: int,
        kind: str,
        args: Mapping[str, object],
        now_s: float,
        state: ActionState = ActionState.PENDING,
    ) -> Action:
        """Record an action before it is carried out (``NOT_TAKEN``: one never to be); the same request id again
        returns the first."""
        row = {
            "request_id": request_id,
            "incident_id": incident_id,
            "run": run,
            "seq": seq,
            "kind": kind,
            "args": json.dumps(args, sort_keys=True),
            "state": state,
            "created_s": now_s,
        }
        try:
            with self._tx() as c:
                c.execute(insert(actions).values(**row))
        except IntegrityError:
            pass
        found = self.action(request_id)
        assert found is not None
        return found

    def complete_action(self, request_id: str, now_s: float, result: Mapping[str, object] | None = None) -> None:
        """Mark an action done, with what it did; completing it again changes nothing."""
        with self._tx() as c:
            c.execute(
                update(actions)
                .where(actions.c.request_id == request_id, actions.c.state == ActionState.PENDING)
                .values(state=ActionState.DONE, done_s=now_s, result=None if result is None else json.dumps(result))
            )

    def action(self, request_id: str) -> Action | None:
        with self._tx() as c:
            row = c.execute(select(actions).where(actions.c.request_id == request_id)).mappings().first()
        return _action_row(row) if row else None

    def actions(self, *, run: str | None = None, incident_id: int | None = None) -> list[Action]:
        query = select(actions).where(*_matching(actions, run=run, incident_id=incident_id))
        query = query.order_by(actions.c.created_s, actions.c.seq)
        with self._tx() as c:
            return [_action_row(r) for r in c.execute(query).mappings().all()]

    # -- launches ----------------------------------------------------------------------------------------------
    def record_launch(self, run: str, generation: int, now_s: float, sample: LaunchSample) -> None:
        """Add what launch ``generation`` of ``run`` measured since the last record: its steps and ranks, a sample
        of the job's MFU and tokens/s (counted when it progressed), and its collective seconds (per stack, the
        larger of the recorded and the new: the agents' totals only grow)."""
        key = (launches.c.run == run) & (launches.c.generation == generation)
        with self._launches_lock, self._tx() as c:
            row = c.execute(select(launches).where(key)).mappings().first()
            comm = {**(json.loads(row["comm"]) if row else {})}
            for stack, seconds in sample.comm.items():
                comm[stack] = max(seconds, comm.get(stack, 0.0))
            fields: dict[str, object] = {"updated_s": now_s, "comm": json.dumps(comm, sort_keys=True)}
            if sample.first_step is not None:
                known = row["first_step"] if row else None
                fields["first_step"] = sample.first_step if known is None else min(known, sample.first_step)
            if sample.last_step is not None:
                fields["last_step"] = max(sample.last_step, (row["last_step"] or 0) if row else 0)
            fields["ranks"] = max(sample.ranks, row["ranks"] if row else 0)
            if sample.progressed:
                fields["samples"] = (row["samples"] if row else 0) + 1
                fields["mfu_ratio_sum"] = (row["mfu_ratio_sum"] if row else 0.0) + sample.mfu_ratio
                fields["tokens_per_s_sum"] = (row["tokens_per_s_sum"] if row else 0.0) + sample.tokens_per_s
                fields["mfu_ratio_last"], fields["tokens_per_s_last"] = sample.mfu_ratio, sample.tokens_per_s
                if sample.pipeline is not None:
                    fields["pipeline"] = msgspec.json.encode(sample.pipeline).decode()
                    sums = (row["bubble_ratio_sum"] or 0.0, row["bubble_samples"] or 0) if row else (0.0, 0)
                    fields["bubble_ratio_sum"] = sums[0] + sample.pipeline.bubble_ratio
                    fields["bubble_samples"] = sums[1] + 1
            if row is None:
                c.execute(insert(launches).values(run=run, generation=generation, started_s=now_s, **fields))
            else:
                c.execute(update(launches).where(key).values(**fields))

    def launches(self, run: str) -> list[LaunchRow]:
        """What each launch of ``run`` measured, oldest first."""
        query = select(launches).where(launches.c.run == run).order_by(launches.c.generation)
        with self._tx() as c:
            rows = c.execute(query).mappings().all()
        return [
            LaunchRow(
                **{
                    **r,
                    "comm": json.loads(r["comm"]),
                    "pipeline": decode_bubble(r["pipeline"]),
                }
            )
            for r in rows
        ]

    # -- Flight Recorder dumps ---------------------------------------------------------------------------------
    def add_flight_dump(
        self, *, run: str, trigger: str, rank: int, incident_id: int | None, received_s: float, body: str
    ) -> bool:
        """Keep a rank's dump; False when one is kept for (run, trigger, rank) already (the first one stays)."""
        row = {"run": run, "trigger": trigger, "rank": rank, "incident_id": incident_id}
        try:
            with self._tx() as c:
                c.execute(insert(flight_dumps).values(received_s=received_s, body=body, **row))
        except IntegrityError:
            return False
        return True

    def flight_dumps(self, run: str, trigger: str | None = None) -> list[FlightDumpRow]:
        """The dumps of ``run`` (of one trigger), by trigger and rank."""
        query = select(flight_dumps).where(flight_dumps.c.run == run, *_matching(flight_dumps, trigger=trigger))
        with self._tx() as c:
            rows = c.execute(query.order_by(flight_dumps.c.trigger, flight_dumps.c.rank)).mappings().all()
        return [_dump_row(r) for r in rows]

    def flight_dump(self, run: str, trigger: str, rank: int) -> FlightDumpRow | None:
        c_ = flight_dumps.c
        query = select(flight_dumps).where(c_.run == run, c_.trigger == trigger, c_.rank == rank)
        with self._tx() as c:
            row = c.execute(query).mappings().first()
        return _dump_row(row) if row else None

    def flight_ranks(self, run: str, trigger: str) -> set[int]:
        """The ranks with a dump kept for ``trigger`` (their bodies are not read)."""
        query = select(flight_dumps.c.rank).where(flight_dumps.c.run == run, flight_dumps.c.trigger == trigger)
        with self._tx() as c:
            return {int(r) for r in c.execute(query).scalars().all()}


def _run_row(row: RowMapping) -> RunRow:
    spec, groups, cadence = decode_spec(row["spec"]), decode_groups(row["groups"]), decode_cadence(row["cadence"])
    return RunRow(**{**row, "spec": spec, "state": RunState(row["state"]), "groups": groups, "cadence": cadence})


def _matching(table: Table, **given: object) -> list[ColumnElement[bool]]:
    """A query's conditions: each column of ``table`` equal to the value given for it (None: any value)."""
    return [table.c[column] == value for column, value in given.items() if value is not None]


def _active(name: str, run: str, now_s: float) -> NodeRow:
    return NodeRow(name, run, NodeRole.ACTIVE, "", "", 0, now_s)


def _node_row(row: RowMapping) -> NodeRow:
    return NodeRow(**{**row, "role": NodeRole(row["role"])})


def _incident_row(row: RowMapping) -> IncidentRow:
    return IncidentRow(**{**row, "kind": IncidentKind(row["kind"]), "state": IncidentState(row["state"])})


def _dump_row(row: RowMapping) -> FlightDumpRow:
    return FlightDumpRow(**{k: v for k, v in row.items() if k != "id"})


def _action_row(row: RowMapping) -> Action:
    r = dict(row)
    return Action(
        r["request_id"],
        r["incident_id"],
        r["run"],
        r["seq"],
        ActionKind(r["kind"]),
        json.loads(r["args"]),
        ActionState(r["state"]),
        r["created_s"],
        r["done_s"],
        json.loads(r["result"]) if r.get("result") else None,
    )
