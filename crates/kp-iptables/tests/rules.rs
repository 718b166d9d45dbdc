//! The rendered rules of each kind of Service, and partial syncs (recorded
//! backend, no kernel).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use kp_iptables::{
    sep_chain, svc_chain, IptablesBackend, IptablesProxier, ServiceRules, EXTERNAL_CHAIN,
    FIREWALL_CHAIN, NODEPORTS_CHAIN, SERVICES_CHAIN,
};
use kp_model::{
    chain_hash, Dataplane, DataplaneError, Endpoint, IpFamily, LocalDetector, NodeInfo,
    ProxierConfig, ProxyState, ServicePort, ServicePortName,
};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn sp(name: &str, cip: &str) -> kp_model::testing::ServicePortBuilder {
    ServicePort::builder("default", name)
        .port_name("http")
        .cluster_ip(cip)
}

fn ep(addr: &str, local: bool) -> Endpoint {
    Endpoint::ready(ip(addr), 8080, local)
}

fn terminating(addr: &str, local: bool) -> Endpoint {
    ep(addr, local).serving_terminating()
}

fn cfg() -> ProxierConfig {
    let mut c = ProxierConfig::new(IpFamily::V4);
    c.local_detector = LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]);
    c
}

fn node() -> NodeInfo {
    NodeInfo::named("node1")
}

/// A rendered Service's rules as the restore input's lines (`-A CHAIN ...`).
struct Lines {
    nat_chains: Vec<(String, Vec<String>)>,
    nat_services: Vec<String>,
    nat_nodeports: Vec<String>,
    filter_services: Vec<String>,
    filter_external: Vec<String>,
    filter_firewall: Vec<String>,
    filter_nodeports: Vec<String>,
    no_local: (bool, bool),
}

fn lines(r: ServiceRules) -> Lines {
    let text = |chain: &str, rules: &[kp_iptables::Rule]| -> Vec<String> {
        rules.iter().map(|r| format!("-A {chain} {r}")).collect()
    };
    Lines {
        nat_chains: r
            .nat_chains
            .iter()
            .map(|(c, rules)| (c.clone(), text(c, rules)))
            .collect(),
        nat_services: text(SERVICES_CHAIN, &r.nat_services),
        nat_nodeports: text(NODEPORTS_CHAIN, &r.nat_nodeports),
        filter_services: text(SERVICES_CHAIN, &r.filter_services),
        filter_external: text(EXTERNAL_CHAIN, &r.filter_external),
        filter_firewall: text(FIREWALL_CHAIN, &r.filter_firewall),
        filter_nodeports: text(NODEPORTS_CHAIN, &r.filter_nodeports),
        no_local: r.no_local,
    }
}

/// [`kp_iptables::render_service`], as lines.
fn render_service(s: &ServicePort, eps: &[Endpoint], c: &ProxierConfig, n: &NodeInfo) -> Lines {
    lines(kp_iptables::render_service(s, eps, c, n))
}

fn chain<'a>(r: &'a Lines, name: &str) -> &'a [String] {
    &r.nat_chains
        .iter()
        .find(|(c, _)| c == name)
        .unwrap_or_else(|| panic!("no chain {name} in {:#?}", r.nat_chains))
        .1
}

const H: &str = "default/web:http";

#[test]
fn chain_names_use_upstreams_hash() {
    let s = sp("web", "10.96.0.10").build();
    let e = ep("10.244.1.5", true);
    assert_eq!(
        svc_chain(&s),
        format!("KUBE-SVC-{}", chain_hash("default/web:httptcp"))
    );
    assert_eq!(
        sep_chain(&s, &e),
        format!(
            "KUBE-SEP-{}",
            chain_hash("default/web:httptcp10.244.1.5:8080")
        )
    );
    // The well-known name of the kubernetes Service's chain on every cluster.
    let k = sp("kubernetes", "10.96.0.1").port_name("https").build();
    assert_eq!(svc_chain(&k), "KUBE-SVC-NPX46M4PTMTKRN6Y");
}

#[test]
fn clusterip_load_balances_with_upstreams_probabilities() {
    let s = sp("web", "10.96.0.10").build();
    let eps = vec![
        ep("10.244.1.5", true),
        ep("10.244.2.6", false),
        ep("10.244.2.7", false),
    ];
    let r = render_service(&s, &eps, &cfg(), &node());
    let svc = svc_chain(&s);
    let sep: Vec<String> = eps.iter().map(|e| sep_chain(&s, e)).collect();
    assert_eq!(
        r.nat_services,
        vec![format!(
            "-A KUBE-SERVICES -m comment --comment \"{H} cluster IP\" -m tcp -p tcp -d 10.96.0.10/32 --dport 80 -j {svc}"
        )]
    );
    assert_eq!(
        chain(&r, &svc),
        &[
            format!("-A {svc} -m comment --comment \"{H} cluster IP\" -m tcp -p tcp -d 10.96.0.10/32 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ"),
            format!("-A {svc} -m comment --comment \"{H} -> 10.244.1.5:8080\" -m statistic --mode random --probability 0.3333333333 -j {}", sep[0]),
            format!("-A {svc} -m comment --comment \"{H} -> 10.244.2.6:8080\" -m statistic --mode random --probability 0.5000000000 -j {}", sep[1]),
            format!("-A {svc} -m comment --comment \"{H} -> 10.244.2.7:8080\" -j {}", sep[2]),
        ]
    );
    assert_eq!(
        chain(&r, &sep[0]),
        &[
            format!("-A {} -m comment --comment \"{H}\" -s 10.244.1.5/32 -j KUBE-MARK-MASQ", sep[0]),
            format!("-A {} -m comment --comment \"{H}\" -m tcp -p tcp -j DNAT --to-destination 10.244.1.5:8080", sep[0]),
        ]
    );
    assert!(r.filter_services.is_empty() && r.filter_external.is_empty());
    assert!(r.nat_nodeports.is_empty());
    // No external chain for a ClusterIP service.
    assert!(!r.nat_chains.iter().any(|(c, _)| c.starts_with("KUBE-EXT-")));
}

