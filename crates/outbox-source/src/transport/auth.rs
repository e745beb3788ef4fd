//! The authentication exchange as a pure state machine: each [`AuthRequest`] from the
//! server goes in, the response (if any) is appended to an output buffer. No I/O here, so
//! the whole exchange can be unit-tested.
//!
//! Supported: trust (immediate AuthenticationOk), cleartext password, md5, and
//! SCRAM-SHA-256 without channel binding (we have no TLS, so there is nothing to bind to).

use bytes::BytesMut;
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{self, ChannelBinding, ScramSha256};
use postgres_protocol::message::frontend;

use super::frame::AuthRequest;
use super::TransportError;

enum State {
    /// Nothing exchanged yet, or a password message sent and the verdict pending.
    Start,
    /// SCRAM in progress; the server must still prove it knows the password (SASLFinal)
    /// before we accept AuthenticationOk.
    Scram(Box<ScramSha256>),
    /// SCRAM's server signature verified; only AuthenticationOk may follow.
    ScramVerified,
    Done,
}

pub(crate) struct Authenticator<'a> {
    user: &'a str,
    password: Option<&'a [u8]>,
    /// `channel_binding=require` in the config: we cannot honour it without TLS, so every
    /// password method is refused rather than silently downgraded.
    require_channel_binding: bool,
    state: State,
}

/// What the caller must do after [`Authenticator::handle`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Send what was appended to the output buffer and wait for the next request.
    Continue,
    /// Authentication succeeded (AuthenticationOk).
    Done,
}

impl<'a> Authenticator<'a> {
    pub(crate) fn new(
        user: &'a str,
        password: Option<&'a [u8]>,
        require_channel_binding: bool,
    ) -> Self {
        Authenticator {
            user,
            password,
            require_channel_binding,
            state: State::Start,
        }
    }

    fn password(&self, method: &str) -> Result<&'a [u8], TransportError> {
        if self.require_channel_binding {
            return Err(TransportError::Auth(format!(
                "channel_binding=require is set but channel binding needs TLS, which this \
                 connection does not support (server asked for {method} for user \"{}\")",
                self.user
            )));
        }
        self.password.ok_or_else(|| {
            TransportError::Auth(format!(
                "the server requested {method} authentication for user \"{}\" but no password \
                 was configured",
                self.user
            ))
        })
    }

    fn out_err(e: std::io::Error) -> TransportError {
        TransportError::Auth(format!("cannot encode authentication message: {e}"))
    }

    pub(crate) fn handle(
        &mut self,
        req: AuthRequest,
        out: &mut BytesMut,
    ) -> Result<Step, TransportError> {
        match (req, &mut self.state) {
            (AuthRequest::Ok, State::Start | State::ScramVerified) => {
                self.state = State::Done;
                Ok(Step::Done)
            }
            (AuthRequest::Ok, State::Scram(_)) => Err(TransportError::Auth(format!(
                "the server accepted user \"{}\" without completing SCRAM (it never proved it \
                 knows the password)",
                self.user
            ))),
            (AuthRequest::CleartextPassword, State::Start) => {
                tracing::debug!(user = self.user, "cleartext password authentication");
                let pw = self.password("cleartext password")?;
                frontend::password_message(pw, out).map_err(Self::out_err)?;
                Ok(Step::Continue)
            }
            (AuthRequest::Md5Password { salt }, State::Start) => {
                tracing::debug!(user = self.user, "md5 authentication");
                let pw = self.password("md5 password")?;
                let hash = md5_hash(self.user.as_bytes(), pw, salt);
                frontend::password_message(hash.as_bytes(), out).map_err(Self::out_err)?;
                Ok(Step::Continue)
            }
            (AuthRequest::Sasl { mechanisms }, State::Start) => {
                tracing::debug!(user = self.user, ?mechanisms, "SASL authentication");
                if !mechanisms.iter().any(|m| m == sasl::SCRAM_SHA_256) {
                    return Err(TransportError::Auth(format!(
                        "the server offers SASL mechanisms {mechanisms:?} for user \"{}\"; only \
                         {} (without channel binding) is supported",
                        self.user,
                        sasl::SCRAM_SHA_256
                    )));
                }
                let pw = self.password(sasl::SCRAM_SHA_256)?;
                // "unsupported": we do not do channel binding (no TLS), gs2 header "n,,".
                let scram = ScramSha256::new(pw, ChannelBinding::unsupported());
                frontend::sasl_initial_response(sasl::SCRAM_SHA_256, scram.message(), out)
                    .map_err(Self::out_err)?;
                self.state = State::Scram(Box::new(scram));
                Ok(Step::Continue)
            }
            (AuthRequest::SaslContinue(data), State::Scram(scram)) => {
                scram.update(&data).map_err(|e| {
                    TransportError::Auth(format!(
                        "SCRAM authentication for user \"{}\" failed: {e}",
                        self.user
                    ))
                })?;
                frontend::sasl_response(scram.message(), out).map_err(Self::out_err)?;
                Ok(Step::Continue)
            }
            (AuthRequest::SaslFinal(data), State::Scram(scram)) => {
                scram.finish(&data).map_err(|e| {
                    TransportError::Auth(format!(
                        "SCRAM authentication for user \"{}\" failed: {e}",
                        self.user
                    ))
                })?;
                self.state = State::ScramVerified;
                Ok(Step::Continue)
            }
            (AuthRequest::Other(code), _) => Err(TransportError::Auth(format!(
                "the server requested authentication method {} for user \"{}\", which is not \
                 supported (supported: trust, password, md5, scram-sha-256)",
                method_name(code),
                self.user
            ))),
            (req, _) => Err(TransportError::Protocol(format!(
                "unexpected authentication request {req:?} during authentication of user \"{}\"",
                self.user
            ))),
        }
    }
}

