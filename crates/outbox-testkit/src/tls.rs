//! Certificates for the TLS tests, made with the openssl CLI: a CA and a server certificate it
//! signed, for PostgreSQL and the HTTP test endpoint.

use std::path::{Path, PathBuf};
use std::process::Command;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run the openssl CLI (Debian package openssl; .ci/run installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, and a server certificate it signed for 127.0.0.1 and db.outboxd.test (not
/// `localhost`, so that name is a host name mismatch). Returns
/// (ca.pem, server.pem, server.key).
pub fn make_ca_and_server_cert(dir: &Path, ca_name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let ca_key = format!("{ca_name}.key");
    let ca = format!("{ca_name}.pem");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &ca_key,
            "-out",
            &ca,
            "-days",
            "2",
            "-subj",
            &format!("/CN={ca_name}"),
        ],
    );
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:db.outboxd.test\n",
    )
    .unwrap();
    let key = format!("{ca_name}-server.key");
    let csr = format!("{ca_name}-server.csr");
    let cert = format!("{ca_name}-server.pem");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            "/CN=outboxd-test-server",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ],
    );
    (dir.join(ca), dir.join(cert), dir.join(key))
}
