"""The state store's schema (SQLAlchemy Core tables: runs, nodes, incidents, the action timeline, Flight Recorder
dumps, what each launch measured) and its engine: SQLite in WAL mode (the CLI reads while the controller writes),
or PostgreSQL by URL."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    inspect,
    text,
)
from sqlalchemy.exc import SQLAlchemyError

from opsd.errors import ConfigError

log = logging.getLogger(__name__)

metadata = MetaData()

runs = Table(
    "runs",
    metadata,
    Column("id", String(200), primary_key=True),
    # running | recovering | waiting_for_spare | completed | failed | stopped
    Column("state", String(32), nullable=False),
    Column("spec", Text, nullable=False),  # JSON: what the run was started with
    Column("created_s", Float, nullable=False),
    Column("updated_s", Float, nullable=False),
    Column("generation", Integer, nullable=False, default=0),  # launches so far (0: not launched)
    Column("last_step", Integer, nullable=False, default=0),
    Column("final_step", Integer),
    Column("first_productive_s", Float),  # its first productive step (the end of its launch and initialisation)
    Column("groups", Text),  # JSON: a fault-tolerant run's replica groups, their launch and nodes (rows.GroupLaunch)
    Column("cadence", Text),  # JSON: the checkpoint cadence last published to its ranks (rows.PublishedCadence)
)

nodes = Table(
    "nodes",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("run", String(200)),  # the run it serves (active or spare), or None
    Column("role", String(32), nullable=False),  # active | spare | cordoned
    Column("domain", String(200), nullable=False, default=""),
    Column("reason", Text, nullable=False, default=""),  # why it was cordoned
    Column("events_acked", Integer, nullable=False, default=0),  # GPU events handled, up to this seq
    Column("updated_s", Float, nullable=False),
)

incidents = Table(
    "incidents",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key", String(400), nullable=False, unique=True),
    Column("run", String(200), nullable=False),
    Column("kind", String(64), nullable=False),
    Column("node", String(200), nullable=False),
    Column("rank", Integer),
    Column("detail", Text, nullable=False),
    Column("state", String(32), nullable=False),  # open | recovered | abandoned
    Column("failed_s", Float, nullable=False),
    Column("detected_s", Float, nullable=False),
    Column("resumed_s", Float),
    Column("resumed_from_step", Integer),
    Column("lost_steps", Integer),
    Column("spare", String(200)),
    # the incident's OpenTelemetry trace (W3C hex), when the controller exports traces; and the agent's span of the
    # GPU event that caused it, which the trace links to
    Column("trace_id", String(32)),
    Column("gpu_trace_id", String(32)),
    Column("gpu_span_id", String(16)),
    # a replica recovery (one group of a fault-tolerant run stopped, the others trained on): its group, the steps the
    # others made while it was out, and the longest they waited for a quorum meanwhile
    Column("replica_group", Integer),
    Column("missed_steps", Integer),
    Column("stall_s", Float),
)

actions = Table(
    "actions",
    metadata,
    Column("request_id", String(200), primary_key=True),
    Column("incident_id", Integer, ForeignKey("incidents.id")),
    Column("run", String(200), nullable=False),
    Column("seq", Integer, nullable=False),  # order within the incident
    Column("kind", String(64), nullable=False),
    Column("args", Text, nullable=False),  # JSON
    Column("state", String(16), nullable=False),  # pending | done
    Column("created_s", Float, nullable=False),
    Column("done_s", Float),
    Column("result", Text),  # JSON: what it did (the spare chosen, the nodes launched on), once done
)

flight_dumps = Table(
    "flight_dumps",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run", String(200), nullable=False),
    Column("trigger", String(200), nullable=False),  # incident-<id>, timeout-<rank>-<step>, or a command's id
    Column("rank", Integer, nullable=False),
    Column("incident_id", Integer),
    Column("received_s", Float, nullable=False),
    Column("body", Text, nullable=False),  # the dump as the rank wrote it (JSON; docs/flight-recorder.md)
    UniqueConstraint("run", "trigger", "rank"),
)


holds = Table(
    "holds",
    metadata,
    # a maintenance window: recovery actions held for one run, or for every run ("")
    Column("scope", String(200), primary_key=True),
    Column("reason", Text, nullable=False, default=""),
    Column("since_s", Float, nullable=False),
)

launches = Table(
    "launches",
    metadata,
    Column("run", String(200), primary_key=True),
    Column("generation", Integer, primary_key=True),
    Column("started_s", Float, nullable=False),  # first recorded
    Column("updated_s", Float, nullable=False),
    Column("first_step", Integer),  # the first and newest steps its ranks reported
    Column("last_step", Integer),
    Column("ranks", Integer, nullable=False, default=0),  # heard from, at most
    # the job's MFU and tokens/s: sums over the samples taken while it progressed, and the last sample
    Column("samples", Integer, nullable=False, default=0),
    Column("mfu_ratio_sum", Float, nullable=False, default=0.0),
    Column("tokens_per_s_sum", Float, nullable=False, default=0.0),
    Column("mfu_ratio_last", Float),
    Column("tokens_per_s_last", Float),
    Column("comm", Text, nullable=False, default="{}"),  # JSON {"phase;dimension;op": seconds}: its collectives
    # a pipelined launch's bubble: the last sample (JSON, as the run's status has it) and a sum over the samples
    Column("pipeline", Text),
    Column("bubble_ratio_sum", Float),
    Column("bubble_samples", Integer),
)


def _sqlite_pragmas(dbapi_connection: Any, _: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


SCHEMA_LOCK_KEY = 0x6F707364  # "opsd": the advisory lock held while the tables are created


def add_columns(conn: Connection) -> None:
    """Add to a store's tables the columns this version has and they lack (a store created by an earlier version;
    every column added since the first version is nullable, so rows already there stay valid)."""
    inspector = inspect(conn)
    for table in metadata.sorted_tables:
        have = {column["name"] for column in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in have:
                continue
            if not column.nullable:
                raise ConfigError(f"state store: table {table.name} lacks column {column.name}, which needs a value")
            kind = column.type.compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}"))
            log.info("state store: column %s.%s (%s) added", table.name, column.name, kind)


def open_engine(url: str) -> Engine:
    """An engine for ``sqlite:///path`` (WAL) or ``postgresql+psycopg://...``; the tables are created if missing."""
    if not url.startswith(("sqlite:", "postgresql")):
        raise ConfigError(f"state URL {url!r}: expected sqlite:///path or postgresql+psycopg://...")
    try:
        # a connection to a server may have been dropped while pooled; a file's may not
        engine = create_engine(url, pool_pre_ping=not url.startswith("sqlite:"))
        if engine.dialect.name == "sqlite":
            event.listen(engine, "connect", _sqlite_pragmas)
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":  # replicas that start together create the tables once
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
            metadata.create_all(conn)
            add_columns(conn)
    except SQLAlchemyError as exc:
        raise ConfigError(f"state URL {url!r}: {exc}") from exc
    return engine
