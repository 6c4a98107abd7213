//! `txflow`: one subcommand per service role, plus `up`, `migrate`, `replay`, `bench`, `demo`,
//! `chaos`, `signers` and `config`.
//!
//! Thin on purpose: it loads the configuration, starts logging and hands over to the crates.

mod bench;
mod bench_alloc;
mod bench_cpu;
mod bench_stage;
mod chaos;
mod demo;
mod demo_transfers;
mod local;
mod replay;
mod roles;
mod signers;
mod signers_store;
mod token;
mod up;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use txflow_core::config::Config;
use txflow_core::role::Role;

#[derive(Parser, Debug)]
#[command(
    name = "txflow",
    version,
    about = "Kafka-driven transaction manager for EVM signers"
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

/// Settings shared by every subcommand; each also reads its `TXFLOW_*` environment variable.
#[derive(Args, Debug)]
struct Global {
    /// A TOML configuration file (deploy/txflow.example.toml lists every key): above the
    /// built-in defaults, below the environment variables and these flags.
    #[arg(long, global = true, env = "TXFLOW_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// PostgreSQL URL.
    #[arg(long, global = true, env = "TXFLOW_DATABASE_URL")]
    database_url: Option<String>,
    /// Kafka bootstrap servers.
    #[arg(long, global = true, env = "TXFLOW_BROKERS")]
    brokers: Option<String>,
    /// Schema Registry URL.
    #[arg(long, global = true, env = "TXFLOW_SCHEMA_REGISTRY_URL")]
    schema_registry_url: Option<String>,
    /// Prefix of every topic name.
    #[arg(long, global = true, env = "TXFLOW_TOPIC_PREFIX")]
    topic_prefix: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Role: validate, simulate, approve and allocate nonces (RECEIVED → ALLOCATED).
    Allocator,
    /// Role: sign allocated transactions (ALLOCATED → SIGNED).
    SignerGateway,
    /// Role: send signed transactions (SIGNED → SUBMITTED).
    Broadcaster,
    /// Role: follow submitted transactions to a receipt (SUBMITTED → MINED/REVERTED/REPLACED).
    ReceiptChecker,
    /// Role: count confirmations and follow reorgs (MINED → CONFIRMED, newFork).
    ConfirmationManager,
    /// Role: move funds between the funding ledger and the trading core.
    TransferCoordinator,
    /// Role: the reference trading core (RAM balances + write-ahead log).
    SpotLedger,
    /// Role: the HTTP API.
    Gateway,
    /// Check the infrastructure, apply migrations, create topics, register schemas, then run
    /// every role in this one process until Ctrl-C (for development). With --once: the setup
    /// alone, joining no stage's consumer group.
    Up(up::UpArgs),
    /// Apply the database migrations.
    Migrate,
    /// Reset a consumer group's offsets (like kafka-consumer-groups --reset-offsets): prints the
    /// plan, and with --execute commits it; refused while the group has live members.
    Replay(replay::ReplayArgs),
    /// Load generator: drive the real pipeline (or one broker hop) and report throughput and
    /// latency.
    Bench(bench::BenchArgs),
    /// Start everything, push a few hundred requests and show the outcomes.
    Demo,
    /// The whole system on a chain, broker, registry and PostgreSQL cluster of its own, a seeded
    /// schedule of faults (kills, pauses, broker and database loss, reorgs, RPC faults, bad and
    /// duplicate input), and an oracle that checks the end state; one JSON line, exit 1 on a
    /// violation.
    Chaos(chaos::ChaosArgs),
    /// Print the effective configuration (defaults, file, environment, flags) as TOML, every
    /// secret redacted.
    Config,
    /// Each signer at a glance (cursor, chain nonces, in flight, holds, leases; --json for one
    /// object per signer), and `signers reset-nonce`, the operator's manual nonce reset.
    Signers(signers::SignersArgs),
    /// Mint an HS256 bearer token for the gateway (sub, scopes, lifetime) with the configured
    /// secret, audience and issuer; printed alone on stdout.
    Token(token::TokenArgs),
}

