//! The identity of an x509 client certificate, as the kubelet's x509
//! authenticator (`k8s.io/apiserver/pkg/authentication/request/x509`,
//! `CommonNameUserConversion`) makes it: the user is the subject's common name,
//! the groups its organizations. The chain is verified by rustls against
//! `--client-ca-file` before this reads the subject; this only walks the DER
//! down to the subject's attributes (no other field is read).

/// A certificate whose subject cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("client certificate: {0}")]
pub struct X509Error(&'static str);

/// One DER element: its tag and contents; the rest of the input after it.
fn element(input: &[u8]) -> Result<(u8, &[u8], &[u8]), X509Error> {
    let (&tag, rest) = input.split_first().ok_or(X509Error("truncated"))?;
    let (&first, rest) = rest.split_first().ok_or(X509Error("truncated"))?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return Err(X509Error("bad length"));
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return Err(X509Error("truncated"));
    }
    Ok((tag, &rest[..len], &rest[len..]))
}

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const OID: u8 = 0x06;
/// 2.5.4.3
const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
/// 2.5.4.10
const ORGANIZATION: &[u8] = &[0x55, 0x04, 0x0a];

/// The subject's common name and organizations of a DER certificate.
pub fn subject(der: &[u8]) -> Result<(String, Vec<String>), X509Error> {
    let (tag, cert, _) = element(der)?;
    if tag != SEQUENCE {
        return Err(X509Error("not a certificate"));
    }
    let (tag, mut tbs, _) = element(cert)?;
    if tag != SEQUENCE {
        return Err(X509Error("no tbsCertificate"));
    }
    // [0] version (optional), serial, signature, issuer, validity, subject.
    let (tag, _, rest) = element(tbs)?;
    if tag == 0xa0 {
        tbs = rest;
    }
    for _ in 0..4 {
        tbs = element(tbs)?.2;
    }
    let (tag, mut names, _) = element(tbs)?;
    if tag != SEQUENCE {
        return Err(X509Error("no subject"));
    }
    let (mut cn, mut orgs) = (String::new(), Vec::new());
    while !names.is_empty() {
        let (tag, mut rdn, rest) = element(names)?;
        names = rest;
        if tag != SET {
            return Err(X509Error("bad subject"));
        }
        while !rdn.is_empty() {
            let (_, pair, rest) = element(rdn)?;
            rdn = rest;
            let (tag, oid, value) = element(pair)?;
            if tag != OID {
                return Err(X509Error("bad attribute"));
            }
            let (_, text, _) = element(value)?;
            let text = String::from_utf8_lossy(text).into_owned();
            if oid == COMMON_NAME {
                cn = text;
            } else if oid == ORGANIZATION {
                orgs.push(text);
            }
        }
    }
    Ok((cn, orgs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_is_the_common_name_and_the_groups_the_organizations() {
        // (rcgen keeps one value per attribute type; certificates with
        // several organizations are read in tests/tests/kubelet_api/.)
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "system:masters");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "kube-apiserver-kubelet-client");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(
            subject(cert.der()).unwrap(),
            (
                "kube-apiserver-kubelet-client".to_owned(),
                vec!["system:masters".to_owned()]
            )
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(subject(&[]).is_err());
        assert!(subject(&[0x30, 0x82, 0xff]).is_err());
        assert!(subject(&[0x30, 0x03, 0x02, 0x01, 0x01]).is_err());
    }
}