#[test]
fn masquerade_all_and_no_detector() {
    let s = sp("web", "10.96.0.10").build();
    let eps = vec![ep("10.244.1.5", true)];
    let mut c = cfg();
    c.masquerade_all = true;
    let r = render_service(&s, &eps, &c, &node());
    assert!(chain(&r, &svc_chain(&s))[0].ends_with("--dport 80 -j KUBE-MARK-MASQ"));
    let mut c = cfg();
    c.local_detector = LocalDetector::None;
    let r = render_service(&s, &eps, &c, &node());
    // Without a way to tell pods from others, no masquerade rule (upstream).
    assert!(!chain(&r, &svc_chain(&s))
        .iter()
        .any(|l| l.contains("KUBE-MARK-MASQ")));
}

#[test]
fn no_endpoints_rejects_in_filter() {
    let s = sp("web", "10.96.0.10")
        .node_port(30080)
        .external_ips(&["203.0.113.10"])
        .build();
    let r = render_service(&s, &[], &cfg(), &node());
    assert!(r.nat_chains.is_empty());
    assert!(r.nat_services.is_empty());
    assert!(r.nat_nodeports.is_empty());
    assert_eq!(
        r.filter_services,
        vec![format!("-A KUBE-SERVICES -m comment --comment \"{H} has no endpoints\" -m tcp -p tcp -d 10.96.0.10/32 --dport 80 -j REJECT")]
    );
    assert_eq!(
        r.filter_external,
        vec![
            format!("-A KUBE-EXTERNAL-SERVICES -m comment --comment \"{H} has no endpoints\" -m tcp -p tcp -d 203.0.113.10/32 --dport 80 -j REJECT"),
            format!("-A KUBE-EXTERNAL-SERVICES -m comment --comment \"{H} has no endpoints\" -m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -m tcp -p tcp --dport 30080 -j REJECT"),
        ]
    );
}

#[test]
fn nodeport_jumps_to_ext_which_masquerades() {
    let s = sp("web", "10.96.0.10").node_port(30080).build();
    let eps = vec![ep("10.244.2.6", false)];
    let r = render_service(&s, &eps, &cfg(), &node());
    let ext = svc_chain(&s).replace("KUBE-SVC-", "KUBE-EXT-");
    assert_eq!(
        r.nat_nodeports,
        vec![format!(
            "-A KUBE-NODEPORTS -m comment --comment \"{H}\" -m tcp -p tcp --dport 30080 -j {ext}"
        )]
    );
    assert_eq!(
        chain(&r, &ext),
        &[
            format!("-A {ext} -m comment --comment \"masquerade traffic for {H} external destinations\" -j KUBE-MARK-MASQ"),
            format!("-A {ext} -j {}", svc_chain(&s)),
        ]
    );
}

#[test]
fn nodeport_addresses_and_localhost() {
    use kp_iptables::Skeleton;
    let mut c = cfg();
    c.nodeport_addresses = vec!["10.100.0.11/32".parse().unwrap()];
    let sk = Skeleton::new(&c);
    assert_eq!(sk.nodeport_jumps.len(), 1);
    assert!(sk.nodeport_jumps[0]
        .to_string()
        .contains("-d 10.100.0.11/32 -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"));
    let sk = Skeleton::new(&cfg());
    assert_eq!(sk.nodeport_jumps.len(), 1);
    assert!(sk.nodeport_jumps[0]
        .to_string()
        .contains("-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS"));
    assert!(sk.firewall_head.is_empty());
    let mut c = cfg();
    c.localhost_nodeports = true;
    let sk = Skeleton::new(&c);
    // Localhost only from the node itself, and remote 127/8 traffic blocked.
    assert!(sk.nodeport_jumps[1]
        .to_string()
        .contains("-s 127.0.0.0/8 -d 127.0.0.0/8 -j KUBE-NODEPORTS"));
    assert!(sk.firewall_head[0]
        .to_string()
        .contains("-d 127.0.0.0/8 ! -s 127.0.0.0/8"));
    // Never for IPv6.
    let mut c = ProxierConfig::new(IpFamily::V6);
    c.localhost_nodeports = true;
    let sk = Skeleton::new(&c);
    assert_eq!(sk.nodeport_jumps.len(), 1);
    assert!(sk.nodeport_jumps[0].to_string().contains("! -d ::1/128"));
}