fn method_name(code: i32) -> String {
    match code {
        2 => "Kerberos V5".into(),
        6 => "SCM credentials".into(),
        7 => "GSSAPI".into(),
        8 => "GSSAPI (continue)".into(),
        9 => "SSPI".into(),
        other => format!("with code {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn trust() {
        let mut a = Authenticator::new("u", None, false);
        let mut out = BytesMut::new();
        assert_eq!(a.handle(AuthRequest::Ok, &mut out).unwrap(), Step::Done);
        assert!(out.is_empty());
    }

    #[test]
    fn md5_response() {
        let mut a = Authenticator::new("alice", Some(b"secret"), false);
        let mut out = BytesMut::new();
        let step = a
            .handle(AuthRequest::Md5Password { salt: [1, 2, 3, 4] }, &mut out)
            .unwrap();
        assert_eq!(step, Step::Continue);
        // 'p', i32 len, "md5" + 32 hex chars, NUL.
        assert_eq!(out[0], b'p');
        assert_eq!(
            i32::from_be_bytes([out[1], out[2], out[3], out[4]]),
            4 + 35 + 1
        );
        let expected = md5_hash(b"alice", b"secret", [1, 2, 3, 4]);
        assert_eq!(&out[5..out.len() - 1], expected.as_bytes());
        assert!(expected.starts_with("md5"));
        assert_eq!(a.handle(AuthRequest::Ok, &mut out).unwrap(), Step::Done);
    }

    #[test]
    fn cleartext_response() {
        let mut a = Authenticator::new("u", Some(b"pw"), false);
        let mut out = BytesMut::new();
        a.handle(AuthRequest::CleartextPassword, &mut out).unwrap();
        assert_eq!(&out[..], b"p\0\0\0\x07pw\0");
    }

    #[test]
    fn missing_password_names_user() {
        let mut a = Authenticator::new("bob", None, false);
        let err = a
            .handle(
                AuthRequest::Md5Password { salt: [0; 4] },
                &mut BytesMut::new(),
            )
            .unwrap_err();
        assert!(matches!(err, TransportError::Auth(_)));
        assert!(err.to_string().contains("\"bob\""), "{err}");
    }

    #[test]
    fn channel_binding_required_is_refused() {
        let mut a = Authenticator::new("u", Some(b"pw"), true);
        let err = a
            .handle(
                AuthRequest::Sasl {
                    mechanisms: vec!["SCRAM-SHA-256".into()],
                },
                &mut BytesMut::new(),
            )
            .unwrap_err();
        assert!(matches!(err, TransportError::Auth(_)));
    }

    #[test]
    fn unsupported_methods() {
        let mut a = Authenticator::new("u", Some(b"pw"), false);
        let err = a
            .handle(AuthRequest::Other(7), &mut BytesMut::new())
            .unwrap_err();
        assert!(err.to_string().contains("GSSAPI"), "{err}");
        let err = a
            .handle(
                AuthRequest::Sasl {
                    mechanisms: vec!["SCRAM-SHA-256-PLUS".into()],
                },
                &mut BytesMut::new(),
            )
            .unwrap_err();
        assert!(matches!(err, TransportError::Auth(_)));
    }

    #[test]
    fn scram_initial_message_and_no_shortcut() {
        let mut a = Authenticator::new("u", Some(b"pw"), false);
        let mut out = BytesMut::new();
        a.handle(
            AuthRequest::Sasl {
                mechanisms: vec!["SCRAM-SHA-256-PLUS".into(), "SCRAM-SHA-256".into()],
            },
            &mut out,
        )
        .unwrap();
        // 'p', len, "SCRAM-SHA-256\0", i32 len, "n,,n=,r=<nonce>"
        assert_eq!(out[0], b'p');
        let body = &out[5..];
        assert!(body.starts_with(b"SCRAM-SHA-256\0"));
        assert!(body[14 + 4..].starts_with(b"n,,n=,r="));
        // A server that skips straight to Ok without proving itself is rejected.
        assert!(a.handle(AuthRequest::Ok, &mut out).is_err());
    }

    #[test]
    fn scram_garbage_from_server() {
        let mut a = Authenticator::new("u", Some(b"pw"), false);
        let mut out = BytesMut::new();
        a.handle(
            AuthRequest::Sasl {
                mechanisms: vec!["SCRAM-SHA-256".into()],
            },
            &mut out,
        )
        .unwrap();
        let err = a
            .handle(
                AuthRequest::SaslContinue(Bytes::from_static(b"garbage")),
                &mut out,
            )
            .unwrap_err();
        assert!(matches!(err, TransportError::Auth(_)));
    }

    #[test]
    fn out_of_order_requests() {
        let mut a = Authenticator::new("u", Some(b"pw"), false);
        let err = a
            .handle(
                AuthRequest::SaslFinal(Bytes::from_static(b"v=x")),
                &mut BytesMut::new(),
            )
            .unwrap_err();
        assert!(matches!(err, TransportError::Protocol(_)));
    }
}
