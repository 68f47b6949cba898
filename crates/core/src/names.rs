//! The API server's name rules (apimachinery's `IsDNS1123Label` and
//! `IsDNS1123Subdomain`), for the names the agent turns into paths, log
//! directories and hostnames: such a name never holds `/`, never is `.` or
//! `..`.

/// An RFC 1123 label: lowercase letters, digits and `-`, starting and ending
/// with a letter or digit, at most 63 characters.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    let ok = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| ok(c) || *c == b'-')
        && ok(&b[0])
        && ok(&b[b.len() - 1])
}

/// An RFC 1123 subdomain: labels (lowercase letters, digits and `-`, starting
/// and ending with a letter or digit) joined by `.`, at most 253 characters.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            let ok = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
            !b.is_empty()
                && b.iter().all(|c| ok(c) || *c == b'-')
                && ok(&b[0])
                && ok(&b[b.len() - 1])
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_subdomains() {
        for ok in ["a", "web-1", "0", &"a".repeat(63)] {
            assert!(is_dns_label(ok), "{ok}");
            assert!(is_dns_subdomain(ok), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "A",
            "a.b",
            "/data",
            "..",
            ".",
            "../x",
            "a/b",
            &"a".repeat(64),
        ] {
            assert!(!is_dns_label(bad), "{bad}");
        }
        assert!(is_dns_subdomain("kube-system.example.com"));
        for bad in [
            "",
            ".",
            "..",
            "a..b",
            "/x",
            "../x",
            "a/b",
            "A.b",
            ".a",
            "a.",
            &"a".repeat(254),
        ] {
            assert!(!is_dns_subdomain(bad), "{bad}");
        }
    }
}
