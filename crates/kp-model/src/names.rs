use sha2::{Digest, Sha256};

/// Upstream's chain-name hash: sha256 of the input, standard base32, first 16
/// characters (`KUBE-SVC-` + this is a valid iptables chain name).
pub fn chain_hash(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    let mut s = data_encoding::BASE32.encode(&digest);
    s.truncate(16);
    s
}

/// RFC 1123 label as Kubernetes validates names of Services and namespaces: at
/// most 63 characters of `[a-z0-9-]`, starting and ending alphanumeric. Anything
/// else cannot come from a real API server, so the model rejects it; that also
/// keeps quotes, spaces and rule syntax out of every name a renderer prints.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// DNS-1123 subdomain (EndpointSlice names): at most 253 characters of labels
/// joined by dots.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

/// A Service port name: empty (single unnamed port) or an IANA_SVC_NAME-like
/// DNS label of at most 63 characters (Kubernetes allows DNS labels here).
pub fn is_port_name(s: &str) -> bool {
    s.is_empty() || is_dns_label(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_matches_upstream_shape() {
        let h = chain_hash("default/web:httptcp");
        assert_eq!(h.len(), 16);
        assert!(h
            .chars()
            .all(|c| c.is_ascii_uppercase() || ('2'..='7').contains(&c)));
        assert_ne!(h, chain_hash("default/web:httpudp"));
    }

    #[test]
    fn upstream_known_hash() {
        // From the seed's iptables dump: KUBE-SVC for default/kubernetes:https tcp
        // is KUBE-SVC-NPX46M4PTMTKRN6Y on every cluster.
        assert_eq!(
            chain_hash("default/kubernetes:httpstcp"),
            "NPX46M4PTMTKRN6Y"
        );
    }

    #[test]
    fn labels() {
        assert!(is_dns_label("web-1"));
        assert!(!is_dns_label("Web"));
        assert!(!is_dns_label("-a"));
        assert!(!is_dns_label("a\"; drop"));
        assert!(!is_dns_label(&"a".repeat(64)));
        assert!(is_dns_subdomain("web-abcde.x"));
        assert!(!is_dns_subdomain(&"a".repeat(254)));
        assert!(is_port_name(""));
    }
}
