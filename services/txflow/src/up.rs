//! `txflow up`: everything in one process, for development; `txflow up --once`: the setup alone.
//!
//! Setup (migrations, topics, schemas) uses PostgreSQL, the admin API and the registry only: it
//! never creates a consumer of a stage's group. `--once` reports the roles and exits without
//! starting them. (It used to start every role and stop it 200 ms later, while its consumer was
//! still joining; the local broker then kept that departed consumer as the group's leader for
//! ever, and role processes started afterwards never got a partition.)

use clap::Args;
use txflow_core::codec::RegistryCodec;
use txflow_core::config::Config;
use txflow_core::role::Role;

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Set everything up, report, and exit instead of running until Ctrl-C. No role is started
    /// and no stage's consumer group is joined: start the roles afterwards as `txflow <role>`.
    #[arg(long)]
    once: bool,
}

pub async fn run(config: &Config, args: UpArgs) -> anyhow::Result<()> {
    let pool = txflow_core::db::connect(&config.database_url, 4).await?;
    let migrations = txflow_core::db::migrate(&pool).await?;
    println!(
        "postgres      {}  ({migrations} migration(s) applied)",
        txflow_core::config::redact_database_url(&config.database_url)
    );

    let mut topics = config.topics.all();
    topics.extend(config.topics.transfers());
    topics.sort();
    topics.dedup();
    txflow_core::kafka::ensure_topics(&config.kafka, &topics, config.partitions).await?;
    println!(
        "kafka         {}  ({} topics, {} partitions each)",
        config.kafka.brokers,
        topics.len(),
        config.partitions
    );

    let codec = RegistryCodec::new(&config.schema_registry_url);
    let registered = codec.register_pipeline(&config.topics).await?;
    println!(
        "registry      {}  ({} schemas registered)",
        config.schema_registry_url,
        registered.len()
    );

    let k = &config.kafka;
    println!(
        "groups        {}.<stage>  (session timeout {} ms, heartbeat {} ms, static membership {})",
        config.group_prefix(),
        k.session_timeout_ms,
        k.effective_heartbeat_ms(),
        k.group_instance_id
            .as_deref()
            .map_or("off".to_string(), |id| format!("as {id}")),
    );

    println!("\nroles:");
    if args.once {
        // Setup only: joining a stage's group here and leaving at once would leave a departed
        // leader behind on the local broker (see the module documentation).
        for role in Role::ALL {
            println!("  {role:<22} ready, not started (run `txflow {role}`)");
        }
        return Ok(());
    }
    let shutdown = crate::roles::shutdown_root()?;
    let mut running = tokio::task::JoinSet::new();
    // One set of clients for every role of this process.
    let stages: u32 = Role::PIPELINE
        .iter()
        .chain([Role::TransferCoordinator].iter())
        .map(|r| crate::roles::stages_of(*r))
        .sum();
    let deps = crate::roles::deps(config, stages).await?;
    crate::roles::observe(&deps, &Role::PIPELINE, "txflow", &shutdown).await?;
    for role in Role::ALL {
        let deps = deps.clone();
        let token = shutdown.child_token();
        running.spawn(async move {
            // The role stops itself on the token: it finishes its batch and releases its leases.
            (role, crate::roles::run_role(role, &deps, token).await)
        });
    }
    // Roles that end on their own (not implemented yet, or failed) are reported as they end.
    let mut live = Role::ALL.len();
    let mut stopping = false;
    loop {
        tokio::select! {
            Some(joined) = running.join_next() => {
                live -= 1;
                match joined {
                    Ok((role, Ok(()))) => println!("  {role:<22} stopped"),
                    Ok((role, Err(e))) => println!("  {role:<22} {e:#}"),
                    Err(e) => println!("  a role task panicked: {e}"),
                }
            }
            () = shutdown.cancelled(), if !stopping => {
                println!("shutting down");
                // Wait for the roles to finish (the next join_next), not for the signal again.
                stopping = true;
            }
            else => break,
        }
        if live == 0 {
            break;
        }
    }
    shutdown.cancel();
    crate::roles::stop_metrics().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_are_not_printed() {
        assert_eq!(
            txflow_core::config::redact_database_url("postgres://u:secret@h/db"),
            "postgres://u:***@h/db"
        );
        assert_eq!(
            txflow_core::config::redact_database_url("postgres://u@h/db"),
            "postgres://u@h/db"
        );
    }
}
