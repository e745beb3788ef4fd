//! TLS to PostgreSQL with libpq's `sslmode` semantics, for both kinds of connection the relay
//! opens: ordinary SQL (`tokio-postgres` through `postgres-openssl`) and the hand-written
//! replication client (`transport`, through `tokio-openssl`).
//!
//! # Why this exists
//!
//! `tokio-postgres` 0.7 knows only `sslmode=disable|prefer|require` and refuses every other
//! value and the `sslrootcert` key, while operators copy libpq URLs with
//! `sslmode=verify-full&sslrootcert=/etc/ssl/pg-ca.pem`. [`PgConnectOptions::parse`] takes the
//! two TLS keys out of the URL (or key=value string), hands the rest to `tokio-postgres`, and
//! keeps the TLS decision here, in one place, for both connection kinds.
//!
//! # Modes (as in libpq)
//!
//! | sslmode | TLS | server certificate | host name |
//! | --- | --- | --- | --- |
//! | `disable` | never | - | - |
//! | `prefer` (default) | if the server offers it | not checked | not checked |
//! | `require` | always | not checked (checked against `sslrootcert` if one is given, as libpq does) | not checked |
//! | `verify-ca` | always | must chain to `sslrootcert` (else the system trust store) | not checked |
//! | `verify-full` | always | must chain to `sslrootcert` (else the system trust store) | must match the host (DNS name or IP SAN) |
//!
//! OpenSSL is the system library (`libssl`), the same one librdkafka uses for Kafka TLS.

use std::path::{Path, PathBuf};

use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};

/// libpq's `sslmode` values that outboxd supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    Disable,
    #[default]
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(s: &str) -> Result<SslMode, TlsError> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(TlsError::Config(format!(
                    "sslmode {other:?} is not supported: use disable, prefer, require, verify-ca or verify-full"
                )))
            }
        })
    }

    /// The value as written in a URL.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether a server without TLS must be refused.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

/// The TLS half of a connection string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    /// `sslrootcert`: PEM file of the certificate authorities the server's certificate must
    /// chain to.
    pub root_cert: Option<PathBuf>,
}

/// Why TLS could not be set up or carried out.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The connection string's TLS settings are wrong.
    #[error("{0}")]
    Config(String),
    /// OpenSSL refused the settings (e.g. an unreadable or malformed `sslrootcert`).
    #[error("{context}: {source}")]
    OpenSsl {
        context: String,
        source: openssl::error::ErrorStack,
    },
}

impl TlsSettings {
    /// Whether the server's certificate is checked against a trust anchor.
    fn verify_chain(&self) -> bool {
        match self.mode {
            SslMode::VerifyCa | SslMode::VerifyFull => true,
            // libpq: "if a root CA file exists, require behaves like verify-ca".
            SslMode::Require => self.root_cert.is_some(),
            SslMode::Disable | SslMode::Prefer => false,
        }
    }

    /// Whether the certificate must name the host we connected to.
    pub fn verify_hostname(&self) -> bool {
        self.mode == SslMode::VerifyFull
    }

    /// An OpenSSL connector configured for this mode. Host name checking is decided per
    /// connection (see [`TlsSettings::verify_hostname`]).
    pub fn connector(&self) -> Result<SslConnector, TlsError> {
        let ossl = |context: String| move |source| TlsError::OpenSsl { context, source };
        let mut b = SslConnector::builder(SslMethod::tls_client())
            .map_err(ossl("creating the TLS context".into()))?;
        if self.verify_chain() {
            match &self.root_cert {
                Some(path) => {
                    check_readable(path)?;
                    b.set_ca_file(path).map_err(ossl(format!(
                        "loading sslrootcert {} (expected PEM certificates)",
                        path.display()
                    )))?;
                }
                None => b
                    .set_default_verify_paths()
                    .map_err(ossl("loading the system trust store".into()))?,
            }
            b.set_verify(SslVerifyMode::PEER);
        } else {
            b.set_verify(SslVerifyMode::NONE);
        }
        Ok(b.build())
    }

    /// A `tokio-postgres` TLS connector for this mode.
    pub fn make_tls_connector(&self) -> Result<postgres_openssl::MakeTlsConnector, TlsError> {
        let mut c = postgres_openssl::MakeTlsConnector::new(self.connector()?);
        let full = self.verify_hostname();
        c.set_callback(move |cfg, _host| {
            cfg.set_verify_hostname(full);
            Ok(())
        });
        Ok(c)
    }
}

fn check_readable(path: &Path) -> Result<(), TlsError> {
    std::fs::metadata(path).map(|_| ()).map_err(|e| {
        TlsError::Config(format!(
            "sslrootcert {} cannot be read: {e}; give the path of the CA certificate (PEM) that signed the server's certificate",
            path.display()
        ))
    })
}

/// A parsed connection string: everything `tokio-postgres` understands, plus TLS.
#[derive(Debug, Clone)]
pub struct PgConnectOptions {
    /// Connection settings without the TLS keys; its `ssl_mode` is set to what
    /// `tokio-postgres` must do (disable, prefer or require) for [`TlsSettings::mode`].
    pub config: tokio_postgres::Config,
    pub tls: TlsSettings,
}