/// Logging, and trace export when `export` says so (an OTLP endpoint is configured): the
/// exporter is built inside `runtime` (its gRPC channel runs there), and the returned guard must
/// be shut down while `runtime` still runs.
fn init_logging(
    config: &Config,
    export: Option<&txflow_core::otel::TraceExport>,
    runtime: &tokio::runtime::Runtime,
) -> txflow_core::otel::Telemetry {
    use tracing_subscriber::EnvFilter;
    let mut filter =
        EnvFilter::try_new(&config.log_filter).unwrap_or_else(|_| EnvFilter::new("info"));
    // alloy's HTTP transport opens a debug span that records the endpoint's full URL, whose path
    // or query may hold an API key: never below info, whatever TXFLOW_LOG says (a directive added
    // for the same target replaces the user's).
    for quiet in txflow_core::chain::URL_LOGGING_TARGETS {
        match quiet.parse() {
            Ok(d) => filter = filter.add_directive(d),
            Err(e) => eprintln!("warning: log directive {quiet:?}: {e}"),
        }
    }
    let json = config.log_json;
    let started = export.map(|e| {
        let _in_runtime = runtime.enter();
        txflow_core::otel::start(e)
    });
    let (provider, telemetry, failed) = match started {
        Some(Ok((provider, telemetry))) => (Some(provider), telemetry, None),
        Some(Err(e)) => (None, txflow_core::otel::Telemetry::off(), Some(e)),
        None => (None, txflow_core::otel::Telemetry::off(), None),
    };
    match provider {
        // Traces off: the log subscriber alone, exactly as without telemetry.
        None => {
            let builder = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr);
            if json {
                builder.json().init();
            } else {
                builder.init();
            }
        }
        // The filter becomes the log output's own, so that the span layer sees txflow's spans
        // whatever TXFLOW_LOG says; the runtime's spans stay out of the log lines.
        Some(provider) => {
            use tracing_subscriber::Layer;
            use tracing_subscriber::layer::SubscriberExt;
            use tracing_subscriber::util::SubscriberInitExt;
            let quiet = format!("{}=off", txflow_core::otel::TARGET);
            match quiet.parse() {
                Ok(d) => filter = filter.add_directive(d),
                Err(e) => eprintln!("warning: log directive {quiet:?}: {e}"),
            }
            let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
            let fmt = if json {
                fmt.json().with_filter(filter).boxed()
            } else {
                fmt.with_filter(filter).boxed()
            };
            tracing_subscriber::registry()
                .with(fmt)
                .with(txflow_core::otel::layer(&provider))
                .init();
        }
    }
    if let Some(e) = failed {
        // Its message, not its source's: the exporter's own errors quote the endpoint in full.
        tracing::error!(
            error = %e,
            endpoint = %export.map(|x| txflow_core::chain::redact(&x.endpoint)).unwrap_or_default(),
            "traces are not exported"
        );
    } else if let Some(e) = export.filter(|_| telemetry.is_on()) {
        tracing::info!(
            endpoint = %txflow_core::chain::redact(&e.endpoint),
            service_name = %e.service_name,
            "exporting traces (OTLP gRPC)"
        );
    }
    telemetry
}

/// The `service.name` of this process's traces unless configured: `txflow-<role>` for a role,
/// `txflow` for everything else (`up` runs every role in one process).
fn default_service(command: &Command) -> String {
    let role = match command {
        Command::Allocator => Role::Allocator,
        Command::SignerGateway => Role::SignerGateway,
        Command::Broadcaster => Role::Broadcaster,
        Command::ReceiptChecker => Role::ReceiptChecker,
        Command::ConfirmationManager => Role::ConfirmationManager,
        Command::TransferCoordinator => Role::TransferCoordinator,
        Command::SpotLedger => Role::SpotLedger,
        Command::Gateway => Role::Gateway,
        _ => return "txflow".to_string(),
    };
    txflow_core::otel::service_name_of(role)
}

fn config(global: &Global) -> anyhow::Result<Config> {
    let mut c = Config::load(global.config.as_deref(), |k| std::env::var(k).ok())?;
    if let Some(v) = &global.database_url {
        c.database_url = v.clone();
    }
    if let Some(v) = &global.brokers {
        c.kafka.brokers = v.clone();
    }
    if let Some(v) = &global.schema_registry_url {
        c.schema_registry_url = v.clone();
    }
    if let Some(v) = &global.topic_prefix {
        c.topics = txflow_core::kafka::Topics::new(v.clone());
    }
    Ok(c)
}

/// One role in this process: its clients built once, stopped by SIGINT or SIGTERM.
async fn run_role(role: Role, config: &Config) -> anyhow::Result<()> {
    let deps = roles::deps(config, roles::stages_of(role)).await?;
    let shutdown = roles::shutdown_root()?;
    roles::observe(&deps, &[role], &format!("txflow-{role}"), &shutdown).await?;
    let ran = roles::run_role(role, &deps, shutdown.child_token()).await;
    // The metrics server and sampler stop with the process.
    shutdown.cancel();
    roles::stop_metrics().await;
    ran
}

async fn run(cli: Cli, config: Config) -> anyhow::Result<()> {
    match cli.command {
        Command::Allocator => run_role(Role::Allocator, &config).await,
        Command::SignerGateway => run_role(Role::SignerGateway, &config).await,
        Command::Broadcaster => run_role(Role::Broadcaster, &config).await,
        Command::ReceiptChecker => run_role(Role::ReceiptChecker, &config).await,
        Command::ConfirmationManager => run_role(Role::ConfirmationManager, &config).await,
        Command::TransferCoordinator => run_role(Role::TransferCoordinator, &config).await,
        Command::SpotLedger => Ok(txflow_spot_ledger::run(&config).await?),
        Command::Gateway => Ok(txflow_gateway::run(&config).await?),
        Command::Up(args) => up::run(&config, args).await,
        Command::Migrate => {
            let pool = txflow_core::db::connect(&config.database_url, 2).await?;
            let n = txflow_core::db::migrate(&pool).await?;
            println!("migrations applied: the database is at {n} migration(s)");
            Ok(())
        }
        Command::Replay(args) => replay::run(&config, args).await,
        Command::Bench(args) => bench::run(&config, args).await,
        Command::Demo => demo::run(&config).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::Config => {
            print!("{}", config.to_toml_redacted()?);
            Ok(())
        }
        Command::Signers(args) => signers::run(&config, args).await,
        Command::Token(args) => token::run(&config, &args),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match config(&cli.global) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    // The runtime first: the trace exporter, when there is one, is built inside it.
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let export = txflow_core::otel::decide(
        config.otlp_endpoint.as_deref(),
        config.otel_service_name.as_deref(),
        &default_service(&cli.command),
        |k| std::env::var(k).ok(),
    );
    let mut telemetry = init_logging(&config, export.as_ref(), &runtime);
    let result = runtime.block_on(run(cli, config));
    // The last spans are exported while the runtime still runs (a role ends here after SIGINT or
    // SIGTERM, having finished its batch).
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
