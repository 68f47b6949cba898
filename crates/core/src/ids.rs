//! The runtime's and the API's names for pods and containers, normalised: the
//! kubelet's `types.UID` and `kubecontainer.ContainerID`. Shared strings: a
//! clone is a reference count, so the real-time reader, which clones them into
//! every event it forwards, never allocates for one.

use std::fmt;
use std::sync::Arc;

/// A pod's UID, normalised: lowercase, with `-` separators (systemd cgroup names
/// write them as `_`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodUid(Arc<str>);

impl PodUid {
    /// Normalises a UID as found in a cgroup name or an API object. Returns `None`
    /// when it is empty, longer than 64 bytes or holds anything but hex digits and
    /// `-`/`_` separators (static pods have 32-hex UIDs without separators).
    pub fn parse(raw: &str) -> Option<Self> {
        if raw.is_empty() || raw.len() > 64 {
            return None;
        }
        let mut out = String::with_capacity(raw.len());
        for c in raw.chars() {
            match c {
                '0'..='9' | 'a'..='f' => out.push(c),
                'A'..='F' => out.push(c.to_ascii_lowercase()),
                '-' | '_' => out.push('-'),
                _ => return None,
            }
        }
        if out.starts_with('-') || out.ends_with('-') {
            return None;
        }
        Some(Self(out.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PodUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A 64-hex container (or sandbox) id, as CRI runtimes name them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerId(Arc<str>);

impl ContainerId {
    /// Accepts exactly 64 hex digits (lowercased).
    pub fn parse(raw: &str) -> Option<Self> {
        (raw.len() == 64 && raw.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| Self(raw.to_ascii_lowercase().into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ContainerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uid_normalisation() {
        assert_eq!(
            PodUid::parse("1B4E28BA_2FA1_11D2_883F_0016D3CCA427")
                .unwrap()
                .as_str(),
            "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
        );
        assert_eq!(
            PodUid::parse("6f0e1b0c2a3d4e5f60718293a4b5c6d7")
                .unwrap()
                .as_str(),
            "6f0e1b0c2a3d4e5f60718293a4b5c6d7"
        );
        for bad in ["", "-abc", "abc-", "xyz", "1234/5678", &"a".repeat(65)] {
            assert_eq!(PodUid::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn container_id() {
        let id = "A".repeat(64);
        assert_eq!(ContainerId::parse(&id).unwrap().as_str(), "a".repeat(64));
        assert!(ContainerId::parse(&"a".repeat(63)).is_none());
        assert!(ContainerId::parse(&"g".repeat(64)).is_none());
    }

    /// A clone shares the parsed string: the reader clones ids into every
    /// event it forwards and must not allocate.
    #[test]
    fn a_clone_shares_its_string() {
        let id = ContainerId::parse(&"a".repeat(64)).unwrap();
        assert_eq!(id.clone().as_str().as_ptr(), id.as_str().as_ptr());
        let uid = PodUid::parse("6f0e1b0c2a3d4e5f60718293a4b5c6d7").unwrap();
        assert_eq!(uid.clone().as_str().as_ptr(), uid.as_str().as_ptr());
    }
}