impl PgConnectOptions {
    /// Parses a libpq URL (`postgres://user:pw@host:5432/db?sslmode=verify-full&sslrootcert=/ca.pem`)
    /// or key=value string (`host=h dbname=db sslmode=require`). The error never contains the
    /// password.
    pub fn parse(url: &str) -> Result<PgConnectOptions, TlsError> {
        let (rest, mode, root) =
            if url.starts_with("postgres://") || url.starts_with("postgresql://") {
                split_url(url)?
            } else {
                split_key_value(url)?
            };
        let tls = TlsSettings {
            mode: match mode {
                Some(m) => SslMode::parse(&m)?,
                None => SslMode::Prefer,
            },
            root_cert: root.map(PathBuf::from),
        };
        let mut config: tokio_postgres::Config = rest.parse().map_err(|e| {
            TlsError::Config(format!(
                "the database URL is invalid: {e}; expected postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?sslmode=...]"
            ))
        })?;
        config.ssl_mode(match tls.mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        Ok(PgConnectOptions { config, tls })
    }

    /// Opens an ordinary SQL connection and drives it on a background task (which ends when
    /// the client is dropped or the connection fails).
    pub async fn connect_sql(&self) -> Result<tokio_postgres::Client, ConnectError> {
        let tls = self.tls.make_tls_connector()?;
        let (client, conn) = self.config.connect(tls).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "SQL connection closed");
            }
        });
        Ok(client)
    }
}

/// Why [`PgConnectOptions::connect_sql`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// Displayed with its causes (e.g. the OpenSSL verification error behind "error performing
    /// TLS handshake").
    #[error("{}", with_causes(.0))]
    Db(#[from] tokio_postgres::Error),
}

fn with_causes(e: &tokio_postgres::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

type Split = (String, Option<String>, Option<String>);

/// Removes `sslmode` and `sslrootcert` from a URL's query string.
fn split_url(url: &str) -> Result<Split, TlsError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), None, None));
    };
    let (mut mode, mut root) = (None, None);
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "sslmode" => mode = Some(percent_decode(v)?),
            "sslrootcert" => root = Some(percent_decode(v)?),
            _ => kept.push(pair),
        }
    }
    let rest = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, mode, root))
}

fn percent_decode(s: &str) -> Result<String, TlsError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    TlsError::Config(format!("bad percent-encoding in URL parameter {s:?}"))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| TlsError::Config(format!("URL parameter {s:?} is not UTF-8")))
}

/// Removes `sslmode` and `sslrootcert` from a `key=value key='quoted value'` string.
fn split_key_value(s: &str) -> Result<Split, TlsError> {
    let (mut mode, mut root) = (None, None);
    let mut kept: Vec<&str> = Vec::new();
    let mut rest = s.trim_start();
    while !rest.is_empty() {
        let eq = rest.find('=').ok_or_else(|| {
            TlsError::Config("the database URL is invalid: expected key=value pairs".into())
        })?;
        let key = rest[..eq].trim();
        let after = rest[eq + 1..].trim_start();
        let (value, consumed) = if let Some(q) = after.strip_prefix('\'') {
            let mut v = String::new();
            let mut chars = q.char_indices();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, n)) = chars.next() {
                            v.push(n);
                        }
                    }
                    '\'' => {
                        end = Some(i + 1);
                        break;
                    }
                    c => v.push(c),
                }
            }
            let end = end.ok_or_else(|| {
                TlsError::Config("the database URL is invalid: unterminated quoted value".into())
            })?;
            (v, 1 + end)
        } else {
            let end = after.find(char::is_whitespace).unwrap_or(after.len());
            (after[..end].to_string(), end)
        };
        let token_end = rest.len() - after.len() + consumed;
        match key {
            "sslmode" => mode = Some(value),
            "sslrootcert" => root = Some(value),
            _ => kept.push(&rest[..token_end]),
        }
        rest = rest[token_end..].trim_start();
    }
    Ok((kept.join(" "), mode, root))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_tls_keys_are_taken_out() {
        let o = PgConnectOptions::parse(
            "postgres://u:pw@db.example:5433/app?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x",
        )
        .unwrap();
        assert_eq!(o.tls.mode, SslMode::VerifyFull);
        assert_eq!(o.tls.root_cert.as_deref(), Some(Path::new("/etc/ca.pem")));
        assert_eq!(o.config.get_application_name(), Some("x"));
        assert_eq!(o.config.get_dbname(), Some("app"));
        assert_eq!(
            o.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
    }

    #[test]
    fn key_value_tls_keys_are_taken_out() {
        let o = PgConnectOptions::parse(
            "host=127.0.0.1 user=u password='a b\\'c' sslmode=verify-ca sslrootcert='/tmp/my ca.pem' dbname=app",
        )
        .unwrap();
        assert_eq!(o.tls.mode, SslMode::VerifyCa);
        assert_eq!(
            o.tls.root_cert.as_deref(),
            Some(Path::new("/tmp/my ca.pem"))
        );
        assert_eq!(o.config.get_password(), Some(&b"a b'c"[..]));
        assert_eq!(o.config.get_dbname(), Some("app"));
    }

    #[test]
    fn defaults_and_errors() {
        let o = PgConnectOptions::parse("postgres://u@h/db").unwrap();
        assert_eq!(o.tls, TlsSettings::default());
        assert_eq!(o.tls.mode, SslMode::Prefer);
        let e = PgConnectOptions::parse("postgres://u:hunter2@h/db?sslmode=allow").unwrap_err();
        assert!(e.to_string().contains("verify-full"), "{e}");
        let e = PgConnectOptions::parse("postgres://u:hunter2@h/db?bogus=1").unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    #[test]
    fn missing_root_cert_is_named() {
        let t = TlsSettings {
            mode: SslMode::VerifyFull,
            root_cert: Some("/nonexistent/ca.pem".into()),
        };
        let e = t.connector().unwrap_err().to_string();
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
    }
}
