"""The throwaway PostgreSQL server the multi-host tests use (tests/postgres.py): a real server
reached by `postgresql://` URL with psycopg2, one database per test, nothing left running."""

import pytest

pytestmark = pytest.mark.slow


def test_each_test_gets_its_own_database_reachable_by_url(postgres_url, postgres_cluster):
    import psycopg2

    other = postgres_cluster.create_database("other_db")
    with psycopg2.connect(postgres_url) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE t (x int)")
        cur.execute("INSERT INTO t VALUES (42)")
    with psycopg2.connect(postgres_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT x FROM t")
        assert cur.fetchall() == [(42,)]
    with psycopg2.connect(other) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_tables WHERE tablename = 't'")
        assert cur.fetchone() == (0,), "a new database is empty"
    with pytest.raises(psycopg2.OperationalError, match="password"):
        psycopg2.connect(postgres_url.replace(":draftlab-test@", ":wrong@")).close()


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
