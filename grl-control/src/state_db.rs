//! The controller's durable state in Postgres (`grl controller` with a database URL): the
//! pushed configs and the overrides, shared by every controller replica of a region.
//!
//! One row (`state`) holds the revision of the whole state; every change (a config push, an
//! override added or removed) locks it, bumps it and writes its rows in one transaction, and
//! notifies channel [`CHANNEL`] with the new revision on commit. Replicas compare their applied
//! revision with it and load what changed ([`StateDb::load_since`], in a repeatable-read
//! snapshot) on a notification, on a periodic poll (the fallback when a notification is
//! lost), and before a change of their own. The tables live in schema [`SCHEMA`], so the
//! database can be shared with rlc's store; the migrations are embedded
//! (`grl-control/migrations/postgres`).
//!
//! The URL's password never reaches a log line or an error message (see [`redact`]).

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Row};

/// A database URL: its `Debug` shows it without the password.
#[derive(Clone)]
pub struct DbUrl(pub String);

impl std::fmt::Debug for DbUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

use crate::audit::{self, Event};
use crate::overrides::Override;
use grl_wire::ConfigDoc;

/// The Postgres schema holding the controller's tables.
pub const SCHEMA: &str = "grl_controller";

/// The LISTEN/NOTIFY channel; the payload is the new revision.
pub const CHANNEL: &str = "grl_controller_state";

/// Config rows kept besides the current one (older ones are pruned on a push).
const CONFIGS_KEPT: i64 = 10;

/// Errors of the state database.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// Postgres answered with an error or could not be reached.
    #[error("state database: {0}")]
    Sql(#[from] sqlx::Error),
    /// The embedded migrations failed.
    #[error("state database migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A stored row does not parse (written by something else, or tampered with).
    #[error("state database: {0}")]
    Corrupt(String),
    /// The state moved on since this replica's revision: catch up and retry.
    #[error("the state changed meanwhile (revision {0})")]
    Stale(i64),
}

/// `url` with its password replaced by `***` (for logs).
pub fn redact(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            u.to_string()
        }
        Err(_) => "<unparsable database URL>".to_string(),
    }
}

/// Whether `url` carries a password (refused on the command line, where `ps` shows it).
pub fn has_password(url: &str) -> bool {
    reqwest::Url::parse(url).is_ok_and(|u| u.password().is_some())
}

/// What changed since a revision, read in one snapshot.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The state's revision.
    pub rev: i64,
    /// The revision of the current config (0: none pushed yet).
    pub config_rev: i64,
    /// The current config, when its revision differs from the one asked about.
    pub config: Option<ConfigDoc>,
    /// Every override stored (expired ones included until purged).
    pub overrides: Vec<Override>,
    /// The last override id handed out.
    pub next_override_id: u64,
}

/// The outcome of [`StateDb::put_config`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// The state's revision after the write.
    pub rev: i64,
    /// False when the version was already the current one (nothing written).
    pub changed: bool,
}

/// A connection pool to the controller's state database.
#[derive(Clone)]
pub struct StateDb {
    pool: PgPool,
}