#[test]
fn load_balancer_with_source_ranges_goes_through_fw() {
    let s = sp("web", "10.96.0.10")
        .node_port(30081)
        .load_balancer_ips(&["203.0.113.20"])
        .source_ranges(&["10.100.0.100/32"])
        .build();
    let r = render_service(&s, &[ep("10.244.1.5", true)], &cfg(), &node());
    let fw = svc_chain(&s).replace("KUBE-SVC-", "KUBE-FW-");
    let ext = svc_chain(&s).replace("KUBE-SVC-", "KUBE-EXT-");
    assert!(r.nat_services.contains(&format!(
        "-A KUBE-SERVICES -m comment --comment \"{H} loadbalancer IP\" -m tcp -p tcp -d 203.0.113.20/32 --dport 80 -j {fw}"
    )));
    assert_eq!(
        chain(&r, &fw),
        &[
            format!("-A {fw} -m comment --comment \"{H} loadbalancer IP\" -s 10.100.0.100/32 -j {ext}"),
            format!("-A {fw} -m comment --comment \"other traffic to {H} will be dropped by KUBE-PROXY-FIREWALL\""),
        ]
    );
    assert_eq!(
        r.filter_firewall,
        vec![format!("-A KUBE-PROXY-FIREWALL -m comment --comment \"{H} traffic not accepted by {fw}\" -m tcp -p tcp -d 203.0.113.20/32 --dport 80 -j DROP")]
    );
    // NodePorts are not subject to source ranges (upstream).
    assert!(r.nat_nodeports[0].ends_with(&format!("-j {ext}")));
}

#[test]
fn external_ips() {
    let s = sp("web", "10.96.0.10")
        .external_ips(&["203.0.113.10"])
        .build();
    let r = render_service(&s, &[ep("10.244.1.5", true)], &cfg(), &node());
    let ext = svc_chain(&s).replace("KUBE-SVC-", "KUBE-EXT-");
    assert!(r.nat_services.contains(&format!(
        "-A KUBE-SERVICES -m comment --comment \"{H} external IP\" -m tcp -p tcp -d 203.0.113.10/32 --dport 80 -j {ext}"
    )));
    assert!(chain(&r, &ext)[0].contains("-j KUBE-MARK-MASQ"));
}

#[test]
fn external_policy_local() {
    let s = sp("web", "10.96.0.10")
        .node_port(30060)
        .local_external()
        .health_check_node_port(32100)
        .build();
    let eps = vec![ep("10.244.1.5", true), ep("10.244.2.6", false)];
    let r = render_service(&s, &eps, &cfg(), &node());
    let svc = svc_chain(&s);
    let svl = svc.replace("KUBE-SVC-", "KUBE-SVL-");
    let ext = svc.replace("KUBE-SVC-", "KUBE-EXT-");
    assert_eq!(
        chain(&r, &ext),
        &[
            format!("-A {ext} -m comment --comment \"pod traffic for {H} external destinations\" -s 10.244.0.0/16 -j {svc}"),
            format!("-A {ext} -m comment --comment \"masquerade LOCAL traffic for {H} external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"),
            format!("-A {ext} -m comment --comment \"route LOCAL traffic for {H} external destinations\" -m addrtype --src-type LOCAL -j {svc}"),
            format!("-A {ext} -j {svl}"),
        ]
    );
    // Only the local endpoint, no masquerade (client IP preserved).
    assert_eq!(
        chain(&r, &svl),
        &[format!(
            "-A {svl} -m comment --comment \"{H} -> 10.244.1.5:8080\" -j {}",
            sep_chain(&s, &eps[0])
        )]
    );
    // The cluster IP still uses every endpoint.
    assert_eq!(chain(&r, &svc).len(), 3);
    assert_eq!(
        r.filter_nodeports,
        vec![format!("-A KUBE-NODEPORTS -m comment --comment \"{H} health check node port\" -m tcp -p tcp --dport 32100 -j ACCEPT")]
    );
    assert_eq!(r.no_local, (false, false));

    // No local endpoint: external traffic is dropped (it exists elsewhere),
    // but pods and the node itself are still short-circuited to the
    // cluster's endpoints through the external chain, as upstream's.
    let r = render_service(&s, &eps[1..], &cfg(), &node());
    assert_eq!(r.no_local, (false, true));
    assert_eq!(
        r.nat_nodeports,
        vec![format!(
            "-A KUBE-NODEPORTS -m comment --comment \"{H}\" -m tcp -p tcp --dport 30060 -j {ext}"
        )]
    );
    assert_eq!(
        chain(&r, &ext),
        &[
            format!("-A {ext} -m comment --comment \"pod traffic for {H} external destinations\" -s 10.244.0.0/16 -j {svc}"),
            format!("-A {ext} -m comment --comment \"masquerade LOCAL traffic for {H} external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"),
            format!("-A {ext} -m comment --comment \"route LOCAL traffic for {H} external destinations\" -m addrtype --src-type LOCAL -j {svc}"),
        ]
    );
    assert_eq!(
        r.filter_external,
        vec![format!("-A KUBE-EXTERNAL-SERVICES -m comment --comment \"{H} has no local endpoints\" -m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -m tcp -p tcp --dport 30060 -j DROP")]
    );
}

