//! The conformance suite in iptables mode (real kernel, network namespaces).

mod conformance;

const MODE: &str = "iptables";

#[test]
fn c01_clusterip() {
    conformance::clusterip(MODE);
}
#[test]
fn c02_nodeport() {
    conformance::nodeport(MODE);
}
#[test]
fn c03_external_and_lb() {
    conformance::external_and_lb(MODE);
}
#[test]
fn c04_session_affinity() {
    conformance::session_affinity(MODE);
}
#[test]
fn c05_no_endpoints() {
    conformance::no_endpoints(MODE);
}
#[test]
fn c06_external_policy_local() {
    conformance::external_policy_local(MODE);
}
#[test]
fn c07_internal_policy_local() {
    conformance::internal_policy_local(MODE);
}
#[test]
fn c08_masquerade_and_hairpin() {
    conformance::masquerade_and_hairpin(MODE);
}
#[test]
fn c09_terminating_fallback() {
    conformance::terminating_fallback(MODE);
}
#[test]
fn c10_endpoint_removal() {
    conformance::endpoint_removal(MODE);
}
#[test]
fn c11_delete_and_cleanup() {
    conformance::delete_and_cleanup(MODE);
}
#[test]
fn c12_restart_keeps_connections() {
    conformance::restart_keeps_connections(MODE);
}
#[test]
fn c13_ipv6_clusterip() {
    conformance::ipv6_clusterip(MODE);
}
#[test]
fn c14_localhost_nodeport() {
    conformance::localhost_nodeport(MODE);
}
