#!/usr/bin/env python3
"""The e2e lab's own tests: the parts of the harness whose mistakes would make
a run lie (a failure counted as a pass, a skip without its reason, a lab DNS
that answers wrongly, a bad option taken silently). CI runs them before the
lab itself: `python3 e2e/test_harness.py`. Needs python3 and openssl; no root."""
import json, os, re, shutil, socket, ssl, struct, subprocess, sys, tempfile, threading, time, unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

E2E = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(E2E)

JUNIT = """<?xml version="1.0" encoding="UTF-8"?>
<testsuites><testsuite name="Kubernetes e2e suite">
 <testcase name="[It] [sig-network] Services should serve a basic endpoint from pods [sig-network, Conformance]" status="passed" time="12.4"></testcase>
 <testcase name="[It] [sig-network] Services should be able to create a functioning NodePort service [sig-network, Conformance]" status="failed" time="31.0">
  <failure message="curl timed out">curl timed out
second line</failure></testcase>
 <testcase name="[It] [sig-network] DNS should provide DNS for services [sig-network, Conformance]" status="skipped" time="0"><skipped message="skipped"/></testcase>
 <testcase name="[It] [sig-storage] Volumes should store data [sig-storage]" status="passed" time="3"></testcase>
 <testcase name="[SynchronizedBeforeSuite]" status="passed" time="1"></testcase>
 <testcase name="[It] [sig-network] Services should work after a panic [sig-network]" status="panicked" time="2"></testcase>
</testsuite></testsuites>
"""


def read(path):
    with open(path) as f:
        return f.read()


def run(*args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)