impl StateDb {
    /// Connects (the schema is created when missing) and runs the embedded migrations.
    pub async fn connect(url: &str) -> Result<StateDb, DbError> {
        let base = PgConnectOptions::from_str(url)?;
        // The schema first (on a connection of its own), then a pool whose connections
        // resolve names in it. Two replicas creating it at once: one of them gets a unique
        // violation, and the caller retries.
        let mut conn = base.connect().await?;
        // Created only when missing: a role without CREATE on the database can use a schema
        // its administrator made.
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
                .bind(SCHEMA)
                .fetch_one(&mut conn)
                .await?;
        if !exists {
            sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
                .execute(&mut conn)
                .await?;
        }
        let _ = sqlx::Connection::close(conn).await;
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(3))
            .connect_with(base.options([("search_path", SCHEMA)]))
            .await?;
        sqlx::migrate!("./migrations/postgres").run(&pool).await?;
        Ok(StateDb { pool })
    }

    /// The pool (for LISTEN).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The current revision (a cheap poll).
    pub async fn rev(&self) -> Result<i64, DbError> {
        Ok(sqlx::query_scalar("SELECT rev FROM state WHERE id = 1")
            .fetch_one(&self.pool)
            .await?)
    }

    /// What changed since (`have_rev`, `have_config_rev`), or None when the revision is
    /// still `have_rev`. The config is read only when its revision differs.
    pub async fn load_since(
        &self,
        have_rev: i64,
        have_config_rev: i64,
    ) -> Result<Option<Snapshot>, DbError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query("SELECT rev, config_rev, next_override_id FROM state WHERE id = 1")
            .fetch_one(&mut *tx)
            .await?;
        let (rev, config_rev, next_id): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        if rev == have_rev {
            return Ok(None);
        }
        let config =
            if config_rev != have_config_rev && config_rev > 0 {
                let doc: String = sqlx::query_scalar("SELECT doc FROM configs WHERE rev = $1")
                    .bind(config_rev)
                    .fetch_optional(&mut *tx)
                    .await?
                    .ok_or_else(|| {
                        DbError::Corrupt(format!("no config row at revision {config_rev}"))
                    })?;
                Some(serde_json::from_str(&doc).map_err(|e| {
                    DbError::Corrupt(format!("config at revision {config_rev}: {e}"))
                })?)
            } else {
                None
            };
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT id, doc FROM overrides ORDER BY rev, id")
                .fetch_all(&mut *tx)
                .await?;
        let mut overrides = Vec::with_capacity(rows.len());
        for (id, doc) in rows {
            overrides.push(
                serde_json::from_str::<Override>(&doc)
                    .map_err(|e| DbError::Corrupt(format!("override `{id}`: {e}")))?,
            );
        }
        tx.commit().await?;
        Ok(Some(Snapshot {
            rev,
            config_rev,
            config,
            overrides,
            next_override_id: next_id.max(0) as u64,
        }))
    }

    /// Locks the state row for a change; its (rev, next_override_id).
    async fn lock(tx: &mut sqlx::PgConnection) -> Result<(i64, i64), DbError> {
        let row = sqlx::query("SELECT rev, next_override_id FROM state WHERE id = 1 FOR UPDATE")
            .fetch_one(&mut *tx)
            .await?;
        Ok((row.get(0), row.get(1)))
    }

    /// Writes `ev` to the audit log in the change's transaction.
    async fn audit(tx: &mut sqlx::PgConnection, ev: &Event) -> Result<(), DbError> {
        let text = serde_json::to_string(ev).map_err(|e| DbError::Corrupt(e.to_string()))?;
        sqlx::query(
            "INSERT INTO override_audit (at, action, override_id, doc) VALUES ($1, $2, $3, $4)",
        )
        .bind(ev.at.min(i64::MAX as u64) as i64)
        .bind(ev.action.as_str())
        .bind(&ev.id)
        .bind(&text)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    /// The newest `limit` events of the overrides' audit log, newest first.
    pub async fn history(&self, limit: usize) -> Result<Vec<Event>, DbError> {
        let rows: Vec<(i64, String)> =
            sqlx::query_as("SELECT seq, doc FROM override_audit ORDER BY seq DESC LIMIT $1")
                .bind(limit.min(audit::KEPT_EVENTS) as i64)
                .fetch_all(&self.pool)
                .await?;
        rows.into_iter()
            .map(|(seq, doc)| {
                serde_json::from_str(&doc)
                    .map_err(|e| DbError::Corrupt(format!("audit event {seq}: {e}")))
            })
            .collect()
    }

    /// Ends a change: the new revision stored and announced (on commit).
    /// Stores override `o` as written at revision `rev`.
    async fn insert_override(
        tx: &mut sqlx::PgConnection,
        o: &Override,
        rev: i64,
    ) -> Result<(), DbError> {
        let text = serde_json::to_string(o).map_err(|e| DbError::Corrupt(e.to_string()))?;
        sqlx::query(
            "INSERT INTO overrides (id, doc, who, created_at, expires_at, rev) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&o.id)
        .bind(&text)
        .bind(&o.req.who)
        .bind(o.created_at.min(i64::MAX as u64) as i64)
        .bind(o.expires_at.min(i64::MAX as u64) as i64)
        .bind(rev)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    async fn bump(tx: &mut sqlx::PgConnection, rev: i64) -> Result<(), DbError> {
        sqlx::query("UPDATE state SET rev = $1 WHERE id = 1")
            .bind(rev)
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CHANNEL)
            .bind(rev.to_string())
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    /// Stores `doc` as the current config (already validated), unless its version is already
    /// the current one. Concurrent pushes are serialised on the state row: the last one to
    /// commit is the current config, and every replica converges on it.
    pub async fn put_config(&self, doc: &ConfigDoc, credential: &str) -> Result<Written, DbError> {
        let text = serde_json::to_string(doc).map_err(|e| DbError::Corrupt(e.to_string()))?;
        let mut tx = self.pool.begin().await?;
        let (rev, _) = Self::lock(&mut tx).await?;
        let current: Option<String> = sqlx::query_scalar(
            "SELECT c.version FROM configs c JOIN state s ON c.rev = s.config_rev WHERE s.id = 1",
        )
        .fetch_optional(&mut *tx)
        .await?;
        if current.as_deref() == Some(doc.version.as_str()) {
            tx.rollback().await?;
            return Ok(Written {
                rev,
                changed: false,
            });
        }
        let new = rev + 1;
        sqlx::query("INSERT INTO configs (rev, version, doc, credential) VALUES ($1, $2, $3, $4)")
            .bind(new)
            .bind(&doc.version)
            .bind(&text)
            .bind(credential)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE state SET config_rev = $1 WHERE id = 1")
            .bind(new)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "DELETE FROM configs WHERE rev < (SELECT min(rev) FROM (SELECT rev FROM configs ORDER BY rev DESC LIMIT $1) k)",
        )
        .bind(CONFIGS_KEPT + 1)
        .execute(&mut *tx)
        .await?;
        Self::bump(&mut tx, new).await?;
        tx.commit().await?;
        Ok(Written {
            rev: new,
            changed: true,
        })
    }

    /// Adds an override made by `make` from the next id (`ovr-N`). `expect_rev` is the
    /// revision the caller checked the override against: when the state moved on meanwhile,
    /// nothing is written and [`DbError::Stale`] says so (catch up, check again, retry).
    pub async fn add_override<E>(
        &self,
        expect_rev: i64,
        make: impl FnOnce(u64) -> Result<Override, E>,
    ) -> Result<Result<(Override, i64), E>, DbError> {
        let mut tx = self.pool.begin().await?;
        let (rev, next_id) = Self::lock(&mut tx).await?;
        if rev != expect_rev {
            return Err(DbError::Stale(rev));
        }
        let next_id = next_id + 1;
        let o = match make(next_id as u64) {
            Ok(o) => o,
            Err(e) => return Ok(Err(e)),
        };
        let new = rev + 1;
        Self::insert_override(&mut tx, &o, new).await?;
        Self::audit(&mut tx, &Event::created(&o)).await?;
        sqlx::query("UPDATE state SET next_override_id = $1 WHERE id = 1")
            .bind(next_id)
            .execute(&mut *tx)
            .await?;
        Self::bump(&mut tx, new).await?;
        tx.commit().await?;
        Ok(Ok((o, new)))
    }

    /// Removes override `id` (at `now`, by `by`, for `reason`, through `credential`: the
    /// audit log's entry); the override removed and the new revision, or None when there is no
    /// such override.
    pub async fn remove_override(
        &self,
        id: &str,
        now: u64,
        by: &str,
        reason: &str,
        credential: &str,
    ) -> Result<Option<(Override, i64)>, DbError> {
        let mut tx = self.pool.begin().await?;
        let (rev, _) = Self::lock(&mut tx).await?;
        let doc: Option<String> =
            sqlx::query_scalar("DELETE FROM overrides WHERE id = $1 RETURNING doc")
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(doc) = doc else {
            tx.rollback().await?;
            return Ok(None);
        };
        let o: Override = serde_json::from_str(&doc)
            .map_err(|e| DbError::Corrupt(format!("override `{id}`: {e}")))?;
        Self::audit(&mut tx, &Event::removed(&o, now, by, reason, credential)).await?;
        Self::bump(&mut tx, rev + 1).await?;
        tx.commit().await?;
        Ok(Some((o, rev + 1)))
    }

    /// Deletes the overrides expired at `unix_now` (every replica stops applying them by the
    /// clock, so this is housekeeping and bumps no revision), writing their `expired` events
    /// (the replica whose delete takes a row writes its event: once), and trims the audit log
    /// to its newest [`audit::KEPT_EVENTS`] events; how many overrides were deleted.
    pub async fn purge_expired(&self, unix_now: u64) -> Result<u64, DbError> {
        let mut tx = self.pool.begin().await?;
        let docs: Vec<(String, String)> =
            sqlx::query_as("DELETE FROM overrides WHERE expires_at <= $1 RETURNING id, doc")
                .bind(unix_now.min(i64::MAX as u64) as i64)
                .fetch_all(&mut *tx)
                .await?;
        for (id, doc) in &docs {
            let o: Override = serde_json::from_str(doc)
                .map_err(|e| DbError::Corrupt(format!("override `{id}`: {e}")))?;
            Self::audit(&mut tx, &Event::expired(&o)).await?;
        }
        sqlx::query(
            "DELETE FROM override_audit WHERE seq <= (SELECT max(seq) FROM override_audit) - $1",
        )
        .bind(audit::KEPT_EVENTS as i64)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(docs.len() as u64)
    }

    /// Imports a state into an empty database (revision 0): the config and the overrides a
    /// controller had in its state directory before it was given a database. Returns false
    /// (and writes nothing) when the database already holds a state.
    pub async fn import_if_empty(
        &self,
        config: Option<&ConfigDoc>,
        overrides: &[Override],
        next_override_id: u64,
    ) -> Result<bool, DbError> {
        let mut tx = self.pool.begin().await?;
        let (rev, _) = Self::lock(&mut tx).await?;
        if rev != 0 || (config.is_none() && overrides.is_empty()) {
            tx.rollback().await?;
            return Ok(false);
        }
        let new = 1;
        if let Some(doc) = config {
            let text = serde_json::to_string(doc).map_err(|e| DbError::Corrupt(e.to_string()))?;
            sqlx::query(
                "INSERT INTO configs (rev, version, doc, credential) VALUES ($1, $2, $3, 'import')",
            )
            .bind(new)
            .bind(&doc.version)
            .bind(&text)
            .execute(&mut *tx)
            .await?;
            sqlx::query("UPDATE state SET config_rev = $1 WHERE id = 1")
                .bind(new)
                .execute(&mut *tx)
                .await?;
        }
        for o in overrides {
            Self::insert_override(&mut tx, o, new).await?;
        }
        sqlx::query("UPDATE state SET next_override_id = $1 WHERE id = 1")
            .bind(next_override_id.min(i64::MAX as u64) as i64)
            .execute(&mut *tx)
            .await?;
        Self::bump(&mut tx, new).await?;
        tx.commit().await?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::overrides::OverrideRequest;

    fn doc(version: &str) -> ConfigDoc {
        ConfigDoc {
            version: version.to_string(),
            services: Vec::new(),
            candidates: Vec::new(),
        }
    }

    fn ovr(id: u64, created_at: u64, ttl: u64) -> Override {
        Override {
            id: format!("ovr-{id}"),
            req: OverrideRequest {
                service: None,
                bucket: None,
                caller: Some("gw".into()),
                procedure: None,
                limit_rps: Some(10.0),
                drop_ratio: None,
                shed_below: None,
                ttl_secs: ttl,
                reason: "INC-1".into(),
                who: "carol".into(),
            },
            created_at,
            expires_at: created_at + ttl,
            credential: Some("oncall".into()),
        }
    }

    /// Two replicas' pools on one fresh database.
    async fn two_replicas() -> (StateDb, StateDb) {
        let db = test_support::postgres::fresh_database().await.unwrap();
        let a = StateDb::connect(&db.url).await.unwrap();
        let b = StateDb::connect(&db.url).await.unwrap();
        (a, b)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_pushes_get_distinct_increasing_revisions_and_the_last_one_wins() {
        let (a, b) = two_replicas().await;
        let pushes = (0..12).map(|i| {
            let db = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move { db.put_config(&doc(&format!("v{i}")), "rlc").await })
        });
        let mut revs = Vec::new();
        for p in pushes {
            let w = p.await.unwrap().unwrap();
            assert!(w.changed);
            revs.push(w.rev);
        }
        revs.sort();
        assert_eq!(
            revs,
            (1..=12).collect::<Vec<i64>>(),
            "one revision each, none lost"
        );
        // Both replicas load the same head: the config of the highest revision.
        let (sa, sb) = (
            a.load_since(0, 0).await.unwrap().unwrap(),
            b.load_since(0, 0).await.unwrap().unwrap(),
        );
        assert_eq!((sa.rev, sa.config_rev), (12, 12));
        assert_eq!(sa.config, sb.config);
        let head: String = sqlx::query_scalar("SELECT version FROM configs WHERE rev = 12")
            .fetch_one(a.pool())
            .await
            .unwrap();
        assert_eq!(sa.config.unwrap().version, head);
        // Pushing the current version again changes nothing.
        let again = b.put_config(&doc(&head), "rlc").await.unwrap();
        assert_eq!(
            again,
            Written {
                rev: 12,
                changed: false
            }
        );
        // Old configs are pruned to a bounded number of rows.
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM configs")
            .fetch_one(a.pool())
            .await
            .unwrap();
        assert_eq!(rows, CONFIGS_KEPT + 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn override_ids_are_unique_and_a_stale_revision_writes_nothing() {
        let (a, b) = two_replicas().await;
        let (o1, r1) = a
            .add_override(0, |id| Ok::<_, ()>(ovr(id, 1_000, 60)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((o1.id.as_str(), r1), ("ovr-1", 1));
        // Replica b still thinks the state is at revision 0: refused, nothing written.
        match b
            .add_override(0, |id| Ok::<_, ()>(ovr(id, 1_000, 60)))
            .await
        {
            Err(DbError::Stale(1)) => {}
            other => panic!("expected Stale(1), got {other:?}"),
        }
        // A refusal by the caller's check writes nothing either.
        assert_eq!(b.add_override(1, |_| Err("no")).await.unwrap(), Err("no"));
        assert_eq!(b.rev().await.unwrap(), 1);
        // Caught up, b adds the next id.
        let (o2, r2) = b
            .add_override(1, |id| Ok::<_, ()>(ovr(id, 1_000, 60)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((o2.id.as_str(), r2), ("ovr-2", 2));
        let snap = a.load_since(1, 0).await.unwrap().unwrap();
        assert_eq!(snap.overrides, vec![o1.clone(), o2.clone()]);
        assert_eq!(snap.next_override_id, 2);
        assert!(snap.config.is_none(), "no config pushed: none loaded");
        // Removal: by either replica, once.
        let (gone, r3) = a
            .remove_override("ovr-1", 1_005, "dave", "resolved", "oncall")
            .await
            .unwrap()
            .unwrap();
        assert_eq!((gone, r3), (o1, 3));
        assert!(b
            .remove_override("ovr-1", 1_006, "erin", "", "oncall")
            .await
            .unwrap()
            .is_none());
        assert_eq!(b.rev().await.unwrap(), 3);
        // The audit log, as either replica reads it: created twice, removed once.
        let log: Vec<(audit::Action, String, String)> = b
            .history(10)
            .await
            .unwrap()
            .into_iter()
            .map(|e| (e.action, e.id, e.by))
            .collect();
        assert_eq!(
            log,
            [
                (audit::Action::Removed, "ovr-1".into(), "dave".into()),
                (audit::Action::Created, "ovr-2".into(), "carol".into()),
                (audit::Action::Created, "ovr-1".into(), "carol".into()),
            ]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn expired_overrides_are_purged_without_a_new_revision() {
        let (a, _) = two_replicas().await;
        a.add_override(0, |id| Ok::<_, ()>(ovr(id, 1_000, 10)))
            .await
            .unwrap()
            .unwrap();
        a.add_override(1, |id| Ok::<_, ()>(ovr(id, 1_000, 100)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(a.purge_expired(1_009).await.unwrap(), 0, "not yet expired");
        assert_eq!(a.purge_expired(1_010).await.unwrap(), 1);
        let snap = a.load_since(0, 0).await.unwrap().unwrap();
        assert_eq!(snap.rev, 2, "expiry is by the clock: no revision");
        let ids: Vec<&str> = snap.overrides.iter().map(|o| o.id.as_str()).collect();
        assert_eq!(ids, ["ovr-2"]);
        assert_eq!(snap.next_override_id, 2, "ids are never handed out again");
        // The expiry is in the audit log once, however many replicas purge.
        assert_eq!(a.purge_expired(1_011).await.unwrap(), 0);
        let expired: Vec<String> = a
            .history(10)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.action == audit::Action::Expired)
            .map(|e| e.id)
            .collect();
        assert_eq!(expired, ["ovr-1"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn catch_up_reads_only_what_changed() {
        let (a, b) = two_replicas().await;
        assert!(
            b.load_since(0, 0).await.unwrap().is_none(),
            "empty: nothing"
        );
        a.put_config(&doc("v1"), "rlc").await.unwrap();
        let s1 = b.load_since(0, 0).await.unwrap().unwrap();
        assert_eq!(s1.config.as_ref().map(|c| c.version.as_str()), Some("v1"));
        assert!(b.load_since(s1.rev, s1.config_rev).await.unwrap().is_none());
        // An override changes the revision but not the config: the config is not read again.
        a.add_override(1, |id| Ok::<_, ()>(ovr(id, 1_000, 60)))
            .await
            .unwrap()
            .unwrap();
        let s2 = b.load_since(s1.rev, s1.config_rev).await.unwrap().unwrap();
        assert_eq!((s2.rev, s2.config_rev), (2, 1));
        assert!(s2.config.is_none());
        assert_eq!(s2.overrides.len(), 1);
        // A replica joining late (revision -1) gets everything.
        let all = b.load_since(-1, -1).await.unwrap().unwrap();
        assert_eq!(all.config.unwrap().version, "v1");
        // Import happens into an empty database only.
        assert!(!b
            .import_if_empty(Some(&doc("local")), &[], 0)
            .await
            .unwrap());
        let (c, _) = two_replicas().await;
        assert!(c
            .import_if_empty(Some(&doc("local")), &[ovr(3, 1_000, 60)], 3)
            .await
            .unwrap());
        let imported = c.load_since(0, 0).await.unwrap().unwrap();
        assert_eq!(imported.config.unwrap().version, "local");
        assert_eq!(imported.next_override_id, 3);
        assert_eq!(imported.overrides[0].id, "ovr-3");
    }

    #[test]
    fn passwords_are_redacted() {
        let u = "postgres://grl:hunter2@db:5432/grl?sslmode=require";
        assert!(has_password(u));
        assert!(!redact(u).contains("hunter2"), "{}", redact(u));
        assert!(!format!("{:?}", DbUrl(u.into())).contains("hunter2"));
        assert!(!has_password("postgres://grl@db/grl"));
        assert_eq!(redact("not a url"), "<unparsable database URL>");
    }
}
