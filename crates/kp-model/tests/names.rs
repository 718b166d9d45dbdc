//! Chain-name hashes against names found in upstream's iptables proxier tests
//! (pkg/proxy/iptables/proxier_test.go), and the name validators.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use kp_model::{chain_hash, is_dns_label, is_port_name, Endpoint, Protocol, ServicePortName};

/// Upstream servicePortChainName: hash(servicePortName.String() + protocol).
fn svc_chain(spn: &ServicePortName) -> String {
    format!(
        "KUBE-SVC-{}",
        chain_hash(&format!("{spn}{}", spn.protocol.as_lower()))
    )
}

/// Upstream servicePortEndpointChainName: hash(servicePortName + protocol + endpoint).
fn sep_chain(spn: &ServicePortName, ep: &Endpoint) -> String {
    format!(
        "KUBE-SEP-{}",
        chain_hash(&format!(
            "{spn}{}{}",
            spn.protocol.as_lower(),
            ep.addr_string()
        ))
    )
}

fn endpoint(addr: &str) -> Endpoint {
    Endpoint::at(addr)
}

#[test]
fn service_chain_names_match_upstream() {
    let cases = [
        (
            ("default", "kubernetes", "https"),
            "KUBE-SVC-NPX46M4PTMTKRN6Y",
        ),
        (("ns1", "svc1", "p80"), "KUBE-SVC-XPGD46QRK7WJZT7O"),
        (("ns2", "svc2", "p80"), "KUBE-SVC-GNZBNJ2PO5MGZ6GT"),
    ];
    for ((ns, name, port), want) in cases {
        let spn = ServicePortName::new(ns, name, port, Protocol::Tcp);
        assert_eq!(svc_chain(&spn), want, "{spn}");
    }
    // The protocol is part of the input.
    let udp = ServicePortName::new("ns1", "svc1", "p80", Protocol::Udp);
    assert_ne!(svc_chain(&udp), "KUBE-SVC-XPGD46QRK7WJZT7O");
}

#[test]
fn endpoint_chain_names_match_upstream() {
    let cases = [
        (
            ("ns1", "svc1", "p80"),
            "10.180.0.1:80",
            "KUBE-SEP-SXIVWICOYRO3J4NJ",
        ),
        (
            ("ns2", "svc2", "p80"),
            "10.180.0.2:80",
            "KUBE-SEP-RS4RBKLTHTF2IUXJ",
        ),
    ];
    for ((ns, name, port), ep, want) in cases {
        let spn = ServicePortName::new(ns, name, port, Protocol::Tcp);
        assert_eq!(sep_chain(&spn, &endpoint(ep)), want, "{spn} -> {ep}");
    }
}

#[test]
fn chain_hash_shape() {
    for input in ["", "a", "ns1/svc1:p80tcp", &"x".repeat(10_000)] {
        let h = chain_hash(input);
        assert_eq!(h.len(), 16);
        // RFC 4648 base32 alphabet, no padding in the first 16 characters.
        assert!(h
            .chars()
            .all(|c| c.is_ascii_uppercase() || ('2'..='7').contains(&c)));
        // "KUBE-SEP-" + 16 = 25 characters: under iptables' 28-character limit.
        assert!(format!("KUBE-SEP-{h}").len() <= 28);
    }
    assert_ne!(chain_hash("a"), chain_hash("b"));
}

#[test]
fn dns_labels_and_port_names() {
    for ok in ["a", "web-1", "0", "a-b-c", &"a".repeat(63)] {
        assert!(is_dns_label(ok), "{ok:?}");
        assert!(is_port_name(ok), "{ok:?}");
    }
    let too_long = "a".repeat(64);
    for bad in [
        "",
        "-a",
        "a-",
        "A",
        "a_b",
        "a.b",
        "a b",
        "a\"",
        "a;",
        "a\n",
        "a}",
        "é",
        too_long.as_str(),
    ] {
        assert!(!is_dns_label(bad), "{bad:?}");
    }
    // Empty is the single unnamed port.
    assert!(is_port_name(""));
    assert!(!is_port_name("HTTP"));
    assert!(!is_port_name("a b"));
}
