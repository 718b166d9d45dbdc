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
                           (["--mode", "socketlb", "--deploy", "kubeadm"], "--deploy kubeadm")]:
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
    {"metadata": {"namespace": "e2e", "name": "ext"},
     "spec": {"type": "ExternalName", "externalName": "web.default.svc.cluster.local"}},
]}
SLICES = {"items": [
    {"metadata": {"namespace": "e2e", "name": "headless-x", "labels": {"kubernetes.io/service-name": "headless"}},
     "endpoints": [{"addresses": ["10.244.1.5"], "hostname": "pod-a", "conditions": {"ready": True}},
                   {"addresses": ["10.244.2.6"], "conditions": {"ready": False}}]},
]}


class FakeAPI(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer t0ken":
            self.send_response(401); self.end_headers(); return
        body = {"/api/v1/services": SERVICES, "/apis/discovery.k8s.io/v1/endpointslices": SLICES}.get(self.path)
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


if __name__ == "__main__":
    unittest.main(verbosity=2)
