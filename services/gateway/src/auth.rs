//! Who is calling and what they may do: JWT bearer tokens verified with the `jsonwebtoken` crate,
//! and the OAuth `scope` claim they carry.
//!
//! **Authentication.** `Authorization: Bearer <token>`. The key is chosen by the token's `kid`
//! among the configured keys (several at once, for rotation; a token without a `kid` is accepted
//! only when exactly one key is configured), and the token must be signed with that key's own
//! algorithm: HS256, RS256 or ES256. `alg=none`, an unknown `kid` or another algorithm is refused,
//! so an RS256 public key can never be used as an HS256 secret. `sub`, `iat`, `exp`, `aud` and
//! `iss` are required; `aud` must name the configured audience and `iss` be the configured
//! issuer; `exp - iat` may not exceed the configured maximum lifetime, nor `iat` lie in the future;
//! `nbf` is checked when present. A token is never logged or echoed.
//!
//! **Authorization: default deny.** A token may do only what its `scope` claim (a space-separated
//! string, RFC 8693 §4.2 / RFC 9068 §2.2.3) grants:
//!
//! | scope | grants |
//! |---|---|
//! | `transfer` | create and read the token's own (`sub`'s) internal transfers |
//! | `tx:submit:<signer>` | `POST /api/v1/tx` for that signer |
//! | `tx:read:<signer>` | read that signer's transactions |
//! | `tx:approve:<signer>` | approve that signer's transactions awaiting approval |
//! | `tx:cancel:<signer>` | cancel that signer's transactions |
//! | `audit:read` | read the audit log |
//!
//! `<signer>` is a 0x address (any case) or `*` for every signer. Other scopes are ignored (a
//! token may carry scopes for other services). An end user's token carries only `transfer`, so it
//! reaches no tx endpoint.

use std::collections::HashSet;

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use txflow_core::domain::Signer;
use txflow_core::transfer::check_id;

use crate::error::ApiError;

/// Seconds of clock difference tolerated on `exp`, `nbf` and `iat`.
const LEEWAY_SECS: u64 = 5;

/// The scope of an end user's token: their own transfers.
pub const SCOPE_TRANSFER: &str = "transfer";

/// The scope that reads the audit log.
pub const SCOPE_AUDIT_READ: &str = "audit:read";

/// What a tx scope grants, per signer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TxAction {
    Submit,
    Read,
    Approve,
    Cancel,
}

impl TxAction {
    pub const ALL: [TxAction; 4] = [
        TxAction::Submit,
        TxAction::Read,
        TxAction::Approve,
        TxAction::Cancel,
    ];

    /// The scope's name without its signer: `tx:submit`, …
    pub const fn scope(self) -> &'static str {
        match self {
            TxAction::Submit => "tx:submit",
            TxAction::Read => "tx:read",
            TxAction::Approve => "tx:approve",
            TxAction::Cancel => "tx:cancel",
        }
    }
}

/// The signers a tx scope names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Signers {
    Any,
    /// Lowercase 0x address.
    One(String),
}

/// What a token grants, from its `scope` claim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scopes {
    transfer: bool,
    audit_read: bool,
    tx: HashSet<(TxAction, Signers)>,
}

impl Scopes {
    /// The grants of a `scope` string; what is not understood grants nothing.
    pub fn parse(scope: &str) -> Scopes {
        let mut s = Scopes::default();
        for word in scope.split_ascii_whitespace() {
            match word {
                SCOPE_TRANSFER => s.transfer = true,
                SCOPE_AUDIT_READ => s.audit_read = true,
                _ => {
                    let Some((name, signer)) = word.rsplit_once(':') else {
                        continue;
                    };
                    let Some(action) = TxAction::ALL.into_iter().find(|a| a.scope() == name) else {
                        continue;
                    };
                    let signers = if signer == "*" {
                        Signers::Any
                    } else if let Ok(one) = Signer::parse(signer) {
                        Signers::One(one.as_str().to_string())
                    } else {
                        continue;
                    };
                    s.tx.insert((action, signers));
                }
            }
        }
        s
    }

    /// Whether `action` is granted on `signer` (a lowercase address).
    pub fn may(&self, action: TxAction, signer: &str) -> bool {
        self.tx.contains(&(action, Signers::Any))
            || self
                .tx
                .contains(&(action, Signers::One(signer.to_ascii_lowercase())))
    }

    /// Whether `action` is granted on any signer at all.
    pub fn may_some(&self, action: TxAction) -> bool {
        self.tx.iter().any(|(a, _)| *a == action)
    }
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
    iat: u64,
    exp: u64,
    /// Any JSON value: a scope of another shape (a list, say) grants nothing.
    #[serde(default)]
    scope: Option<serde_json::Value>,
}

