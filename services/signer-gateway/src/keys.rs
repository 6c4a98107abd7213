//! The signer gateway's local keys: from `TXFLOW_SIGNER_KEYS` (comma-separated hex) and/or from
//! encrypted JSON keystores (`TXFLOW_SIGNER_KEYSTORE`, a file or a directory of them, with the
//! password in `TXFLOW_SIGNER_KEYSTORE_PASSWORD_FILE`). A key is never logged, printed or put in an
//! error: errors name the position or the file, and `Debug` shows addresses only.
//!
//! Every key is a [`TxSigner`]: alloy's local signer here, and the seam for a remote one (a KMS or
//! an HSM, whose signature takes hundreds of milliseconds). The gateway calls it with no database
//! transaction open.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use alloy::primitives::Address;
use alloy::signers::local::PrivateKeySigner;
use txflow_core::chain::{SignError, SignedTx, UnsignedTx};
use txflow_core::config::Config;
use txflow_core::domain::Signer;
use txflow_core::retry::{Classify, Retry};
use txflow_core::role::RoleError;

/// A signature on its way.
pub type SignFuture<'a> = Pin<Box<dyn Future<Output = Result<SignedTx, SigningError>> + Send + 'a>>;

/// The key of one signer, wherever it is kept.
pub trait TxSigner: Send + Sync + 'static {
    /// The address it signs for.
    fn address(&self) -> Address;

    /// Signs `tx` (EIP-1559): its hash and EIP-2718 bytes.
    fn sign<'a>(&'a self, tx: &'a UnsignedTx) -> SignFuture<'a>;
}

/// Alloy's local signer. Deterministic (RFC 6979): the same unsigned transaction always gives the
/// same bytes.
impl TxSigner for PrivateKeySigner {
    fn address(&self) -> Address {
        alloy::signers::Signer::address(self)
    }

    fn sign<'a>(&'a self, tx: &'a UnsignedTx) -> SignFuture<'a> {
        Box::pin(std::future::ready(
            txflow_core::chain::sign(self, tx).map_err(SigningError::from),
        ))
    }
}

/// Why a signature was not made. Never carries key material.
#[derive(Debug, thiserror::Error)]
pub enum SigningError {
    /// The key cannot sign this transaction: signing it again fails the same way.
    #[error("the key refused to sign")]
    Refused(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The signer could not be reached or did not answer in time (a remote signer): the
    /// transaction stays as it is and is signed later.
    #[error("the signer is unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl From<SignError> for SigningError {
    fn from(e: SignError) -> SigningError {
        SigningError::Refused(Box::new(e))
    }
}

impl Classify for SigningError {
    fn retry(&self) -> Retry {
        match self {
            SigningError::Refused(_) => Retry::Permanent,
            SigningError::Unavailable(_) => Retry::Transient,
        }
    }
}

/// Why the keys could not be loaded. Never carries key material.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("TXFLOW_SIGNER_KEYS: key #{position} is not a private key")]
    InvalidKey { position: usize },
    #[error("TXFLOW_SIGNER_KEYSTORE is set but TXFLOW_SIGNER_KEYSTORE_PASSWORD_FILE is not")]
    NoPassword,
    #[error("cannot read the keystore password file {path}")]
    PasswordFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot list the keystore directory {path}")]
    Directory {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot decrypt the keystore {path} (wrong password or not a keystore file)")]
    Keystore {
        path: PathBuf,
        #[source]
        source: alloy::signers::local::LocalSignerError,
    },
    #[error("the keystore directory {path} holds no keystore file")]
    EmptyKeystore { path: PathBuf },
}

impl Classify for KeyError {
    fn retry(&self) -> Retry {
        Retry::Permanent
    }
}

impl From<KeyError> for RoleError {
    fn from(e: KeyError) -> RoleError {
        RoleError::ConfigSource {
            message: "cannot load the signing keys".into(),
            source: Box::new(e),
        }
    }
}

/// The keys by address.
#[derive(Clone, Default)]
pub struct Keys(HashMap<Signer, Arc<dyn TxSigner>>);

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut a: Vec<&Signer> = self.0.keys().collect();
        a.sort();
        f.debug_list().entries(a).finish()
    }
}

impl Keys {
    /// Every key the configuration names: the environment's and the keystores'.
    pub fn load(config: &Config) -> Result<Keys, KeyError> {
        let mut keys = Keys::parse(config.signer_keys.expose())?;
        if let Some(path) = &config.signer_keystore {
            let password_file = config
                .signer_keystore_password_file
                .as_ref()
                .ok_or(KeyError::NoPassword)?;
            let password =
                std::fs::read(password_file).map_err(|source| KeyError::PasswordFile {
                    path: password_file.clone(),
                    source,
                })?;
            // A trailing newline is the editor's, not the password's.
            let password = password
                .strip_suffix(b"\n")
                .map(|p| p.strip_suffix(b"\r").unwrap_or(p))
                .unwrap_or(&password);
            keys.extend(Keys::from_keystore(path, password)?);
        }
        Ok(keys)
    }

    /// Parses comma-separated hex private keys. The error names the position, never the key.
    pub fn parse(list: &str) -> Result<Keys, KeyError> {
        let mut keys = Keys::default();
        for (i, k) in list
            .split(',')
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .enumerate()
        {
            let signer: PrivateKeySigner = k
                .parse()
                .map_err(|_| KeyError::InvalidKey { position: i + 1 })?;
            keys.insert(signer);
        }
        Ok(keys)
    }