#[test]
fn internal_policy_local() {
    let s = sp("web", "10.96.0.10").local_internal().build();
    let eps = vec![ep("10.244.1.5", true), ep("10.244.2.6", false)];
    let r = render_service(&s, &eps, &cfg(), &node());
    let svl = svc_chain(&s).replace("KUBE-SVC-", "KUBE-SVL-");
    assert!(r.nat_services[0].ends_with(&format!("-j {svl}")));
    let rules = chain(&r, &svl);
    assert!(rules[0].ends_with("! -s 10.244.0.0/16 -j KUBE-MARK-MASQ"));
    assert_eq!(rules.len(), 2);
    assert!(!r.nat_chains.iter().any(|(c, _)| c.starts_with("KUBE-SVC-")));
    // Only the local endpoint gets a SEP chain.
    assert_eq!(r.nat_chains.len(), 2);

    // No local endpoint: the cluster IP drops (endpoints exist elsewhere).
    let r = render_service(&s, &eps[1..], &cfg(), &node());
    assert_eq!(r.no_local, (true, false));
    assert!(r.nat_services.is_empty());
    assert_eq!(
        r.filter_services,
        vec![format!("-A KUBE-SERVICES -m comment --comment \"{H} has no local endpoints\" -m tcp -p tcp -d 10.96.0.10/32 --dport 80 -j DROP")]
    );
}

#[test]
fn session_affinity() {
    let s = sp("web", "10.96.0.10").affinity(600).build();
    let eps = vec![ep("10.244.1.5", true), ep("10.244.2.6", false)];
    let r = render_service(&s, &eps, &cfg(), &node());
    let svc = svc_chain(&s);
    let (a, b) = (sep_chain(&s, &eps[0]), sep_chain(&s, &eps[1]));
    let rules = chain(&r, &svc);
    assert_eq!(
        rules[1],
        format!("-A {svc} -m comment --comment \"{H} -> 10.244.1.5:8080\" -m recent --name {a} --rcheck --seconds 600 --reap -j {a}")
    );
    assert_eq!(
        rules[2],
        format!("-A {svc} -m comment --comment \"{H} -> 10.244.2.6:8080\" -m recent --name {b} --rcheck --seconds 600 --reap -j {b}")
    );
    assert!(rules[3].contains("--probability 0.5000000000"));
    assert_eq!(
        chain(&r, &a)[1],
        format!("-A {a} -m comment --comment \"{H}\" -m recent --name {a} --set -m tcp -p tcp -j DNAT --to-destination 10.244.1.5:8080")
    );
}

#[test]
fn terminating_fallback() {
    let s = sp("web", "10.96.0.10").build();
    // A ready endpoint wins over a terminating one.
    let eps = vec![terminating("10.244.1.5", true), ep("10.244.2.6", false)];
    let r = render_service(&s, &eps, &cfg(), &node());
    let svc = svc_chain(&s);
    let rules = chain(&r, &svc);
    assert_eq!(rules.len(), 2);
    assert!(rules[1].contains("10.244.2.6:8080"));
    assert!(!r
        .nat_chains
        .iter()
        .any(|(c, _)| *c == sep_chain(&s, &eps[0])));
    // None ready: the serving terminating endpoint is used.
    let eps = vec![
        terminating("10.244.1.5", true),
        ep("10.244.2.6", false).unready(),
    ];
    let r = render_service(&s, &eps, &cfg(), &node());
    let rules = chain(&r, &svc);
    assert_eq!(rules.len(), 2);
    assert!(rules[1].contains("10.244.1.5:8080"));
}

#[test]
fn ipv6_and_comment_escaping() {
    let mut c = ProxierConfig::new(IpFamily::V6);
    c.local_detector = LocalDetector::Cidrs(vec![
        "10.244.0.0/16".parse().unwrap(),
        "fd00:244::/64".parse().unwrap(),
    ]);
    let s = sp("web", "fd00:96::10").build();
    let e = ep("fd00:244::5", true);
    let r = render_service(&s, std::slice::from_ref(&e), &c, &node());
    assert!(r.nat_services[0].contains("-d fd00:96::10/128 --dport 80"));
    let svc = chain(&r, &svc_chain(&s));
    assert!(svc[0].contains("! -s fd00:244::/64 -j KUBE-MARK-MASQ"));
    assert!(chain(&r, &sep_chain(&s, &e))[1].ends_with("--to-destination [fd00:244::5]:8080"));
    assert_eq!(
        kp_iptables::Match::comment("a\"b\\c\nd").to_string(),
        "-m comment --comment \"abcd\""
    );
}

// ---------------------------------------------------------------------------
// Proxier with a recording backend
// ---------------------------------------------------------------------------

#[derive(Default)]
struct Record {
    restores: Vec<String>,
    chains: HashMap<String, Vec<String>>,
    inserted: Vec<(String, String, Vec<String>)>,
    fail_next_restore: bool,
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Record>>);

