//! A test cluster that stopped answering is reported with why, not as a bare connection error:
//! a disk that filled mid-run once ended the shared cluster and failed every later test of the
//! run with errors that did not say so (CI, 2026-12-07).

use outbox_testkit::postgres::TestPostgres;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_that_is_gone_is_reported_with_its_state_free_space_and_log() {
    // Its own cluster: this test stops it, which no other test may see happen to theirs.
    let pg = TestPostgres::start_throwaway(None).expect("a throwaway cluster");
    pg.create_database("alive")
        .await
        .expect("a database while it runs");
    assert!(
        pg.diagnosis().contains("its postmaster is running"),
        "{}",
        pg.diagnosis()
    );

    pg.stop();
    let err = pg
        .create_database("gone")
        .await
        .expect_err("no database once it is stopped")
        .to_string();
    for said in [
        "its postmaster is not running",
        "MiB free on its disk",
        "server.log",
    ] {
        assert!(err.contains(said), "{said:?} missing from: {err}");
    }
}
