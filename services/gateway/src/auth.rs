//! JWT authentication (seed 004 §1.5.1) with the `jsonwebtoken` crate: `Authorization: Bearer
//! <token>`, signed with the one configured algorithm (HS256 with a shared secret, or RS256 with a
//! public key; a token naming another algorithm is refused, so an RS256 public key can never be
//! used as an HS256 secret), `exp` and `sub` required, `nbf` checked when present. The token's
//! `sub` is the user. A token is never logged or echoed.
//!
//! The tx endpoints are operator endpoints: any valid token may submit and read transactions,
//! and approving or cancelling one needs the claim `"role": "operator"` ([`OPERATOR`]).

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use txflow_core::config::JwtAlg;
use txflow_core::transfer::check_id;

use crate::error::ApiError;

/// Seconds of clock difference tolerated on `exp` and `nbf`.
const LEEWAY_SECS: u64 = 5;

pub struct Verifier {
    alg: JwtAlg,
    key: DecodingKey,
    validation: Validation,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("alg", &self.alg)
            .field("key", &"***")
            .finish()
    }
}

/// The `role` claim's value that may approve and cancel transactions.
pub const OPERATOR: &str = "operator";

#[derive(Deserialize)]
struct Claims {
    sub: String,
    /// Any JSON value: a token with a role of another shape (a list, say) is still valid, it
    /// just is not an operator's.
    #[serde(default)]
    role: Option<serde_json::Value>,
}

/// Who made a request: the token's `sub` and `role`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub user: String,
    pub role: Option<String>,
}

impl Caller {
    /// 403 FORBIDDEN unless the token's role is `operator`.
    pub fn require_operator(&self) -> Result<(), ApiError> {
        if self.role.as_deref() == Some(OPERATOR) {
            Ok(())
        } else {
            Err(ApiError::forbidden(
                "approving or cancelling a transaction needs a token with role \"operator\"",
            ))
        }
    }
}

impl Verifier {
    pub fn new(alg: JwtAlg, key: DecodingKey) -> Verifier {
        let mut validation = Validation::new(match alg {
            JwtAlg::Hs256 => Algorithm::HS256,
            JwtAlg::Rs256 => Algorithm::RS256,
        });
        validation.set_required_spec_claims(&["exp", "sub"]);
        validation.validate_exp = true;
        validation.validate_nbf = true;
        validation.leeway = LEEWAY_SECS;
        Verifier {
            alg,
            key,
            validation,
        }
    }

    pub fn alg(&self) -> JwtAlg {
        self.alg
    }

    /// The authenticated user of a request: the `sub` of its valid bearer token, or 401
    /// UNAUTHORIZED.
    pub fn user(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        self.caller(headers).map(|c| c.user)
    }

    /// The authenticated caller of a request, with its role, or 401 UNAUTHORIZED.
    pub fn caller(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let value = headers
            .get(AUTHORIZATION)
            .ok_or_else(|| ApiError::unauthorized("no Authorization header"))?;
        let token = value
            .to_str()
            .ok()
            .and_then(|v| {
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            })
            .filter(|t| !t.is_empty())
            .ok_or_else(|| ApiError::unauthorized("expected Authorization: Bearer <token>"))?;
        let data =
            jsonwebtoken::decode::<Claims>(token, &self.key, &self.validation).map_err(|e| {
                ApiError::unauthorized(match e.kind() {
                    ErrorKind::ExpiredSignature => "the token has expired",
                    ErrorKind::ImmatureSignature => "the token is not valid yet",
                    ErrorKind::InvalidSignature => "the token's signature is not valid",
                    ErrorKind::InvalidAlgorithm => {
                        "the token is not signed with the expected algorithm"
                    }
                    ErrorKind::MissingRequiredClaim(_) => "the token lacks exp or sub",
                    _ => "the token is not valid",
                })
            })?;
        check_id("user id", &data.claims.sub)
            .map_err(|_| ApiError::unauthorized("the token's sub is not a valid user id"))?;
        Ok(Caller {
            user: data.claims.sub,
            role: match data.claims.role {
                Some(serde_json::Value::String(r)) => Some(r),
                _ => None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use jsonwebtoken::{EncodingKey, Header};
    use serde_json::json;

    use super::*;

    const SECRET: &[u8] = b"a-test-secret-of-at-least-32-bytes!!";

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs()
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
        Verifier::new(JwtAlg::Hs256, DecodingKey::from_secret(SECRET))
    }

    #[test]
    fn a_valid_token_names_its_user() {
        let t = token(json!({"sub": "u-1", "exp": now() + 60}), SECRET);
        assert_eq!(verifier().user(&headers(&t)), Ok("u-1".to_string()));
    }

    #[test]
    fn only_an_operator_token_may_approve() {
        let v = verifier();
        for (claims, operator) in [
            (
                json!({"sub": "op", "exp": now() + 60, "role": "operator"}),
                true,
            ),
            (
                json!({"sub": "op", "exp": now() + 60, "role": "user"}),
                false,
            ),
            (
                json!({"sub": "op", "exp": now() + 60, "role": ["operator"]}),
                false,
            ),
            (json!({"sub": "op", "exp": now() + 60}), false),
        ] {
            let caller = v
                .caller(&headers(&token(claims.clone(), SECRET)))
                .expect("valid");
            assert_eq!(caller.user, "op");
            let allowed = caller.require_operator();
            assert_eq!(allowed.is_ok(), operator, "{claims}");
            if let Err(e) = allowed {
                assert_eq!((e.status.as_u16(), e.code), (403, "FORBIDDEN"));
            }
        }
    }

    #[test]
    fn missing_expired_forged_and_incomplete_tokens_are_unauthorized() {
        let v = verifier();
        let cases = [
            headers(&token(json!({"sub": "u-1", "exp": now() - 3600}), SECRET)),
            headers(&token(
                json!({"sub": "u-1", "exp": now() + 60}),
                b"another-secret-another-secret-00",
            )),
            headers(&token(json!({"sub": "u-1"}), SECRET)),
            headers(&token(json!({"exp": now() + 60}), SECRET)),
            headers(&token(json!({"sub": "a b", "exp": now() + 60}), SECRET)),
            headers("not.a.jwt"),
            HeaderMap::new(),
        ];
        for h in cases {
            let e = v.user(&h).expect_err("refused");
            assert_eq!((e.status.as_u16(), e.code), (401, "UNAUTHORIZED"), "{e:?}");
        }
    }
}