impl IptablesBackend for Recorder {
    fn restore(&mut self, input: &str) -> Result<(), DataplaneError> {
        let mut r = self.0.lock().unwrap();
        if std::mem::take(&mut r.fail_next_restore) {
            return Err(DataplaneError::Apply {
                tool: "test".into(),
                message: "injected".into(),
            });
        }
        // `-I CHAIN 1 ...` lines are jumps ensured in the restore itself.
        let mut table = String::new();
        for line in input.lines() {
            if let Some(t) = line.strip_prefix('*') {
                table = t.to_string();
            } else if let Some(rest) = line.strip_prefix("-I ") {
                let args = split_args(rest);
                assert_eq!(args.get(1).map(String::as_str), Some("1"), "{line}");
                r.inserted
                    .push((table.clone(), args[0].clone(), args[2..].to_vec()));
            }
        }
        r.restores.push(input.to_string());
        Ok(())
    }
    fn save_table(&mut self, table: &str) -> Result<String, DataplaneError> {
        let r = self.0.lock().unwrap();
        let mut out = String::new();
        for c in r.chains.get(table).into_iter().flatten() {
            out.push_str(&format!(":{c} - [0:0]\n"));
        }
        for (t, c, args) in &r.inserted {
            // Only our jumps are inserted: listed as iptables-save lists them.
            let listed = kp_iptables::jumps()
                .into_iter()
                .find(|j| j.table == t && j.table == table && j.from == c && j.args() == *args);
            if let Some(j) = listed {
                out.push_str(&format!("{}\n", j.save_line()));
            }
        }
        Ok(out)
    }
    fn chains(&mut self, table: &str) -> Result<Vec<String>, DataplaneError> {
        Ok(self
            .0
            .lock()
            .unwrap()
            .chains
            .get(table)
            .cloned()
            .unwrap_or_default())
    }
    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, DataplaneError> {
        Ok(self
            .0
            .lock()
            .unwrap()
            .chains
            .get(table)
            .is_some_and(|c| c.iter().any(|x| x == chain)))
    }
    fn rule_exists(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, DataplaneError> {
        Ok(self
            .0
            .lock()
            .unwrap()
            .inserted
            .iter()
            .any(|(t, c, a)| t == table && c == chain && a == args))
    }
    fn delete_rule(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<(), DataplaneError> {
        let mut r = self.0.lock().unwrap();
        if let Some(i) = r
            .inserted
            .iter()
            .position(|(t, c, a)| t == table && c == chain && a == args)
        {
            r.inserted.remove(i);
        }
        Ok(())
    }
}

/// Splits an iptables-restore rule line into arguments ("..." quoted).
fn split_args(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for ch in line.chars() {
        match ch {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn state(services: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    let mut st = ProxyState::new(IpFamily::V4, node());
    for (s, eps) in services {
        st.endpoints.insert(s.name.clone(), Arc::new(eps));
        st.services.insert(s.name.clone(), Arc::new(s));
    }
    st
}

/// Chains declared (`:NAME`) in the nat section of a restore input.
fn declared_nat(input: &str) -> BTreeSet<String> {
    let nat = input.split("*nat").nth(1).unwrap_or("");
    nat.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect()
}

#[test]
fn partial_sync_writes_only_changed_chains() {
    let rec = Recorder::default();
    let mut p = IptablesProxier::new(cfg(), Box::new(rec.clone()));
    let web = sp("web", "10.96.0.10").build();
    let db = sp("db", "10.96.0.11").build();
    let web_eps = vec![ep("10.244.1.5", true), ep("10.244.2.6", false)];
    let db_eps = vec![ep("10.244.1.9", true)];
    let st = state(vec![
        (web.clone(), web_eps.clone()),
        (db.clone(), db_eps.clone()),
    ]);
    let r = p.sync(&st, &BTreeSet::new(), false).unwrap();
    assert!(r.full, "the first sync is a full one");
    {
        let rec = rec.0.lock().unwrap();
        let first = &rec.restores[0];
        let d = declared_nat(first);
        assert!(d.contains(&svc_chain(&web)) && d.contains(&svc_chain(&db)));
        assert!(d.contains(&sep_chain(&db, &db_eps[0])));
        assert!(first.starts_with("*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n"));
        // Every jump into our chains was installed.
        assert_eq!(rec.inserted.len(), kp_iptables::jumps().len());
    }

    // db loses its endpoint for another one: only db's chains are written,
    // the old SEP chain is deleted, web's chains are untouched.
    let db_eps2 = vec![ep("10.244.1.10", true)];
    let st2 = state(vec![
        (web.clone(), web_eps.clone()),
        (db.clone(), db_eps2.clone()),
    ]);
    let changed: BTreeSet<ServicePortName> = [db.name.clone()].into();
    let r = p.sync(&st2, &changed, false).unwrap();
    assert!(!r.full);
    let rec_g = rec.0.lock().unwrap();
    let second = rec_g.restores[1].clone();
    drop(rec_g);
    let d = declared_nat(&second);
    let old_sep = sep_chain(&db, &db_eps[0]);
    // The top-level chains did not change (db kept one endpoint): they are
    // left as they are in the kernel.
    let expected: BTreeSet<String> = [svc_chain(&db), sep_chain(&db, &db_eps2[0]), old_sep.clone()]
        .into_iter()
        .collect();
    assert_eq!(d, expected, "restore input:\n{second}");
    assert!(second.contains(&format!("-X {old_sep}\n")));
    assert!(!second.contains(&format!("-A {}", svc_chain(&web))));
    assert!(!second.contains("KUBE-SERVICES"), "{second}");
    assert!(!second.contains("*mangle") && !second.contains("*filter"));

    // A change that renders the same rules writes nothing at all.
    let r = p.sync(&st2, &changed, false).unwrap();
    assert!(!r.full);
    assert_eq!(rec.0.lock().unwrap().restores.len(), 2);

    // Deleting a service deletes all its chains, and rewrites KUBE-SERVICES
    // (its line goes) whole: web's jump is still there.
    let st3 = state(vec![(web.clone(), web_eps.clone())]);
    p.sync(&st3, &changed, false).unwrap();
    let fourth = rec.0.lock().unwrap().restores[2].clone();
    assert!(fourth.contains(&format!("-X {}\n", svc_chain(&db))));
    assert!(fourth.contains(&format!("-X {}\n", sep_chain(&db, &db_eps2[0]))));
    assert!(declared_nat(&fourth).contains("KUBE-SERVICES"), "{fourth}");
    assert!(fourth.contains(&format!("--dport 80 -j {}", svc_chain(&web))));
    assert!(!fourth.contains(&format!("-j {}", svc_chain(&db))));

    // A failed sync makes the next one full, and a full sync deletes chains
    // it finds in the kernel but does not want.
    rec.0.lock().unwrap().fail_next_restore = true;
    assert!(p.sync(&st2, &changed, false).is_err());
    rec.0.lock().unwrap().chains.insert(
        "nat".into(),
        vec![
            "PREROUTING".into(),
            "KUBE-SERVICES".into(),
            "KUBE-SVC-STALESTALESTALE".into(),
            "MY-OWN".into(),
        ],
    );
    let r = p.sync(&st3, &BTreeSet::new(), false).unwrap();
    assert!(r.full);
    let fifth = rec.0.lock().unwrap().restores.last().unwrap().clone();
    assert!(fifth.contains("-X KUBE-SVC-STALESTALESTALE\n"));
    assert!(!fifth.contains("MY-OWN"));
    assert!(!fifth.contains("-X KUBE-SERVICES"));
    // Jumps are not duplicated.
    assert_eq!(
        rec.0.lock().unwrap().inserted.len(),
        kp_iptables::jumps().len()
    );

    // A forced full sync after successful ones deletes what it last wrote
    // and no longer renders, without listing the chains (a leftover only a
    // listing would show waits for the next start or failed sync).
    p.sync(&st2, &BTreeSet::new(), true).unwrap();
    rec.0
        .lock()
        .unwrap()
        .chains
        .insert("nat".into(), vec!["KUBE-SVC-LEFTOVERLEFTOVER".into()]);
    let r = p.sync(&st3, &BTreeSet::new(), true).unwrap();
    assert!(r.full);
    let last = rec.0.lock().unwrap().restores.last().unwrap().clone();
    assert!(last.contains(&format!("-X {}\n", svc_chain(&db))), "{last}");
    assert!(last.contains(&format!("-X {}\n", sep_chain(&db, &db_eps2[0]))));
    assert!(!last.contains("LEFTOVER"), "{last}");
}

#[test]
fn canary_and_cleanup() {
    let rec = Recorder::default();
    let mut p = IptablesProxier::new(cfg(), Box::new(rec.clone()));
    let st = state(vec![(
        sp("web", "10.96.0.10").build(),
        vec![ep("10.244.1.5", true)],
    )]);
    assert!(!p.rules_lost(), "nothing programmed yet");
    p.sync(&st, &BTreeSet::new(), false).unwrap();
    assert!(p.rules_lost(), "the recorder has no canary chain");
    rec.0
        .lock()
        .unwrap()
        .chains
        .insert("mangle".into(), vec!["KUBE-PROXY-CANARY".into()]);
    assert!(p.sync(&st, &BTreeSet::new(), false).unwrap().full);
    assert!(!p.rules_lost());

    rec.0.lock().unwrap().chains.insert(
        "filter".into(),
        vec!["INPUT".into(), "KUBE-FORWARD".into(), "USER-CHAIN".into()],
    );
    rec.0.lock().unwrap().chains.insert(
        "nat".into(),
        vec![
            "KUBE-SERVICES".into(),
            "KUBE-SEP-AAAA".into(),
            "KUBE-USER".into(),
        ],
    );
    p.cleanup().unwrap();
    let rec = rec.0.lock().unwrap();
    assert!(rec.inserted.is_empty(), "jumps left: {:?}", rec.inserted);
    let last = rec.restores.last().unwrap();
    for c in [
        "KUBE-PROXY-CANARY",
        "KUBE-FORWARD",
        "KUBE-SERVICES",
        "KUBE-SEP-AAAA",
    ] {
        assert!(
            last.contains(&format!("-X {c}\n")),
            "{c} not deleted:\n{last}"
        );
    }
    assert!(!last.contains("USER-CHAIN") && !last.contains("KUBE-USER"));
}

#[test]
fn dry_run_render_is_the_full_restore_input() {
    let p = IptablesProxier::new(cfg(), Box::new(Recorder::default()));
    let web = sp("web", "10.96.0.10").build();
    let st = state(vec![(web.clone(), vec![ep("10.244.1.5", true)])]);
    let out = p.render(&st);
    assert!(out.starts_with("*mangle\n"));
    assert!(out.contains(&format!(":{} - [0:0]\n", svc_chain(&web))));
    assert!(out.contains("-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n"));
    assert!(out.contains("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n"));
    assert!(out.contains("-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n"));
    // The nodeport jump is the last rule of nat KUBE-SERVICES.
    let nat = out.split("*nat").nth(1).unwrap();
    let services: Vec<&str> = nat
        .lines()
        .filter(|l| l.starts_with("-A KUBE-SERVICES"))
        .collect();
    assert!(services.last().unwrap().ends_with("-j KUBE-NODEPORTS"));
    let mut c = cfg();
    c.masquerade_bit = 5;
    let p = IptablesProxier::new(c, Box::new(Recorder::default()));
    assert!(p.render(&st).contains("--or-mark 0x20\n"));
}

#[test]
fn top_level_chains_are_compared_again_after_a_change_that_kept_them() {
    let rec = Recorder::default();
    let mut p = IptablesProxier::new(cfg(), Box::new(rec.clone()));
    let web = sp("web", "10.96.0.10").build();
    let db = sp("db", "10.96.0.11").build();
    let two = |a: &str, b: &str| vec![ep(a, true), ep(b, false)];
    let st = state(vec![
        (web.clone(), two("10.244.1.5", "10.244.2.6")),
        (db.clone(), vec![ep("10.244.1.9", true)]),
    ]);
    p.sync(&st, &BTreeSet::new(), false).unwrap();
    let restores = |rec: &Recorder| rec.0.lock().unwrap().restores.clone();

    // web's endpoint replaced: its top-level lines stay, none is written.
    let st2 = state(vec![
        (web.clone(), two("10.244.1.5", "10.244.2.7")),
        (db.clone(), vec![ep("10.244.1.9", true)]),
    ]);
    let changed: BTreeSet<ServicePortName> = [web.name.clone()].into();
    p.sync(&st2, &changed, false).unwrap();
    let second = restores(&rec)[1].clone();
    assert!(!second.contains("KUBE-SERVICES") && !second.contains("*filter"));

    // Then web loses every endpoint: its ClusterIP line leaves nat
    // KUBE-SERVICES for a REJECT in filter KUBE-SERVICES. Both are written,
    // and only they: the other top-level chains are still known to be as
    // written two syncs ago.
    let st3 = state(vec![
        (web.clone(), vec![]),
        (db.clone(), vec![ep("10.244.1.9", true)]),
    ]);
    p.sync(&st3, &changed, false).unwrap();
    let third = restores(&rec)[2].clone();
    let filter = third.split("*nat").next().unwrap();
    assert!(filter.contains(":KUBE-SERVICES - [0:0]"), "{third}");
    assert!(
        filter.contains("default/web:http has no endpoints"),
        "{third}"
    );
    assert!(declared_nat(&third).contains("KUBE-SERVICES"), "{third}");
    assert!(
        !third.contains(&format!("-j {}", svc_chain(&web))),
        "{third}"
    );
    for unchanged in [
        "KUBE-NODEPORTS",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-POSTROUTING",
    ] {
        assert!(
            !third.contains(&format!(":{unchanged} ")),
            "{unchanged}:\n{third}"
        );
    }
}

/// Enough Services to be rendered in two halves on two threads: every
/// Service's chains and rules are in the input (none lost with a half),
/// and their lines in nat KUBE-SERVICES come in the order of the
/// Services' names.
#[test]
fn many_services_render_whole_and_in_order() {
    let services: Vec<(ServicePort, Vec<Endpoint>)> = (0..700u32)
        .map(|i| {
            let (a, b) = (i / 250, i % 250 + 1);
            (
                sp(&format!("s{i:03}"), &format!("10.96.{a}.{b}")).build(),
                vec![ep(&format!("10.244.{a}.{b}"), i % 2 == 0)],
            )
        })
        .collect();
    let st = state(services);
    let p = IptablesProxier::new(cfg(), Box::new(Recorder::default()));
    let text = p.render(&st);
    let lines: BTreeSet<&str> = text.lines().collect();
    let mut want_services = Vec::new();
    for (name, s) in &st.services {
        let r = render_service(s, st.endpoints_of(name), &cfg(), &st.node);
        for (c, rules) in &r.nat_chains {
            assert!(lines.contains(format!(":{c} - [0:0]").as_str()), "{c}");
            for l in rules {
                assert!(lines.contains(l.as_str()), "missing: {l}");
            }
        }
        want_services.extend(r.nat_services);
    }
    let nat = text.split("*nat").nth(1).unwrap();
    let got: Vec<&str> = nat
        .lines()
        .filter(|l| l.starts_with("-A KUBE-SERVICES "))
        .collect();
    assert_eq!(want_services.len(), 700);
    assert_eq!(got[..want_services.len()], want_services[..]);
}

#[test]
fn host_rules_decide_the_invalid_drop_and_the_nfacct_matches() {
    use kp_iptables::{HostRules, Skeleton};
    let render_service_with =
        |s: &ServicePort, eps: &[Endpoint], c: &ProxierConfig, n: &NodeInfo, h: &HostRules| {
            lines(kp_iptables::render_service_with(s, eps, c, n, h))
        };
    let sk = Skeleton::new(&cfg());
    let counted = HostRules {
        invalid_drop: true,
        nfacct: true,
    };
    // Upstream v1.36's text for each (pkg/proxy/iptables/proxier.go).
    assert_eq!(
        format!("-A KUBE-FORWARD {}", sk.forward_rules_for(&counted)[0]),
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP"
    );
    assert_eq!(
        format!(
            "-A KUBE-FORWARD {}",
            sk.forward_rules_for(&HostRules::default())[0]
        ),
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP"
    );
    let liberal = HostRules {
        invalid_drop: false,
        nfacct: true,
    };
    let fwd = sk.forward_rules_for(&liberal);
    assert_eq!(fwd.len(), 2);
    assert!(
        fwd.iter().all(|l| !l.to_string().contains("INVALID")),
        "{fwd:?}"
    );

    // Localhost NodePorts: the counting jump first, IPv4 only.
    let s = sp("web", "10.96.0.10").node_port(30080).build();
    let eps = vec![ep("10.244.2.6", false)];
    let ext = svc_chain(&s).replace("KUBE-SVC-", "KUBE-EXT-");
    let mut c = cfg();
    c.localhost_nodeports = true;
    let r = render_service_with(&s, &eps, &c, &node(), &counted);
    assert_eq!(
        r.nat_nodeports,
        vec![
            format!("-A KUBE-NODEPORTS -m comment --comment \"{H}\" -m tcp -p tcp -d 127.0.0.0/8 --dport 30080 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j {ext}"),
            format!("-A KUBE-NODEPORTS -m comment --comment \"{H}\" -m tcp -p tcp --dport 30080 -j {ext}"),
        ]
    );
    // Not without the counters, nor without localhost NodePorts.
    let r = render_service_with(&s, &eps, &c, &node(), &HostRules::default());
    assert_eq!(r.nat_nodeports.len(), 1);
    let r = render_service_with(&s, &eps, &cfg(), &node(), &counted);
    assert_eq!(r.nat_nodeports.len(), 1);
}

#[test]
fn sync_reports_rules_owned_and_written_per_table() {
    use kp_iptables::HostRules;
    let rec = Recorder::default();
    let mut p = IptablesProxier::new(cfg(), Box::new(rec.clone())).with_host_rules(HostRules {
        invalid_drop: false,
        nfacct: false,
    });
    let web = sp("web", "10.96.0.10").build();
    let db = sp("db", "10.96.0.11").build();
    let st = state(vec![
        (
            web.clone(),
            vec![ep("10.244.1.5", true), ep("10.244.2.6", false)],
        ),
        (db.clone(), vec![ep("10.244.1.9", true)]),
    ]);
    // The `-A KUBE-` lines of `table` in a restore input.
    let count = |text: &str, table: &str| -> u64 {
        text.split(&format!("*{table}\n"))
            .nth(1)
            .map(|t| t.split("COMMIT").next().unwrap_or(""))
            .unwrap_or("")
            .lines()
            .filter(|l| l.starts_with("-A KUBE-"))
            .count() as u64
    };
    let r = p.sync(&st, &BTreeSet::new(), false).unwrap();
    let full = rec.0.lock().unwrap().restores.last().unwrap().clone();
    // KUBE-FORWARD without the INVALID drop: two rules in filter.
    assert_eq!(count(&full, "filter"), 2, "{full}");
    assert_eq!(
        r.iptables_rules,
        vec![
            ("filter", 2, 2),
            ("nat", count(&full, "nat"), count(&full, "nat"))
        ]
    );
    let nat_total = count(&full, "nat");

    // One endpoint more for db: its chains only are written; the total grows
    // by the new endpoint's chain (2 rules) and its selection rule.
    let st = state(vec![
        (
            web.clone(),
            vec![ep("10.244.1.5", true), ep("10.244.2.6", false)],
        ),
        (
            db.clone(),
            vec![ep("10.244.1.9", true), ep("10.244.2.9", false)],
        ),
    ]);
    let changed: BTreeSet<ServicePortName> = [db.name.clone()].into();
    let r = p.sync(&st, &changed, false).unwrap();
    assert!(!r.full);
    let partial = rec.0.lock().unwrap().restores.last().unwrap().clone();
    assert_eq!(
        r.iptables_rules,
        vec![
            ("filter", 2, count(&partial, "filter")),
            ("nat", nat_total + 3, count(&partial, "nat"))
        ]
    );
    assert!(count(&partial, "nat") < nat_total + 3, "{partial}");
}