class Report(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kp-e2e-harness-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.junit = os.path.join(self.dir, "junit.xml")
        with open(self.junit, "w") as f:
            f.write(JUNIT)

    def summary(self, focus=r"\[sig-network\]"):
        out = os.path.join(self.dir, "ours-nftables", "result.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        r = run(sys.executable, os.path.join(E2E, "report.py"), "summary", self.junit, "--focus", focus,
                "--proxy", "ours", "--mode", "nftables", "--up", "40", "--run", "100", "--tree", "abc123", "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r, out

    def test_summary_counts_failures_and_panics_and_only_the_focus(self):
        r, out = self.summary()
        # the storage spec and the suite node are outside the focus; a panic is a failure
        self.assertEqual(r.stdout.strip().splitlines()[-1], "1 passed, 2 failed, 1 skipped")
        self.assertIn("FAILED: [sig-network] Services should be able to create a functioning NodePort service -- curl timed out", r.stderr)
        res = json.loads(read(out))
        self.assertEqual(res["counts"], {"passed": 1, "failed": 2, "skipped": 1})
        names = {s["name"]: s for s in res["specs"]}
        # JUnit's trailing label group is cut, the spec's own [Conformance]-free name kept
        self.assertIn("[sig-network] Services should serve a basic endpoint from pods", names)
        self.assertEqual(names["[sig-network] Services should be able to create a functioning NodePort service"]["failure"],
                         "curl timed out")

    def test_summary_of_a_narrower_focus(self):
        r, _ = self.summary(focus=r"\[sig-network\] Services should serve")
        self.assertEqual(r.stdout.strip(), "1 passed, 0 failed, 0 skipped")

    def test_docs_rewrites_only_the_results_section(self):
        _, out = self.summary()
        doc = os.path.join(self.dir, "e2e.md")
        with open(doc, "w") as f:
            f.write("# before\n\n<!-- e2e.sh results: begin -->\nold table\n<!-- e2e.sh results: end -->\n\nafter\n")
        r = run(sys.executable, os.path.join(E2E, "report.py"), "docs", out, "--out", doc)
        self.assertEqual(r.returncode, 0, r.stderr)
        text = read(doc)
        self.assertTrue(text.startswith("# before\n"))
        self.assertTrue(text.endswith("\n\nafter\n"))
        self.assertNotIn("old table", text)
        self.assertIn("| ours-nftables |", text)
        self.assertIn("| [sig-network] Services should serve a basic endpoint from pods | passed (12 s) |", text)
        self.assertIn("**failed** (31 s)", text)
        # a skipped spec gets no row; the failure's first line is listed
        self.assertNotIn("DNS should provide DNS for services |", text)
        self.assertIn("* ours-nftables: [sig-network] Services should be able to create a functioning NodePort service: `curl timed out`", text)

    def test_docs_section_rewrites_its_own_markers_only(self):
        _, out = self.summary()
        doc = os.path.join(self.dir, "e2e.md")
        with open(doc, "w") as f:
            f.write("<!-- e2e.sh results: begin -->\nmain table\n<!-- e2e.sh results: end -->\n"
                    "<!-- e2e.sh results families: begin -->\nold\n<!-- e2e.sh results families: end -->\n")
        r = run(sys.executable, os.path.join(E2E, "report.py"), "docs", out, "--out", doc, "--section", "families")
        self.assertEqual(r.returncode, 0, r.stderr)
        text = read(doc)
        self.assertIn("main table", text)
        self.assertNotIn("old", text)
        self.assertIn("| ours-nftables | ipv4 |", text)

    def test_docs_name_the_flags_a_run_added(self):
        out = os.path.join(self.dir, "bpf-maglev", "result.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        r = run(sys.executable, os.path.join(E2E, "report.py"), "summary", self.junit, "--proxy", "ours", "--mode", "bpf",
                "--args", "--bpf-lb-algorithm=maglev", "--up", "40", "--run", "100", "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(read(out))["proxy_args"], "--bpf-lb-algorithm=maglev")
        doc = os.path.join(self.dir, "e2e.md")
        with open(doc, "w") as f:
            f.write("<!-- e2e.sh results: begin -->\n<!-- e2e.sh results: end -->\n")
        r = run(sys.executable, os.path.join(E2E, "report.py"), "docs", out, "--out", doc)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("| bpf-maglev (`--bpf-lb-algorithm=maglev`) | ipv4 |", read(doc))


class Skips(unittest.TestCase):
    def test_every_skip_has_a_reason_compiles_and_is_documented(self):
        doc = read(os.path.join(REPO, "docs", "e2e.md"))
        n = 0
        for line in read(os.path.join(E2E, "skips.txt")).splitlines():
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            regex, sep, reason = line.partition("\t")
            self.assertEqual(sep, "\t", f"no TAB between regex and reason: {line!r}")
            reason, _, when = reason.partition("\t")
            if when:
                self.assertRegex(when, r"^(family|mode|proxy)!?=[a-z0-9]+(,[a-z0-9]+)*$", f"{regex!r}: condition {when!r}")
                self.assertIn(when, doc, f"{regex!r}: its condition is not in docs/e2e.md")
            self.assertGreater(len(reason.strip()), 20, f"no real reason for {regex!r}")
            re.compile(regex)
            self.assertNotIn("|", regex, f"{regex!r}: one spec pattern per line, so each has its reason")
            self.assertIn(regex.replace("|", "\\|"), doc, f"{regex!r} is not named in docs/e2e.md")
            n += 1
        self.assertGreater(n, 0)


class Options(unittest.TestCase):
    def e2e(self, *args):
        return run("bash", os.path.join(REPO, "e2e.sh"), *args)

    def test_bad_options_are_refused_before_anything_starts(self):
        for args, want in [(["--mode", "ipvs"], "--mode"), (["--proxy", "kube-router"], "--proxy"),
                           (["--bogus"], "unknown argument --bogus"), (["--nodes", "0"], "--nodes"),
                           (["--procs", "x"], "--procs"), (["--deploy", "helm"], "--deploy"),
                           (["--mode", "socketlb", "--deploy", "kubeadm"], "--deploy kubeadm"),
                           (["--ip-family", "ipv5"], "--ip-family"),
                           (["--migrate", "--ip-family", "ipv6"], "--ip-family ipv4 only"),
                           (["--proxy", "upstream", "--proxy-arg", "--bpf-lb-mode=dsr"], "--proxy-arg adds flags to ours"),
                           (["--deploy", "kubeadm", "--proxy-arg", "--bpf-lb-mode=dsr"], "--proxy-arg adds flags to ours"),
                           (["--proxy-arg", "maglev"], "one flag as the binary reads it"),
                           (["--proxy-arg", "--bpf-lb-mode dsr"], "one flag without spaces")]:
            r = self.e2e(*args)
            self.assertNotEqual(r.returncode, 0, args)
            self.assertIn(want, r.stderr, args)
            self.assertNotIn("run directory", r.stderr, args)

    def test_help_lists_every_option_the_script_takes(self):
        r = self.e2e("--help")
        self.assertEqual(r.returncode, 0)
        src = read(os.path.join(REPO, "e2e.sh"))
        taken = set(re.findall(r"^\s+(--[a-z-]+)\)", src, re.M))
        self.assertGreater(len(taken), 5)
        for o in taken:
            self.assertIn(o, r.stdout, f"{o} is taken but not in --help")


def dns_query(port, name, qtype, tcp=False):
    q = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    for part in name.split("."):
        q += bytes([len(part)]) + part.encode()
    q += b"\0" + struct.pack("!HH", qtype, 1)
    if tcp:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(struct.pack("!H", len(q)) + q)
            n = struct.unpack("!H", s.recv(2))[0]
            data = b""
            while len(data) < n:
                data += s.recv(n - len(data))
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(5)
            s.sendto(q, ("127.0.0.1", port))
            data = s.recv(4096)
    ident, flags, _, an = struct.unpack("!HHHH", data[:8])
    assert ident == 0x1234
    i = 12 + len(q) - 12  # past the question (echoed as sent)
    answers = []
    for _ in range(an):
        t, _, _, ln = struct.unpack("!HHIH", data[i + 2:i + 12])
        answers.append((t, data[i + 12:i + 12 + ln]))
        i += 12 + ln
    return flags & 0xF, answers


SERVICES = {"items": [
    {"metadata": {"namespace": "default", "name": "web"},
     "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.20", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}},
    {"metadata": {"namespace": "e2e", "name": "headless"},
     "spec": {"clusterIP": "None", "ports": [{"port": 8080}]}},
    {"metadata": {"namespace": "e2e", "name": "dual"},
     "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.30", "clusterIPs": ["10.96.0.30", "fd00:10:96::30"],
              "ports": [{"port": 80}]}},
    {"metadata": {"namespace": "e2e", "name": "ext"},
     "spec": {"type": "ExternalName", "externalName": "web.default.svc.cluster.local"}},
]}
SLICES = {"items": [
    {"metadata": {"namespace": "e2e", "name": "headless-x", "labels": {"kubernetes.io/service-name": "headless"}},
     "endpoints": [{"addresses": ["10.244.1.5"], "hostname": "pod-a", "conditions": {"ready": True}},
                   {"addresses": ["10.244.2.6"], "conditions": {"ready": False}}]},
    {"metadata": {"namespace": "e2e", "name": "headless-y", "labels": {"kubernetes.io/service-name": "headless"}},
     "addressType": "IPv6",
     "endpoints": [{"addresses": ["fd00:10:244:1::5"], "hostname": "pod-a", "conditions": {"ready": True}}]},
]}


class JSONHandler(BaseHTTPRequestHandler):
    """A stand-in API server's replies: a JSON body, or 404 for None."""
    def reply(self, body):
        if body is None:
            self.send_response(404); self.end_headers(); return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


class FakeAPI(JSONHandler):
    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer t0ken":
            self.send_response(401); self.end_headers(); return
        self.reply({"/api/v1/services": SERVICES, "/apis/discovery.k8s.io/v1/endpointslices": SLICES}.get(self.path))


class LabDNS(unittest.TestCase):
    """e2e/dns.py against an API that serves a fixed Service list over TLS."""

    @classmethod
    def setUpClass(cls):
        d = tempfile.mkdtemp(prefix="kp-e2e-dns-")
        cls.dir = d
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", f"{d}/k.pem", "-out", f"{d}/c.pem", check=True)
        with open(f"{d}/token", "w") as f:
            f.write("t0ken\n")
        cls.api = ThreadingHTTPServer(("127.0.0.1", 0), FakeAPI)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(f"{d}/c.pem", f"{d}/k.pem")
        cls.api.socket = ctx.wrap_socket(cls.api.socket, server_side=True)
        threading.Thread(target=cls.api.serve_forever, daemon=True).start()
        with socket.socket() as s:  # a free port for UDP and TCP both
            s.bind(("127.0.0.1", 0))
            cls.port = s.getsockname()[1]
        cls.dns = subprocess.Popen([sys.executable, os.path.join(E2E, "dns.py"), "--listen", "127.0.0.1", "--port",
                                    str(cls.port), "--api", f"https://127.0.0.1:{cls.api.server_address[1]}",
                                    "--token-file", f"{d}/token", "--ca", f"{d}/c.pem"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if dns_query(cls.port, "web.default.svc.cluster.local", 1)[1]:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        cls.tearDownClass()
        raise AssertionError("dns.py never answered for web.default.svc.cluster.local")

    @classmethod
    def tearDownClass(cls):
        cls.dns.kill()
        cls.dns.communicate()
        cls.api.shutdown()
        cls.api.server_close()
        shutil.rmtree(cls.dir, True)

    def test_cluster_ip(self):
        for tcp in (False, True):
            rcode, ans = dns_query(self.port, "web.default.svc.cluster.local", 1, tcp=tcp)
            self.assertEqual((rcode, ans), (0, [(1, socket.inet_aton("10.96.0.20"))]), f"tcp={tcp}")

    def test_headless_gives_ready_endpoints_and_hostnames(self):
        self.assertEqual(dns_query(self.port, "headless.e2e.svc.cluster.local", 1),
                         (0, [(1, socket.inet_aton("10.244.1.5"))]))
        self.assertEqual(dns_query(self.port, "pod-a.headless.e2e.svc.cluster.local", 1),
                         (0, [(1, socket.inet_aton("10.244.1.5"))]))

    def test_ipv6_addresses_are_aaaa_records(self):
        v6 = socket.inet_pton(socket.AF_INET6, "fd00:10:96::30")
        self.assertEqual(dns_query(self.port, "dual.e2e.svc.cluster.local", 28), (0, [(28, v6)]))
        self.assertEqual(dns_query(self.port, "dual.e2e.svc.cluster.local", 1),
                         (0, [(1, socket.inet_aton("10.96.0.30"))]))
        pod = socket.inet_pton(socket.AF_INET6, "fd00:10:244:1::5")
        self.assertEqual(dns_query(self.port, "headless.e2e.svc.cluster.local", 28), (0, [(28, pod)]))
        self.assertEqual(dns_query(self.port, "pod-a.headless.e2e.svc.cluster.local", 28), (0, [(28, pod)]))

    def test_srv_for_named_ports(self):
        rcode, ans = dns_query(self.port, "_http._tcp.web.default.svc.cluster.local", 33)
        self.assertEqual(rcode, 0)
        self.assertEqual(len(ans), 1)
        self.assertEqual(struct.unpack("!HHH", ans[0][1][:6]), (0, 100, 80))
        self.assertIn(b"\x03web\x07default", ans[0][1])

    def test_external_name_is_a_cname(self):
        rcode, ans = dns_query(self.port, "ext.e2e.svc.cluster.local", 1)
        self.assertEqual(rcode, 0)
        self.assertEqual(ans[0][0], 5)
        self.assertIn(b"\x03web\x07default\x03svc", ans[0][1])

    def test_unknown_names_do_not_exist_and_known_names_without_the_type_are_empty(self):
        self.assertEqual(dns_query(self.port, "nope.default.svc.cluster.local", 1), (3, []))
        self.assertEqual(dns_query(self.port, "www.example.com", 1), (3, []))
        self.assertEqual(dns_query(self.port, "web.default.svc.cluster.local", 28), (0, []))


class FakeLBAPI(JSONHandler):
    """Nodes and Services for e2e/lb.py; records what it PATCHes."""
    def do_GET(self):
        st = self.server.state
        body = {"/api/v1/nodes": st["nodes"], "/api/v1/services": st["services"]}.get(self.path)
        self.reply(body)

    def do_PATCH(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.state["patches"].append((self.path, self.headers.get("Content-Type"), body))
        self.reply({})


class Healthz(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass


def node(name, ready=True, labels=None):
    return {"metadata": {"name": name, "labels": labels or {}},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


class LabLoadBalancer(unittest.TestCase):
    """e2e/lb.py, one pass against a fake API; its route commands recorded, never run."""

    def setUp(self):
        d = self.dir = tempfile.mkdtemp(prefix="kp-e2e-lb-")
        self.addCleanup(shutil.rmtree, d, True)
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", f"{d}/k.pem", "-out", f"{d}/c.pem", check=True)
        with open(f"{d}/token", "w") as f:
            f.write("t0ken\n")
        with open(f"{d}/ip", "w") as f:
            f.write(f"#!/bin/sh\necho \"$*\" >> {d}/routes\n")
        os.chmod(f"{d}/ip", 0o755)
        self.api = ThreadingHTTPServer(("127.0.0.1", 0), FakeLBAPI)
        self.api.state = {"nodes": {"items": []}, "services": {"items": []}, "patches": []}
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(f"{d}/c.pem", f"{d}/k.pem")
        self.api.socket = ctx.wrap_socket(self.api.socket, server_side=True)
        threading.Thread(target=self.api.serve_forever, daemon=True).start()
        self.addCleanup(self.api.server_close)
        self.addCleanup(self.api.shutdown)
        # node-a's kube-proxy answers the health check; nothing listens for node-b (127.0.0.2)
        self.hc = ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
        threading.Thread(target=self.hc.serve_forever, daemon=True).start()
        self.addCleanup(self.hc.server_close)
        self.addCleanup(self.hc.shutdown)

    def once(self):
        d = self.dir
        r = run(sys.executable, os.path.join(E2E, "lb.py"), "--once", "--ip-cmd", f"{d}/ip",
                "--api", f"https://127.0.0.1:{self.api.server_address[1]}", "--token-file", f"{d}/token",
                "--ca", f"{d}/c.pem", "--pool", "172.30.1.0/24", "--pool", "fd00:30:1::/112",
                "--node", "node-a=127.0.0.1", "--node", "node-b=127.0.0.2", "--node", "node-c=127.0.0.3",
                "--src", "172.31.0.1")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertNotIn("poll:", r.stdout)
        routes = read(f"{d}/routes").splitlines() if os.path.exists(f"{d}/routes") else []
        return routes, self.api.state["patches"]

    def service(self, name, **spec):
        return {"metadata": {"namespace": "e2e", "name": name, "uid": "uid-" + name, "resourceVersion": "7"},
                "spec": dict({"type": "LoadBalancer", "ipFamilies": ["IPv4"]}, **spec), "status": {}}

    def test_cluster_policy_gets_an_address_routed_to_every_ready_node(self):
        self.api.state["nodes"]["items"] = [node("node-a"), node("node-b"), node("node-c", ready=False),
                                            node("node-x")]  # node-x: not a lab node
        self.api.state["services"]["items"] = [self.service("web"), self.service("classy", loadBalancerClass="x/y"),
                                               self.service("plain", type="ClusterIP")]
        routes, patches = self.once()
        self.assertEqual(routes, ["route replace 172.30.1.1/32 src 172.31.0.1 nexthop via 127.0.0.1 nexthop via 127.0.0.2"])
        self.assertIn(("/api/v1/namespaces/e2e/services/web/status", "application/merge-patch+json",
                       {"status": {"loadBalancer": {"ingress": [{"ip": "172.30.1.1", "ipMode": "VIP"}]}}}), patches)
        self.assertIn(("/api/v1/namespaces/e2e/services/web", "application/merge-patch+json",
                       {"metadata": {"finalizers": ["service.kubernetes.io/load-balancer-cleanup"],
                                     "resourceVersion": "7"}}), patches)
        self.assertFalse([p for p in patches if "classy" in p[0] or "plain" in p[0]], patches)

    def test_local_policy_routes_to_nodes_whose_health_check_passes(self):
        port = self.hc.server_address[1]
        self.api.state["nodes"]["items"] = [node("node-a"), node("node-b"), node("node-c")]
        self.api.state["services"]["items"] = [
            self.service("local", externalTrafficPolicy="Local", healthCheckNodePort=port),
            self.service("pinned", sessionAffinity="ClientIP", loadBalancerIP="172.30.1.9")]
        routes, _ = self.once()
        self.assertIn("route replace 172.30.1.1/32 src 172.31.0.1 via 127.0.0.1", routes)
        # ClientIP affinity: one node for the address; the requested address honoured
        self.assertEqual(len([r for r in routes if r.startswith("route replace 172.30.1.9/32 src 172.31.0.1 via ")]), 1, routes)

    def test_dual_stack_gets_one_address_per_family(self):
        self.api.state["nodes"]["items"] = [node("node-a")]
        self.api.state["services"]["items"] = [self.service("dual", ipFamilies=["IPv6", "IPv4"])]
        _, patches = self.once()
        status = [p[2] for p in patches if p[0].endswith("/status")]
        self.assertEqual(status, [{"status": {"loadBalancer": {"ingress": [
            {"ip": "fd00:30:1::1", "ipMode": "VIP"}, {"ip": "172.30.1.1", "ipMode": "VIP"}]}}}])

    def test_deleted_or_changed_services_lose_the_finalizer(self):
        gone = self.service("gone")
        gone["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z",
                                finalizers=["other", "service.kubernetes.io/load-balancer-cleanup"])
        back = self.service("back", type="ClusterIP")
        back["metadata"]["finalizers"] = ["service.kubernetes.io/load-balancer-cleanup"]
        back["status"] = {"loadBalancer": {"ingress": [{"ip": "172.30.1.4"}]}}
        self.api.state["services"]["items"] = [gone, back]
        _, patches = self.once()
        self.assertIn(("/api/v1/namespaces/e2e/services/gone", "application/merge-patch+json",
                       {"metadata": {"finalizers": ["other"], "resourceVersion": "7"}}), patches)
        self.assertIn(("/api/v1/namespaces/e2e/services/back/status", "application/merge-patch+json",
                       {"status": {"loadBalancer": {}}}), patches)
        self.assertIn(("/api/v1/namespaces/e2e/services/back", "application/merge-patch+json",
                       {"metadata": {"finalizers": [], "resourceVersion": "7"}}), patches)


if __name__ == "__main__":
    unittest.main(verbosity=2)
