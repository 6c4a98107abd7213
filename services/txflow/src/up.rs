//! `txflow up`: everything in one process, for development.

use clap::Args;
use tokio_util::sync::CancellationToken;
use txflow_core::codec::RegistryCodec;
use txflow_core::config::Config;
use txflow_core::role::Role;

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Set everything up, report, and exit instead of running until Ctrl-C.
    #[arg(long)]
    once: bool,
}

pub async fn run(config: &Config, mut args: UpArgs) -> anyhow::Result<()> {
    let pool = txflow_core::db::connect(&config.database_url, 4).await?;
    let migrations = txflow_core::db::migrate(&pool).await?;
    println!(
        "postgres      {}  ({migrations} migration(s) applied)",
        txflow_core::config::redact_database_url(&config.database_url)
    );

    let topics = config.topics.all();
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

    println!("\nroles:");
    let shutdown = if args.once {
        CancellationToken::new()
    } else {
        crate::roles::shutdown_root()?
    };
    let mut running = tokio::task::JoinSet::new();
    // One set of clients for every role of this process.
    let stages: u32 = Role::PIPELINE
        .iter()
        .map(|r| crate::roles::stages_of(*r))
        .sum();
    let deps = crate::roles::deps(config, stages).await?;
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
    let mut ticker = tokio::time::interval(std::time::Duration::from_millis(200));
    ticker.tick().await;
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
            _ = ticker.tick(), if args.once => {
                shutdown.cancel();
            }
            () = shutdown.cancelled(), if !args.once => {
                println!("shutting down");
                // Wait for the roles to finish (the next join_next), not for the signal again.
                args.once = true;
            }
            else => break,
        }
        if live == 0 {
            break;
        }
    }
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
