//! Signer holds: a stage that cannot go on for a signer for a reason outside txflow (the account
//! cannot pay) holds it — sends nothing new, fails nothing — and raises an alert: a row in
//! `signer_holds` (what operators and dashboards read) and an ERROR `signer_held` event. The row
//! goes when the stage proceeds again (`signer_resumed`).
//!
//! Not fenced: a hold records an observation, it changes no transaction; the stage that holds the
//! lease is the only one acting on the signer anyway.

use sqlx::PgPool;

use crate::lease::LeaseKey;

/// Records (or refreshes) the hold and raises the alert when it is new.
pub async fn hold(pool: &PgPool, key: &LeaseKey, reason: &str) -> Result<(), sqlx::Error> {
    let (inserted,): (bool,) = sqlx::query_as(
        "INSERT INTO signer_holds (role, chain_id, signer, reason) VALUES ($1, $2, $3, $4)
         ON CONFLICT (role, chain_id, signer) DO UPDATE SET reason = EXCLUDED.reason, updated_at = now()
         RETURNING (xmax = 0)",
    )
    .bind(key.role.as_str())
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(reason)
    .fetch_one(pool)
    .await?;
    if inserted {
        tracing::error!(
            target: "txflow::alert",
            event = "signer_held",
            alert = true,
            role = %key.role,
            chain_id = key.chain_id.0,
            signer = %key.signer,
            reason,
            "signer held: nothing new is sent for it until this clears"
        );
    }
    Ok(())
}

/// Removes the hold, if there is one.
pub async fn resume(pool: &PgPool, key: &LeaseKey) -> Result<(), sqlx::Error> {
    let done =
        sqlx::query("DELETE FROM signer_holds WHERE role = $1 AND chain_id = $2 AND signer = $3")
            .bind(key.role.as_str())
            .bind(key.chain_id.0)
            .bind(key.signer.as_str())
            .execute(pool)
            .await?;
    if done.rows_affected() > 0 {
        tracing::warn!(
            target: "txflow::alert",
            event = "signer_resumed",
            role = %key.role,
            chain_id = key.chain_id.0,
            signer = %key.signer,
            "signer hold cleared"
        );
    }
    Ok(())
}
