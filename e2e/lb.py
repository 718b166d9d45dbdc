#!/usr/bin/env python3
"""The lab's load balancer (the lab has no cloud): what kind's
cloud-provider-kind gives a cluster, done with the lab's own routing table.

For each Service of type LoadBalancer (without a loadBalancerClass):
  - an address per family of spec.ipFamilies from the lab's pools (or
    spec.loadBalancerIP when it is in a pool), written to
    status.loadBalancer.ingress with ipMode VIP;
  - a route in the lab namespace (where e2e.test runs) from that address to
    the nodes, spread per flow (the lab sets fib_multipath_hash_policy=1):
    externalTrafficPolicy Cluster: every Ready node; Local: the Ready nodes
    whose healthCheckNodePort answers 200 on /healthz, checked every poll as
    a cloud LB's health checks do, and every Ready node when none answers
    (clouds fail open); sessionAffinity ClientIP: one node (a cloud LB pins a
    client address to one backend; the lab's clients share one address);
    the routes' source (--src) is the lab's client address, outside the
    nodes' network as a client of a cloud LB is (the specs check that the
    client's address, preserved with externalTrafficPolicy Local, is not in
    the nodes' /16 or /64);
  - the finalizer service.kubernetes.io/load-balancer-cleanup, removed once
    the route is gone (after deletion or a change of type), as the cloud
    service controller does.
Nodes labelled node.kubernetes.io/exclude-from-external-load-balancers are
left out. Polls the API every half second.

usage: lb.py --api URL --token-file F --ca F --pool CIDR [--pool CIDR6]
             --node NAME=IP[,IP6] ... [--src IP [--src IP6]] [--once] [--ip-cmd PATH]"""
import argparse, concurrent.futures, ipaddress, json, ssl, subprocess, time, urllib.error, urllib.request

p = argparse.ArgumentParser()
p.add_argument("--api", required=True)
p.add_argument("--token-file", required=True)
p.add_argument("--ca", required=True)
p.add_argument("--pool", action="append", required=True)
p.add_argument("--node", action="append", default=[])
p.add_argument("--src", action="append", default=[], help="the lab's client address per family (outside the nodes' network)")
p.add_argument("--once", action="store_true", help="one pass, for tests")
p.add_argument("--ip-cmd", default="ip", help="the route tool (tests record its arguments instead)")
a = p.parse_args()
TOKEN = open(a.token_file).read().strip()
CTX = ssl.create_default_context(cafile=a.ca)
FINALIZER = "service.kubernetes.io/load-balancer-cleanup"
EXCLUDE = "node.kubernetes.io/exclude-from-external-load-balancers"


def family(addr):
    """The Service ipFamilies name of an address or CIDR."""
    return "IPv6" if ":" in addr else "IPv4"


POOLS = {family(c): ipaddress.ip_network(c) for c in a.pool}
SRC = {family(ip): ip for ip in a.src}
NODE_IPS = {}  # node name -> {"IPv4": ip, "IPv6": ip}
for n in a.node:
    name, ips = n.split("=", 1)
    NODE_IPS[name] = {family(ip): ip for ip in ips.split(",")}

allocated = {}  # (uid, family) -> ip
routes = {}     # ip -> tuple of next hops (what the lab's table holds)


def log(*m):
    print(time.strftime("%H:%M:%S"), *m, flush=True)


def api(method, path, body=None, ctype="application/merge-patch+json"):
    req = urllib.request.Request(a.api + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + TOKEN, "Content-Type": ctype})
    with urllib.request.urlopen(req, context=CTX, timeout=10) as r:
        return json.load(r)


def ready_nodes():
    out = []
    for n in api("GET", "/api/v1/nodes")["items"]:
        name = n["metadata"]["name"]
        if EXCLUDE in (n["metadata"].get("labels") or {}) or name not in NODE_IPS:
            continue
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions") or []):
            out.append(name)
    return sorted(out)


def healthy(ip, port):
    host = f"[{ip}]" if ":" in ip else ip
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


def allocate(svc, fam):
    key = (svc["metadata"]["uid"], fam)
    if key in allocated:
        return allocated[key]
    pool, taken = POOLS.get(fam), set(allocated.values())
    if pool is None:
        return None
    want = svc["spec"].get("loadBalancerIP")
    if want and ipaddress.ip_address(want).version == pool.version and ipaddress.ip_address(want) in pool \
            and want not in taken:
        ip = want
    else:
        ip = next((str(h) for h in pool.hosts() if str(h) not in taken), None)
    if ip:
        allocated[key] = ip
    return ip