    /// Decrypts a keystore file, or every file of a keystore directory (hidden files skipped).
    pub fn from_keystore(path: &Path, password: &[u8]) -> Result<Keys, KeyError> {
        let files = if path.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|source| KeyError::Directory {
                    path: path.to_path_buf(),
                    source,
                })?
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.is_file()
                        && !p
                            .file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
                })
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(KeyError::EmptyKeystore {
                    path: path.to_path_buf(),
                });
            }
            files
        } else {
            vec![path.to_path_buf()]
        };
        let mut keys = Keys::default();
        for file in files {
            let signer = PrivateKeySigner::decrypt_keystore(&file, password)
                .map_err(|source| KeyError::Keystore { path: file, source })?;
            keys.insert(signer);
        }
        Ok(keys)
    }

    /// Local keys.
    pub fn from_signers(list: impl IntoIterator<Item = PrivateKeySigner>) -> Keys {
        Keys::from_tx_signers(list.into_iter().map(|s| Arc::new(s) as Arc<dyn TxSigner>))
    }

    /// Keys kept anywhere (a remote signer, or a test's instrumented one).
    pub fn from_tx_signers(list: impl IntoIterator<Item = Arc<dyn TxSigner>>) -> Keys {
        let mut keys = Keys::default();
        for s in list {
            keys.insert_signer(s);
        }
        keys
    }

    fn insert(&mut self, s: PrivateKeySigner) {
        self.insert_signer(Arc::new(s));
    }

    fn insert_signer(&mut self, s: Arc<dyn TxSigner>) {
        // Alloy's address is always a valid 20-byte address.
        if let Ok(a) = Signer::parse(&format!("{:#x}", s.address())) {
            self.0.insert(a, s);
        }
    }

    fn extend(&mut self, other: Keys) {
        self.0.extend(other.0);
    }

    /// The key of `s`, if this gateway has one.
    pub fn get(&self, s: &Signer) -> Option<&Arc<dyn TxSigner>> {
        self.0.get(s)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The addresses these keys sign for.
    pub fn addresses(&self) -> Vec<Signer> {
        let mut a: Vec<Signer> = self.0.keys().cloned().collect();
        a.sort();
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d";

    fn scratch_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("txflow-keys-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).expect("scratch dir");
        d
    }

    #[test]
    fn keys_from_the_environment_never_show_in_errors_or_debug_output() {
        let keys = Keys::parse(&format!("0x{KEY}, {KEY}")).expect("valid keys");
        assert_eq!(keys.len(), 1, "the same key twice is one signer");
        let shown = format!("{keys:?}");
        assert!(shown.contains("0x70997970c51812dc3a010c7d01b50e0d17dc79c8"));
        assert!(!shown.contains(&KEY[..12]), "{shown}");

        let bad = format!("{KEY},0x{}zz", &KEY[..62]);
        let err = Keys::parse(&bad).expect_err("an invalid second key");
        let text = format!("{err} / {err:?}");
        assert!(text.contains("key #2"), "{text}");
        assert!(!text.contains(&KEY[..12]), "{text}");
    }

    #[test]
    fn keys_are_decrypted_from_a_keystore_file_or_directory_and_a_wrong_password_is_refused() {
        let dir = scratch_dir();
        let secret = hex::decode(KEY).expect("hex");
        let mut rng = rand08::thread_rng();
        let (made, _) = PrivateKeySigner::encrypt_keystore(
            &dir,
            &mut rng,
            &secret,
            "correct horse",
            Some("signer-1.json"),
        )
        .expect("keystore written");
        let other = PrivateKeySigner::random();
        PrivateKeySigner::encrypt_keystore(
            &dir,
            &mut rng,
            other.to_bytes(),
            "correct horse",
            Some("signer-2.json"),
        )
        .expect("keystore written");
        std::fs::write(dir.join("password"), "correct horse\n").expect("password file");

        let file = dir.join("signer-1.json");
        let keys = Keys::from_keystore(&file, b"correct horse").expect("decrypted");
        assert_eq!(keys.addresses().len(), 1);
        assert!(
            keys.get(&Signer::parse(&format!("{:#x}", made.address())).expect("address"))
                .is_some()
        );
        let stored = std::fs::read_to_string(&file).expect("keystore");
        assert!(!stored.contains(&KEY[..12]), "the key is stored encrypted");

        let err = Keys::from_keystore(&file, b"wrong").expect_err("wrong password");
        let text = format!("{err} / {:?}", std::error::Error::source(&err));
        assert!(text.contains("signer-1.json"), "{text}");
        assert!(!text.contains(&KEY[..12]), "{text}");

        // A directory through the configuration: both keys, plus the environment's.
        let keystores = dir.join("keystores");
        std::fs::create_dir_all(&keystores).expect("dir");
        for f in ["signer-1.json", "signer-2.json"] {
            std::fs::rename(dir.join(f), keystores.join(f)).expect("move");
        }
        let env_key = PrivateKeySigner::random();
        let config = Config {
            signer_keys: txflow_core::config::Secret::new(hex::encode(env_key.to_bytes())),
            signer_keystore: Some(keystores.clone()),
            signer_keystore_password_file: Some(dir.join("password")),
            ..Config::default()
        };
        let keys = Keys::load(&config).expect("all keys");
        assert_eq!(keys.len(), 3);
        for a in [made.address(), other.address(), env_key.address()] {
            assert!(
                keys.get(&Signer::parse(&format!("{a:#x}")).expect("address"))
                    .is_some()
            );
        }
        let no_password = Config {
            signer_keystore_password_file: None,
            ..config
        };
        assert!(matches!(
            Keys::load(&no_password),
            Err(KeyError::NoPassword)
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
