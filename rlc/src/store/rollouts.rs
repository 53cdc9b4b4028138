//! The rollouts' rows (`rollouts`, `rollout_counts`): rlc's rollout driver (`rlc::rollout`)
//! keeps each rollout as a JSON document and the controllers' candidate counts per region and
//! controller process (epoch). The same statements on both backends.

use super::{Store, StoreError};

/// One row of `rollouts`.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct RolloutRow {
    /// The rollout's (and its candidate's) id.
    pub id: String,
    /// Callee service.
    pub service: String,
    /// Bucket.
    pub bucket: String,
    /// baking | done | aborted | superseded.
    pub state: String,
    /// Unix ms it was created.
    pub created_ms: i64,
    /// Unix ms of its last change.
    pub updated_ms: i64,
    /// The rollout as JSON.
    pub doc: String,
    /// Its revision: 0 when inserted, one more at each update ([`Store::update_rollout`]).
    pub rev: i64,
}

/// One row of `rollout_counts`: a controller process's cumulative counts of one candidate.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct CountRow {
    /// The rollout.
    pub rollout_id: String,
    /// The controller's region.
    pub region: String,
    /// The controller process (`epoch` of `GET /v1/candidates`).
    pub epoch: String,
    /// Seconds it evaluated the candidate.
    pub seconds: f64,
    /// Requests offered to the bucket.
    pub offered: f64,
    /// Requests the candidate would have refused.
    pub virtual_dropped: f64,
    /// Requests the limit in force refused meanwhile.
    pub enforced_dropped: f64,
    /// Unix ms of the last update.
    pub updated_ms: i64,
}

const COLS: &str = "id, service, bucket, state, created_ms, updated_ms, doc, rev";

impl Store {
    /// Inserts a new rollout at revision 0; `false` when a rollout of that id is already
    /// stored (left as it is: another process created it).
    pub async fn insert_rollout(&self, r: &RolloutRow) -> Result<bool, StoreError> {
        on_pool!(self, pool => {
            let n = sqlx::query(
                "INSERT INTO rollouts (id, service, bucket, state, created_ms, updated_ms, doc, rev) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, 0) ON CONFLICT (id) DO NOTHING",
            )
            .bind(&r.id)
            .bind(&r.service)
            .bind(&r.bucket)
            .bind(&r.state)
            .bind(r.created_ms)
            .bind(r.updated_ms)
            .bind(&r.doc)
            .execute(pool)
            .await?
            .rows_affected();
            Ok(n == 1)
        })
    }

    /// Replaces a stored rollout's state, time and document if it is still at revision
    /// `r.rev` (the one it was read at), and moves it to `r.rev + 1`; `false` (nothing written)
    /// when another writer changed or deleted it since.
    pub async fn update_rollout(&self, r: &RolloutRow) -> Result<bool, StoreError> {
        on_pool!(self, pool => {
            let n = sqlx::query(
                "UPDATE rollouts SET state = $2, updated_ms = $3, doc = $4, rev = rev + 1 \
                 WHERE id = $1 AND rev = $5",
            )
            .bind(&r.id)
            .bind(&r.state)
            .bind(r.updated_ms)
            .bind(&r.doc)
            .bind(r.rev)
            .execute(pool)
            .await?
            .rows_affected();
            Ok(n == 1)
        })
    }

    /// Rollouts in `states`, oldest first.
    pub async fn rollouts_in(&self, states: &[&str]) -> Result<Vec<RolloutRow>, StoreError> {
        let mut out = Vec::new();
        for st in states {
            let q = format!("SELECT {COLS} FROM rollouts WHERE state = $1 ORDER BY created_ms, id");
            let rows: Vec<RolloutRow> =
                on_pool!(self, pool => sqlx::query_as(&q).bind(*st).fetch_all(pool).await?);
            out.extend(rows);
        }
        out.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        Ok(out)
    }

    /// The newest `limit` rollouts, newest first (of one bucket when given).
    pub async fn recent_rollouts(
        &self,
        bucket: Option<(&str, &str)>,
        limit: i64,
    ) -> Result<Vec<RolloutRow>, StoreError> {
        Ok(match bucket {
            Some((service, name)) => {
                let q = format!(
                    "SELECT {COLS} FROM rollouts WHERE service = $1 AND bucket = $2 \
                     ORDER BY created_ms DESC, id DESC LIMIT $3"
                );
                on_pool!(self, pool => sqlx::query_as(&q).bind(service).bind(name).bind(limit).fetch_all(pool).await?)
            }
            None => {
                let q = format!(
                    "SELECT {COLS} FROM rollouts ORDER BY created_ms DESC, id DESC LIMIT $1"
                );
                on_pool!(self, pool => sqlx::query_as(&q).bind(limit).fetch_all(pool).await?)
            }
        })
    }

    /// Records a controller process's cumulative counts of a candidate (the newest figures of
    /// that process replace its older ones).
    pub async fn record_candidate_counts(&self, rows: &[CountRow]) -> Result<(), StoreError> {
        for c in rows {
            on_pool!(self, pool => {
                sqlx::query(
                    "INSERT INTO rollout_counts (rollout_id, region, epoch, seconds, offered, \
                     virtual_dropped, enforced_dropped, updated_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
                     ON CONFLICT (rollout_id, region, epoch) DO UPDATE SET seconds = excluded.seconds, \
                     offered = excluded.offered, virtual_dropped = excluded.virtual_dropped, \
                     enforced_dropped = excluded.enforced_dropped, updated_ms = excluded.updated_ms",
                )
                .bind(&c.rollout_id)
                .bind(&c.region)
                .bind(&c.epoch)
                .bind(c.seconds)
                .bind(c.offered)
                .bind(c.virtual_dropped)
                .bind(c.enforced_dropped)
                .bind(c.updated_ms)
                .execute(pool)
                .await?;
            });
        }
        Ok(())
    }

    /// Deletes the rollouts in state `state` last changed before `before_ms`, with their
    /// counts (one transaction); returns how many rollouts went.
    pub async fn delete_rollouts_before(
        &self,
        state: &str,
        before_ms: i64,
    ) -> Result<u64, StoreError> {
        on_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            sqlx::query(
                "DELETE FROM rollout_counts WHERE rollout_id IN \
                 (SELECT id FROM rollouts WHERE state = $1 AND updated_ms < $2)",
            )
            .bind(state)
            .bind(before_ms)
            .execute(&mut *tx)
            .await?;
            let n = sqlx::query("DELETE FROM rollouts WHERE state = $1 AND updated_ms < $2")
                .bind(state)
                .bind(before_ms)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            Ok(n)
        })
    }

    /// Deletes the rollouts `ids` with their counts (one transaction); returns how many went.
    pub async fn delete_rollouts(&self, ids: &[String]) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        on_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            let mut n = 0;
            for id in ids {
                sqlx::query("DELETE FROM rollout_counts WHERE rollout_id = $1")
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                n += sqlx::query("DELETE FROM rollouts WHERE id = $1")
                    .bind(id)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
            }
            tx.commit().await?;
            Ok(n)
        })
    }

    /// Every count row of a rollout.
    pub async fn candidate_counts(&self, rollout_id: &str) -> Result<Vec<CountRow>, StoreError> {
        on_pool!(self, pool => Ok(sqlx::query_as(
            "SELECT rollout_id, region, epoch, seconds, offered, virtual_dropped, enforced_dropped, \
             updated_ms FROM rollout_counts WHERE rollout_id = $1 ORDER BY region, epoch",
        )
        .bind(rollout_id)
        .fetch_all(pool)
        .await?))
    }
}
