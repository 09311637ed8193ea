"""The controller's state store, on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from opsd.controller.rows import PublishedCadence, RunSpec
from opsd.controller.state import StateStore
from opsd.errors import ConfigError
from opsd.policy.cadence import Cadence
from tests.rows import stored


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    if request.param == "sqlite":
        s = StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")
        yield s
        s.engine.dispose()
        return
    server: str = request.getfixturevalue("postgres_url")
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {name}"))
    s = StateStore.open(server.rsplit("/", 1)[0] + f"/{name}")
    yield s
    s.engine.dispose()
    with admin.connect() as c:
        c.execute(sa.text(f"DROP DATABASE {name}"))
    admin.dispose()


def test_runs(store: StateStore) -> None:
    assert store.create_run("r1", RunSpec(min_nodes=2), now_s=10.0)
    assert not store.create_run("r1", RunSpec(min_nodes=3), now_s=11.0)  # exists: unchanged
    store.update_run("r1", 12.0, state="recovering", generation=2, last_step=40)
    run = store.run("r1")
    assert run is not None
    assert (run.state, run.generation, run.last_step, run.spec) == ("recovering", 2, 40, RunSpec(min_nodes=2))
    assert [r.id for r in store.runs()] == ["r1"]
    assert store.run("nope") is None
    store.update_run("r1", 13.0, spec=RunSpec(min_nodes=3))
    assert stored(store.run("r1")).spec == RunSpec(min_nodes=3)
    with pytest.raises(ValueError, match="unknown fields"):
        store.update_run("r1", 13.0, created_s=1.0)


def test_a_runs_published_cadence_is_kept_without_touching_its_state(store: StateStore) -> None:
    store.create_run("r1", RunSpec(min_nodes=2), now_s=10.0)
    assert stored(store.run("r1")).cadence is None
    first = Cadence(500, 1200, 600.0, 3600.0, "Daly interval 600 s")
    second = Cadence(250, 1800, 300.0, 1800.0, "more failures")
    store.publish_cadence("r1", PublishedCadence(first))
    store.publish_cadence("r1", PublishedCadence(second, first))
    run = stored(store.run("r1"))
    assert (run.cadence, run.updated_s) == (PublishedCadence(second, first), 10.0)
    with store.engine.begin() as c:
        c.execute(sa.text("""UPDATE runs SET cadence = '{"current": 3}'"""))
    assert stored(store.run("r1")).cadence is None  # one that does not fit is read as none (and logged)


def test_nodes(store: StateStore) -> None:
    store.upsert_node("n0", 1.0, run="r1", role="active", domain="rack1")
    store.upsert_node("n2", 1.0, run="r1", role="spare")
    store.upsert_node("n0", 2.0, role="cordoned", reason="XID 79")
    n0 = store.node("n0")
    assert n0 is not None
    assert (n0.role, n0.reason, n0.domain, n0.updated_s) == ("cordoned", "XID 79", "rack1", 2.0)
    assert [n.name for n in store.nodes("r1")] == ["n0", "n2"]
    assert store.nodes("other") == []
    assert store.node_names("r1", "spare") == {"n2"}


def test_node_rows_kept_in_memory_are_those_of_the_database(store: StateStore) -> None:
    """Node rows are read once and written through: a store opened afresh on the same database reads the same."""
    store.upsert_node("n0", 1.0, run="r1", role="active")
    store.ack_events("n0", 5, 2.0)
    store.ack_events("n0", 3, 3.0)  # never back
    store.ack_events("n9", 2, 4.0)  # a node not seen yet
    again = StateStore(store.engine)
    assert again.nodes() == store.nodes()
    assert [(n.name, n.events_acked, n.role) for n in again.nodes()] == [
        ("n0", 5, "active"),
        ("n9", 2, "spare"),
    ]


def test_a_reload_reads_what_another_replica_wrote(store: StateStore) -> None:
    store.upsert_node("n0", 1.0, run="r1", role="active")
    other = StateStore(store.engine)  # another controller replica on the same database
    other.upsert_node("n0", 2.0, role="cordoned", reason="XID 79")
    assert stored(store.node("n0")).role == "active"  # its copy in memory
    store.reload()
    assert stored(store.node("n0")).role == "cordoned"


def test_replicas_that_start_together_create_the_tables_once(postgres_url: str) -> None:
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {name}"))
    url = postgres_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            stores = list(pool.map(lambda _: StateStore.open(url), range(6)))
        assert stores[0].create_run("r1", RunSpec(), 1.0)
        assert [r.id for r in stores[-1].runs()] == ["r1"]
        for s in stores:
            s.engine.dispose()
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


def test_the_same_failure_opens_one_incident(store: StateStore) -> None:
    args = {"run": "r1", "kind": "fatal_xid", "node": "n1", "rank": None, "detail": "XID 79", "failed_s": 5.0}
    first, new = store.open_incident(key="r1/1/n1/xid-3", detected_s=6.0, **args)  # type: ignore[arg-type]
    again, new_again = store.open_incident(key="r1/1/n1/xid-3", detected_s=7.0, **args)  # type: ignore[arg-type]
    assert new
    assert not new_again
    assert first == again
    store.update_incident(first, state="recovered", resumed_s=30.0, resumed_from_step=10, lost_steps=3, spare="n2")
    (incident,) = store.incidents("r1")
    assert (incident.state, incident.lost_steps, incident.spare, incident.detected_s) == (
        "recovered",
        3,
        "n2",
        6.0,
    )
    assert store.incidents("r1", state="open") == []


def test_actions_are_recorded_once_and_completed_once(store: StateStore) -> None:
    incident, _ = store.open_incident(
        key="k", run="r1", kind="hang", node="n0", rank=1, detail="d", failed_s=1.0, detected_s=2.0
    )
    a = store.record_action("req-1", run="r1", incident_id=incident, seq=0, kind="stop", args={"gen": 1}, now_s=3.0)
    b = store.record_action("req-1", run="r1", incident_id=incident, seq=0, kind="stop", args={"gen": 9}, now_s=4.0)
    assert a == b  # the first record stands
    assert (a.state, a.args) == ("pending", {"gen": 1})
    store.record_action("req-2", run="r1", incident_id=incident, seq=1, kind="launch", args={}, now_s=3.5)
    store.complete_action("req-1", 5.0, {"stopped": 4})
    store.complete_action("req-1", 6.0, {"stopped": 0})  # idempotent: the first completion stands
    done = store.action("req-1")
    assert done is not None
    assert (done.state, done.done_s, done.result) == ("done", 5.0, {"stopped": 4})
    assert [(x.request_id, x.state) for x in store.actions(incident_id=incident)] == [
        ("req-1", "done"),
        ("req-2", "pending"),
    ]


def test_state_survives_a_new_store_on_the_same_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'opsd.db'}"
    StateStore.open(url).create_run("r1", RunSpec(), now_s=1.0)
    assert [r.id for r in StateStore.open(url).runs()] == ["r1"]
    with sa.create_engine(url).connect() as c:
        assert c.execute(sa.text("PRAGMA journal_mode")).scalar() == "wal"


def test_a_store_of_an_earlier_version_gets_the_columns_added_since(store: StateStore) -> None:
    """A runs table without ``first_productive_s`` (as an earlier version created it), a run in it: opened again,
    the column is added and the run reads and updates as a new one does."""
    store.create_run("r1", RunSpec(min_nodes=2), now_s=10.0)
    with store.engine.begin() as c:
        c.execute(sa.text("ALTER TABLE runs DROP COLUMN first_productive_s"))
    url = store.engine.url.render_as_string(hide_password=False)
    store.engine.dispose()

    again = StateStore.open(url)
    try:
        assert "first_productive_s" in {c["name"] for c in sa.inspect(again.engine).get_columns("runs")}
        assert stored(again.run("r1")).first_productive_s is None
        again.update_run("r1", 12.0, first_productive_s=11.5)
        assert stored(again.run("r1")).first_productive_s == 11.5
    finally:
        again.engine.dispose()


def test_bad_urls_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected sqlite"):
        StateStore.open("mysql://x/y")
    with pytest.raises(ConfigError, match="state URL"):
        StateStore.open(f"sqlite:///{tmp_path}/missing/dir/opsd.db")
