//! Shared by the CLI's integration tests.

use std::path::Path;

/// A CA and two certificates signed by it (server for 127.0.0.1, client), as PEM files.
pub fn pki(dir: &Path) -> [String; 5] {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = params.self_signed(&ca_key).unwrap();
    let write = |name: &str, pem: String| {
        let p = dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p.display().to_string()
    };
    let leaf = |name: &str, san: &str| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![san.to_owned()])
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        (
            write(&format!("{name}.pem"), cert.pem()),
            write(&format!("{name}-key.pem"), key.serialize_pem()),
        )
    };
    let (server, server_key) = leaf("server", "127.0.0.1");
    let (client, client_key) = leaf("client", "client.test");
    [
        write("ca.pem", ca.pem()),
        server,
        server_key,
        client,
        client_key,
    ]
}