/// 403 FORBIDDEN: the token has no `action` scope for `signer`.
pub fn lacks(action: TxAction, signer: &str) -> ApiError {
    ApiError::forbidden(format!("the token lacks scope {}:{signer}", action.scope()))
}

/// Who made a request: the token's `sub` and what its scopes grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub user: String,
    pub scopes: Scopes,
}

impl Caller {
    /// 403 FORBIDDEN unless the token may use the transfer endpoints (scope `transfer`).
    pub fn require_transfer(&self) -> Result<(), ApiError> {
        if self.scopes.transfer {
            Ok(())
        } else {
            Err(ApiError::forbidden(
                "the transfer endpoints need a token with scope \"transfer\"",
            ))
        }
    }

    /// 403 FORBIDDEN unless the token may do `action` on `signer`.
    pub fn require_tx(&self, action: TxAction, signer: &str) -> Result<(), ApiError> {
        if self.scopes.may(action, signer) {
            Ok(())
        } else {
            Err(lacks(action, signer))
        }
    }

    /// 403 FORBIDDEN unless the token may do `action` on some signer (checked before a lookup,
    /// so that a token with no such right learns nothing of any transaction).
    pub fn require_some(&self, action: TxAction) -> Result<(), ApiError> {
        if self.scopes.may_some(action) {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!(
                "the token has no {} scope",
                action.scope()
            )))
        }
    }

    /// 403 FORBIDDEN unless the token may read the audit log.
    pub fn require_audit(&self) -> Result<(), ApiError> {
        if self.scopes.audit_read {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!(
                "reading the audit log needs scope \"{SCOPE_AUDIT_READ}\""
            )))
        }
    }
}

/// One key tokens may be signed with: its `kid` (none for the one key of `jwt_secret_file` or
/// `jwt_public_key_file`) and its algorithm.
pub struct Key {
    pub kid: Option<String>,
    pub alg: Algorithm,
    pub key: DecodingKey,
}

pub struct Verifier {
    keys: Vec<Key>,
    audience: String,
    issuer: String,
    max_lifetime_secs: u64,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("algs", &self.algs())
            .field(
                "kids",
                &self.keys.iter().map(|k| &k.kid).collect::<Vec<_>>(),
            )
            .field("audience", &self.audience)
            .field("issuer", &self.issuer)
            .field("max_lifetime_secs", &self.max_lifetime_secs)
            .finish()
    }
}