def set_route(ip, hops):
    if routes.get(ip) == hops:
        return
    plen = "/128" if ":" in ip else "/32"
    src = SRC.get(family(ip))
    src = ["src", src] if src else []
    if not hops:
        subprocess.run([a.ip_cmd, "route", "del", ip + plen], capture_output=True)
        routes.pop(ip, None)
        log("route", ip, "removed")
        return
    if len(hops) == 1:
        cmd = [a.ip_cmd, "route", "replace", ip + plen] + src + ["via", hops[0]]
    else:
        cmd = [a.ip_cmd, "route", "replace", ip + plen] + src + [w for h in hops for w in ("nexthop", "via", h)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        log("route", ip, "failed:", r.stderr.strip())
        return
    routes[ip] = hops
    log("route", ip, "->", ", ".join(hops))


def path(svc, sub=""):
    m = svc["metadata"]
    return f"/api/v1/namespaces/{m['namespace']}/services/{m['name']}{sub}"


def release(svc):
    """The Service is no LoadBalancer of ours (any more): its routes, addresses, status and finalizer go."""
    uid = svc["metadata"]["uid"]
    for key in [k for k in allocated if k[0] == uid]:
        set_route(allocated.pop(key), ())
    if (svc.get("status", {}).get("loadBalancer") or {}).get("ingress") and not svc["metadata"].get("deletionTimestamp"):
        api("PATCH", path(svc, "/status"), {"status": {"loadBalancer": {}}})
    fins = svc["metadata"].get("finalizers") or []
    if FINALIZER in fins:
        api("PATCH", path(svc), {"metadata": {"finalizers": [f for f in fins if f != FINALIZER],
                                              "resourceVersion": svc["metadata"]["resourceVersion"]}})
        log("released", svc["metadata"]["namespace"] + "/" + svc["metadata"]["name"])


def ours(svc):
    return svc["spec"].get("type") == "LoadBalancer" and not svc["spec"].get("loadBalancerClass")


def reconcile(svc, nodes, pool):
    m, spec = svc["metadata"], svc["spec"]
    if m.get("deletionTimestamp") or not ours(svc):
        release(svc)
        return set()
    if FINALIZER not in (m.get("finalizers") or []):
        api("PATCH", path(svc), {"metadata": {"finalizers": (m.get("finalizers") or []) + [FINALIZER],
                                              "resourceVersion": m["resourceVersion"]}})
    ips = [(f, allocate(svc, f)) for f in spec.get("ipFamilies") or ["IPv4"]]
    ips = [(f, ip) for f, ip in ips if ip]
    ingress = [{"ip": ip, "ipMode": "VIP"} for _, ip in ips]
    if (svc.get("status", {}).get("loadBalancer") or {}).get("ingress") != ingress:
        api("PATCH", path(svc, "/status"), {"status": {"loadBalancer": {"ingress": ingress}}})
        log("ingress", m["namespace"] + "/" + m["name"], [ip for _, ip in ips])
    for fam, ip in ips:
        cand = [n for n in nodes if fam in NODE_IPS[n]]
        if spec.get("externalTrafficPolicy") == "Local" and spec.get("healthCheckNodePort"):
            port = spec["healthCheckNodePort"]
            ok = list(pool.map(lambda n: healthy(NODE_IPS[n][fam], port), cand))
            cand = [n for n, good in zip(cand, ok) if good] or cand
        if spec.get("sessionAffinity") == "ClientIP" and cand:
            cand = [cand[int(ipaddress.ip_address(ip)) % len(cand)]]
        set_route(ip, tuple(NODE_IPS[n][fam] for n in cand))
    return {m["uid"]}


def main():
    pool = concurrent.futures.ThreadPoolExecutor(8)
    log("load balancer for the lab: pools", ", ".join(map(str, POOLS.values())))
    while True:
        try:
            nodes = ready_nodes()
            live = set()
            for svc in api("GET", "/api/v1/services")["items"]:
                try:
                    live |= reconcile(svc, nodes, pool)
                except urllib.error.HTTPError as e:
                    if e.code != 409:  # a conflict: the next poll sees the newer object
                        log("service", svc["metadata"]["name"], e)
            # Services deleted without our finalizer (or before we saw them)
            for key in [k for k in allocated if k[0] not in live]:
                set_route(allocated.pop(key), ())
        except Exception as e:
            log("poll:", e)
        if a.once:
            return
        time.sleep(0.5)


main()
