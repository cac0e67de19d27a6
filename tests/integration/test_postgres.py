"""The throwaway PostgreSQL server the multi-host tests use (tests/postgres.py): a real server
reached by `postgresql://` URL, one database per test, nothing left running."""

import pytest


def test_each_test_gets_its_own_database_reachable_by_url(postgres_url, postgres_cluster):
    """A plain `postgresql://` URL, as in compose.yaml and `draftlab sweep --storage`, through
    SQLAlchemy (what MLflow and Optuna open it with: SQLAlchemy 2.1 picks psycopg 3 for it), and
    `postgresql+psycopg2://`."""
    import sqlalchemy as sa

    other = postgres_cluster.create_database("other_db")
    engine = sa.create_engine(postgres_url)
    assert engine.dialect.driver == "psycopg"
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (x int)"))
        conn.execute(sa.text("INSERT INTO t VALUES (42)"))
    with sa.create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg2://")).connect() as conn:
        assert conn.execute(sa.text("SELECT x FROM t")).all() == [(42,)]
    with sa.create_engine(other).connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM pg_tables WHERE tablename = 't'")).scalar() == 0, \
            "a new database is empty"
    with pytest.raises(sa.exc.OperationalError, match="password"):
        sa.create_engine(postgres_url.replace(":draftlab-test@", ":wrong@")).connect()


def test_stop_leaves_no_server_process_and_no_folder():
    from tests.conftest import descendants
    from tests.postgres import Cluster, _alive, find_bindir

    bindir, why = find_bindir()
    if bindir is None:
        pytest.skip(why)
    cluster = Cluster.start(bindir)
    pid = cluster._postmaster_pid()
    assert pid and _alive(pid) and pid in descendants(), "the server runs under this process tree"
    server = {pid, *descendants(pid)}  # postmaster, checkpointer, writers…
    assert len(server) > 1
    cluster.stop()
    assert not any(_alive(p) for p in server) and not cluster.root.exists()