/// The reason a token is refused: every one is 401 UNAUTHORIZED.
fn refused(why: &'static str) -> ApiError {
    ApiError::unauthorized(why)
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Verifier {
    pub fn new(
        keys: Vec<Key>,
        audience: String,
        issuer: String,
        max_lifetime_secs: u64,
    ) -> Verifier {
        Verifier {
            keys,
            audience,
            issuer,
            max_lifetime_secs,
        }
    }

    /// The algorithms of the configured keys, for the start log.
    pub fn algs(&self) -> Vec<&'static str> {
        let mut algs: Vec<&'static str> = self
            .keys
            .iter()
            .map(|k| match k.alg {
                Algorithm::HS256 => "HS256",
                Algorithm::RS256 => "RS256",
                Algorithm::ES256 => "ES256",
                _ => "other",
            })
            .collect();
        algs.sort_unstable();
        algs.dedup();
        algs
    }

    /// The key a token names by its `kid`.
    fn key_for(&self, kid: Option<&str>) -> Result<&Key, ApiError> {
        match kid {
            Some(kid) => self
                .keys
                .iter()
                .find(|k| k.kid.as_deref() == Some(kid))
                .ok_or_else(|| refused("the token's kid names no key of this gateway")),
            None => match self.keys.as_slice() {
                [only] => Ok(only),
                _ => Err(refused(
                    "the token has no kid, and this gateway has several keys",
                )),
            },
        }
    }

    /// The authenticated user of a request: the `sub` of its valid bearer token, or 401.
    pub fn user(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        self.caller(headers).map(|c| c.user)
    }

    /// The user of a transfer endpoint: a valid token (401) with scope `transfer` (403).
    pub fn transfer_user(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        let caller = self.caller(headers)?;
        caller.require_transfer()?;
        Ok(caller.user)
    }

    /// The authenticated caller of a request, with its scopes, or 401 UNAUTHORIZED.
    pub fn caller(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let value = headers
            .get(AUTHORIZATION)
            .ok_or_else(|| refused("no Authorization header"))?;
        let token = value
            .to_str()
            .ok()
            .and_then(|v| {
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            })
            .filter(|t| !t.is_empty())
            .ok_or_else(|| refused("expected Authorization: Bearer <token>"))?;
        // `alg: none` and unknown algorithms fail here: the crate knows no such algorithm.
        let header = jsonwebtoken::decode_header(token).map_err(|_| {
            refused("the token's header is not valid (or names no usable algorithm)")
        })?;
        let key = self.key_for(header.kid.as_deref())?;
        if header.alg != key.alg {
            return Err(refused("the token is not signed with its key's algorithm"));
        }
        let mut validation = Validation::new(key.alg);
        validation.set_required_spec_claims(&["exp", "sub", "iat", "aud", "iss"]);
        validation.validate_exp = true;
        validation.validate_nbf = true;
        validation.leeway = LEEWAY_SECS;
        validation.set_audience(&[self.audience.as_str()]);
        validation.set_issuer(&[self.issuer.as_str()]);
        let data = jsonwebtoken::decode::<Claims>(token, &key.key, &validation).map_err(|e| {
            refused(match e.kind() {
                ErrorKind::ExpiredSignature => "the token has expired",
                ErrorKind::ImmatureSignature => "the token is not valid yet",
                ErrorKind::InvalidSignature => "the token's signature is not valid",
                ErrorKind::InvalidAlgorithm => {
                    "the token is not signed with the expected algorithm"
                }
                ErrorKind::InvalidAudience => "the token is not for this audience",
                ErrorKind::InvalidIssuer => "the token is not from the expected issuer",
                ErrorKind::MissingRequiredClaim(_) => {
                    "the token lacks one of exp, iat, sub, aud or iss"
                }
                _ => "the token is not valid",
            })
        })?;
        let c = data.claims;
        if c.iat > now_secs() + LEEWAY_SECS {
            return Err(refused("the token is issued in the future"));
        }
        if c.exp.saturating_sub(c.iat) > self.max_lifetime_secs {
            return Err(refused(
                "the token lives longer than this gateway accepts (exp - iat)",
            ));
        }
        check_id("user id", &c.sub)
            .map_err(|_| refused("the token's sub is not a valid user id"))?;
        let scopes = match &c.scope {
            Some(serde_json::Value::String(s)) => Scopes::parse(s),
            _ => Scopes::default(),
        };
        Ok(Caller {
            user: c.sub,
            scopes,
        })
    }
}

/// What [`mint_hs256`] signs.
#[derive(Debug, Clone)]
pub struct Mint<'a> {
    pub sub: &'a str,
    /// Space-separated scopes (the table above).
    pub scope: &'a str,
    pub ttl_secs: u64,
    pub audience: &'a str,
    pub issuer: &'a str,
    /// The key's `kid`, when the gateway's keys are a set.
    pub kid: Option<&'a str>,
}

