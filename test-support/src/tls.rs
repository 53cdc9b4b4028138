//! Throwaway certificate authorities for TLS tests (rcgen): a CA, server certificates for
//! loopback names, client certificates, all written as PEM files.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// A CA that signs test certificates.
pub struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

/// A certificate and its key, as PEM.
pub struct Leaf {
    /// Certificate (PEM).
    pub cert_pem: String,
    /// Private key (PEM, PKCS#8).
    pub key_pem: String,
    /// Certificate (DER), to compare with what a server presents.
    pub der: Vec<u8>,
}

impl Ca {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("generate CA key");
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        p.distinguished_name.push(DnType::CommonName, name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = p.self_signed(&key).expect("self-sign CA");
        Ca { cert, key }
    }

    /// The CA certificate (PEM).
    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// Writes the CA certificate to `path` and returns it.
    pub fn write(&self, path: &Path) -> PathBuf {
        std::fs::write(path, self.pem()).expect("write CA");
        path.to_path_buf()
    }

    fn issue(&self, cn: &str, names: &[&str], usage: ExtendedKeyUsagePurpose) -> Leaf {
        self.issue_with(cn, names, usage, |_| {})
    }

    fn issue_with(
        &self,
        cn: &str,
        names: &[&str],
        usage: ExtendedKeyUsagePurpose,
        adjust: impl FnOnce(&mut CertificateParams),
    ) -> Leaf {
        let key = KeyPair::generate().expect("generate key");
        let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("leaf params");
        adjust(&mut p);
        p.distinguished_name.push(DnType::CommonName, cn);
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![usage];
        let cert = p.signed_by(&key, &self.cert, &self.key).expect("sign leaf");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        }
    }

    /// A server certificate for `localhost` and `127.0.0.1`.
    pub fn server(&self) -> Leaf {
        self.issue(
            "localhost",
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A server certificate for `localhost` and `127.0.0.1` that expired on 2021-01-01
    /// (valid from 2020-01-01).
    pub fn expired_server(&self) -> Leaf {
        self.issue_with(
            "localhost",
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
            |p| {
                p.not_before = rcgen::date_time_ymd(2020, 1, 1);
                p.not_after = rcgen::date_time_ymd(2021, 1, 1);
            },
        )
    }

    /// A server certificate for these names only (a host name mismatch for any other).
    pub fn server_for(&self, names: &[&str]) -> Leaf {
        self.issue(names[0], names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate whose subject alternative name is the DNS name `name`.
    pub fn client(&self, name: &str) -> Leaf {
        self.issue(name, &[name], ExtendedKeyUsagePurpose::ClientAuth)
    }
}

impl Leaf {
    /// Writes `<dir>/<stem>.crt` and `<dir>/<stem>.key`; returns both paths.
    pub fn write(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        let (c, k) = (
            dir.join(format!("{stem}.crt")),
            dir.join(format!("{stem}.key")),
        );
        std::fs::write(&c, &self.cert_pem).expect("write cert");
        std::fs::write(&k, &self.key_pem).expect("write key");
        (c, k)
    }
}
