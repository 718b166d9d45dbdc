//! Micro-benchmarks of the hot pure parts: API object -> model conversion,
//! the change tracker (one EndpointSlice update + take_changes with a big
//! cluster present) and per-Service rule rendering (nftables and iptables)
//! for each kind of Service the generator makes.
//!
//! `cargo bench -p kp-bench --bench model` (CI only compiles it, through
//! `cargo clippy --all-targets`).

use std::sync::Arc;
use std::time::SystemTime;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_bench::tracked;
use kp_model::{
    convert_endpoint_slice, convert_service, IpFamily, LocalDetector, ProxierConfig, ProxyState,
    ServicePort,
};

fn objects(n: u32, m: u32) -> (Vec<Service>, Vec<EndpointSlice>) {
    kp_bench::parsed_cluster(n, m, true).expect("the generated cluster parses")
}

/// The generator's kinds, by index (see `kp_bench::cluster_with`).
const KINDS: [(&str, usize); 5] = [
    ("clusterip", 0),
    ("nodeport", 1),
    ("multiport", 3),
    ("loadbalancer-etp-local", 5),
    ("affinity", 7),
];

fn bench_convert(c: &mut Criterion) {
    let (svcs, slices) = objects(20, 10);
    let (_, big) = objects(1, 1000);
    let mut g = c.benchmark_group("convert");
    for (kind, i) in KINDS {
        g.bench_function(format!("service/{kind}"), |b| {
            b.iter(|| {
                let mut w = Vec::new();
                convert_service(&svcs[i], IpFamily::V4, None, &mut w)
            })
        });
    }
    g.bench_function("endpoint_slice/10", |b| {
        b.iter(|| {
            let mut w = Vec::new();
            convert_endpoint_slice(&slices[0], IpFamily::V4, "node1", &mut w)
        })
    });
    g.bench_function("endpoint_slice/1000", |b| {
        b.iter(|| {
            let mut w = Vec::new();
            convert_endpoint_slice(&big[0], IpFamily::V4, "node1", &mut w)
        })
    });
    g.finish();
}

fn bench_tracker(c: &mut Criterion) {
    let mut g = c.benchmark_group("tracker");
    for n in [1_000u32, 10_000] {
        let (svcs, slices) = objects(n, 10);
        let mut tr = tracked(&svcs, &slices);
        // Alternate between two generations of one slice so every update is
        // a real change.
        let gens: Vec<EndpointSlice> = (1..=2)
            .map(|gen| {
                serde_json::from_value(kp_bench::slice(n / 2, 10, gen, false))
                    .expect("generated EndpointSlice parses")
            })
            .collect();
        let mut k = 0;
        g.bench_function(format!("endpoint_change+take_changes/{n}"), |b| {
            b.iter(|| {
                k ^= 1;
                let _ = tr.update_endpoint_slice(&gens[k], SystemTime::now());
                tr.take_changes()
            })
        });
    }
    let (svcs, slices) = objects(1_000, 10);
    g.sample_size(20);
    g.bench_function("load+take_changes/1000", |b| {
        b.iter(|| tracked(&svcs, &slices))
    });
    g.finish();
}

fn service_ports(state: &ProxyState, i: usize) -> Arc<ServicePort> {
    let name = format!("svc-{i}");
    state
        .services
        .iter()
        .find(|(k, _)| *k.service.name == *name)
        .map(|(_, v)| v.clone())
        .expect("generated Service is in the model")
}

fn bench_render(c: &mut Criterion) {
    let (svcs, slices) = objects(20, 10);
    let tr = tracked(&svcs, &slices);
    let state = tr.state();
    let mut cfg = ProxierConfig::new(IpFamily::V4);
    cfg.local_detector = LocalDetector::Cidrs(vec!["10.128.0.0/9".parse().expect("valid CIDR")]);
    let mut g = c.benchmark_group("render");
    for (kind, i) in KINDS {
        let sp = service_ports(state, i);
        let eps = state.endpoints_of(&sp.name);
        g.bench_function(format!("nftables/{kind}"), |b| {
            b.iter(|| kp_nftables::render_service(&sp, eps, &cfg, &state.node))
        });
        g.bench_function(format!("iptables/{kind}"), |b| {
            b.iter(|| kp_iptables::render_service(&sp, eps, &cfg, &state.node))
        });
    }
    // A whole-ruleset render through the proxier (no kernel involved).
    let (svcs, slices) = objects(1_000, 10);
    let tr = tracked(&svcs, &slices);
    g.sample_size(20);
    g.bench_function("nftables/full-ruleset/1000", |b| {
        b.iter_batched(
            || {
                kp_nftables::NftablesProxier::new(
                    cfg.clone(),
                    Box::new(kp_nftables::NftCli::default()),
                )
            },
            |dp| kp_model::Dataplane::render(&dp, tr.state()),
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench_convert, bench_tracker, bench_render);
criterion_main!(benches);
