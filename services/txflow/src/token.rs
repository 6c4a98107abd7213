//! `txflow token`: mints an HS256 bearer token for the gateway with the configured secret,
//! audience and issuer, for operators without an identity provider. It refuses a lifetime the
//! gateway would refuse and prints the token alone on stdout (never logged).

use anyhow::Context;
use txflow_core::config::{Config, JwtAlg};
use txflow_gateway::auth::{Mint, mint_hs256};

#[derive(Debug, clap::Args)]
pub struct TokenArgs {
    /// The principal: the token's `sub` (recorded as who submitted, approved, cancelled).
    #[arg(long)]
    pub sub: String,
    /// Space-separated scopes, e.g. "tx:read:* tx:approve:0xf39f…2266" or "transfer".
    #[arg(long)]
    pub scope: String,
    /// Seconds the token lives; at most gateway.jwt_max_lifetime_secs.
    #[arg(long, default_value_t = 600)]
    pub ttl: u64,
    /// The `kid` to name (when the gateway's keys are a JWKS holding this secret under it).
    #[arg(long)]
    pub kid: Option<String>,
}

pub fn run(config: &Config, args: &TokenArgs) -> anyhow::Result<()> {
    let g = &config.gateway;
    if g.jwt_jwks_file.is_none() && g.jwt_alg != JwtAlg::Hs256 {
        anyhow::bail!(
            "txflow token mints HS256 tokens; gateway.jwt_alg is {}: tokens come from the \
             identity provider that holds its private key",
            g.jwt_alg.as_str()
        );
    }
    if args.ttl == 0 || args.ttl > g.jwt_max_lifetime_secs {
        anyhow::bail!(
            "--ttl {} is outside 1..={} (gateway.jwt_max_lifetime_secs)",
            args.ttl,
            g.jwt_max_lifetime_secs
        );
    }
    let path = g.jwt_secret_file.as_deref().context(
        "gateway.jwt_secret_file (TXFLOW_GATEWAY_JWT_SECRET_FILE) names the HS256 secret to sign with",
    )?;
    let mut secret = std::fs::read(path)
        .with_context(|| format!("read the JWT secret file {}", path.display()))?;
    while secret.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        secret.pop();
    }
    let token = mint_hs256(
        &secret,
        &Mint {
            sub: &args.sub,
            scope: &args.scope,
            ttl_secs: args.ttl,
            audience: &g.jwt_audience,
            issuer: &g.jwt_issuer,
            kid: args.kid.as_deref(),
        },
    )
    .context("sign the token")?;
    println!("{token}");
    Ok(())
}