/// An HS256 token the gateway accepts: for operators without an identity provider
/// (`txflow token`) and the demo. RS256 and ES256 tokens come from the identity provider that
/// holds the private key.
pub fn mint_hs256(secret: &[u8], m: &Mint<'_>) -> Result<String, jsonwebtoken::errors::Error> {
    let now = now_secs();
    let mut header = jsonwebtoken::Header::new(Algorithm::HS256);
    header.kid = m.kid.map(str::to_string);
    jsonwebtoken::encode(
        &header,
        &serde_json::json!({
            "sub": m.sub, "scope": m.scope, "iat": now, "exp": now + m.ttl_secs,
            "aud": m.audience, "iss": m.issuer,
        }),
        &jsonwebtoken::EncodingKey::from_secret(secret),
    )
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use jsonwebtoken::{EncodingKey, Header};
    use serde_json::json;

    use super::*;

    const SECRET: &[u8] = b"a-test-secret-of-at-least-32-bytes!!";
    const A: &str = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";
    const B: &str = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8";

    fn now() -> u64 {
        now_secs()
    }

    fn claims(extra: serde_json::Value) -> serde_json::Value {
        let mut c = json!({"sub": "u-1", "iat": now(), "exp": now() + 60,
                           "aud": "txflow", "iss": "txflow"});
        for (k, v) in extra.as_object().expect("an object") {
            if v.is_null() {
                c.as_object_mut().expect("an object").remove(k);
            } else {
                c[k] = v.clone();
            }
        }
        c
    }

    fn token(claims: serde_json::Value, secret: &[u8]) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(secret),
        )
        .expect("encode")
    }

    fn headers(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {token}")).expect("header"),
        );
        h
    }

    fn verifier() -> Verifier {
        Verifier::new(
            vec![Key {
                kid: None,
                alg: Algorithm::HS256,
                key: DecodingKey::from_secret(SECRET),
            }],
            "txflow".into(),
            "txflow".into(),
            3600,
        )
    }

    #[test]
    fn a_minted_token_is_accepted_with_its_scopes() {
        let t = mint_hs256(
            SECRET,
            &Mint {
                sub: "ops-1",
                scope: &format!("tx:read:* tx:approve:{A}"),
                ttl_secs: 600,
                audience: "txflow",
                issuer: "txflow",
                kid: None,
            },
        )
        .expect("mint");
        let caller = verifier().caller(&headers(&t)).expect("valid");
        assert_eq!(caller.user, "ops-1");
        assert!(
            caller.scopes.may(TxAction::Approve, A) && !caller.scopes.may(TxAction::Approve, B)
        );
    }

    #[test]
    fn a_valid_token_names_its_user() {
        let t = token(claims(json!({})), SECRET);
        assert_eq!(verifier().user(&headers(&t)), Ok("u-1".to_string()));
    }

    #[test]
    fn scopes_grant_per_signer_and_nothing_else() {
        let s = Scopes::parse(&format!(
            "openid tx:submit:{} tx:read:* tx:approve:{B} tx:cancel:nonsense audit:read tx:submit",
            A.to_uppercase().replace("0X", "0x")
        ));
        assert!(s.may(TxAction::Submit, A));
        assert!(!s.may(TxAction::Submit, B));
        assert!(s.may(TxAction::Read, A) && s.may(TxAction::Read, B));
        assert!(s.may(TxAction::Approve, B) && !s.may(TxAction::Approve, A));
        assert!(
            !s.may_some(TxAction::Cancel),
            "a malformed signer grants nothing"
        );
        assert!(s.audit_read && !s.transfer);
        let none = Scopes::parse("");
        for a in TxAction::ALL {
            assert!(!none.may_some(a), "default deny");
        }
        assert!(!none.transfer && !none.audit_read);
    }

    #[test]
    fn only_a_string_scope_grants() {
        let v = verifier();
        for (scope, transfer) in [
            (json!("transfer"), true),
            (json!(["transfer"]), false),
            (json!(null), false),
        ] {
            let caller = v
                .caller(&headers(&token(claims(json!({"scope": scope})), SECRET)))
                .expect("valid");
            assert_eq!(caller.require_transfer().is_ok(), transfer, "{scope}");
            let e = caller
                .require_tx(TxAction::Read, A)
                .expect_err("no tx scope");
            assert_eq!((e.status.as_u16(), e.code), (403, "FORBIDDEN"));
        }
    }

    #[test]
    fn missing_expired_forged_and_incomplete_tokens_are_unauthorized() {
        let v = verifier();
        let cases = [
            headers(&token(
                claims(json!({"iat": now() - 4000, "exp": now() - 3600})),
                SECRET,
            )),
            headers(&token(
                claims(json!({})),
                b"another-secret-another-secret-00",
            )),
            headers(&token(claims(json!({"exp": null})), SECRET)),
            headers(&token(claims(json!({"sub": null})), SECRET)),
            headers(&token(claims(json!({"iat": null})), SECRET)),
            headers(&token(claims(json!({"aud": null})), SECRET)),
            headers(&token(claims(json!({"iss": null})), SECRET)),
            headers(&token(claims(json!({"aud": "another"})), SECRET)),
            headers(&token(claims(json!({"iss": "another"})), SECRET)),
            headers(&token(claims(json!({"exp": now() + 7200})), SECRET)),
            headers(&token(
                claims(json!({"iat": now() + 600, "exp": now() + 700})),
                SECRET,
            )),
            headers(&token(claims(json!({"sub": "a b"})), SECRET)),
            headers("not.a.jwt"),
            HeaderMap::new(),
        ];
        for h in cases {
            let e = v.user(&h).expect_err("refused");
            assert_eq!((e.status.as_u16(), e.code), (401, "UNAUTHORIZED"), "{e:?}");
        }
    }

    #[test]
    fn alg_none_and_an_unknown_kid_are_unauthorized() {
        // `{"alg":"none","typ":"JWT"}`, base64url: a valid token's claims with no signature.
        const NONE_HEADER: &str = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0";
        let valid = token(claims(json!({})), SECRET);
        let body = valid.split('.').nth(1).expect("claims");
        let none = format!("{NONE_HEADER}.{body}.");
        let v = verifier();
        let e = v.user(&headers(&none)).expect_err("alg none");
        assert_eq!(e.status.as_u16(), 401);
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("k-unknown".into());
        let with_kid =
            jsonwebtoken::encode(&h, &claims(json!({})), &EncodingKey::from_secret(SECRET))
                .expect("encode");
        let e = v.user(&headers(&with_kid)).expect_err("unknown kid");
        assert_eq!(e.status.as_u16(), 401);
    }
}
