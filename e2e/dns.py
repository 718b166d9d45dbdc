#!/usr/bin/env python3
"""The lab's cluster DNS (the lab has no CoreDNS): answers for cluster.local
from the API server's Services and EndpointSlices, polled every second.

  <svc>.<ns>.svc.cluster.local            A/AAAA: ClusterIPs, or the ready endpoints (headless)
                                          CNAME: spec.externalName (ExternalName)
  <hostname>.<svc>.<ns>.svc.cluster.local A/AAAA: a headless endpoint with a hostname
  _<port>._<proto>.<svc>.<ns>.svc...      SRV: each named port
Anything else: NXDOMAIN (there is nothing beyond the lab). UDP and TCP.

usage: dns.py --listen IP [--listen IP6] [--port 53] --api URL --token-file F --ca F"""
import argparse, json, socket, socketserver, ssl, struct, threading, time, urllib.request

p = argparse.ArgumentParser()
p.add_argument("--listen", required=True, action="append")
p.add_argument("--port", type=int, default=53)
p.add_argument("--api", required=True)
p.add_argument("--token-file", required=True)
p.add_argument("--ca", required=True)
a = p.parse_args()
TOKEN = open(a.token_file).read().strip()
CTX = ssl.create_default_context(cafile=a.ca)
ZONE = "cluster.local"
records = {}  # (name, qtype) -> [rdata bytes]; name lowercase without trailing dot
known = set()  # names that exist (for NODATA vs NXDOMAIN)
A, CNAME, SRV, AAAA = 1, 5, 33, 28


def api(method, path, body=None):
    req = urllib.request.Request(a.api + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + TOKEN, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=CTX, timeout=10) as r:
        return json.load(r)


def qname(name):
    out = b""
    for part in name.rstrip(".").split("."):
        out += bytes([len(part)]) + part.encode()
    return out + b"\0"


def addr(ip):
    """(qtype, rdata) of an address record for ip."""
    if ":" in ip:
        return AAAA, socket.inet_pton(socket.AF_INET6, ip)
    return A, socket.inet_aton(ip)


def rebuild():
    recs, names = {}, set()
    def add(name, t, rd):
        name = name.lower()
        recs.setdefault((name, t), []).append(rd)
        labels = name.split(".")
        for i in range(len(labels)):
            names.add(".".join(labels[i:]))
    svcs = api("GET", "/api/v1/services")["items"]
    slices = api("GET", "/apis/discovery.k8s.io/v1/endpointslices")["items"]
    eps = {}
    for s in slices:
        svc = s["metadata"].get("labels", {}).get("kubernetes.io/service-name")
        if svc:
            eps.setdefault((s["metadata"]["namespace"], svc), []).append(s)
    for s in svcs:
        ns, name, spec = s["metadata"]["namespace"], s["metadata"]["name"], s["spec"]
        fq = f"{name}.{ns}.svc.{ZONE}"
        names.add(fq)
        if spec.get("type") == "ExternalName":
            add(fq, CNAME, qname(spec["externalName"]))
            continue
        cip = spec.get("clusterIP")
        if cip and cip != "None":
            for ip in spec.get("clusterIPs") or [cip]:
                add(fq, *addr(ip))
        else:
            for sl in eps.get((ns, name), []):
                for e in sl.get("endpoints") or []:
                    if (e.get("conditions") or {}).get("ready") is False and not spec.get("publishNotReadyAddresses"):
                        continue
                    for ip in e.get("addresses", []):
                        add(fq, *addr(ip))
                        if e.get("hostname"):
                            add(f"{e['hostname']}.{fq}", *addr(ip))
        for port in spec.get("ports") or []:
            if port.get("name"):
                srv = struct.pack("!HHH", 0, 100, port["port"]) + qname(fq)
                add(f"_{port['name']}._{port.get('protocol', 'TCP').lower()}.{fq}", SRV, srv)
    return recs, names


def answer(data):
    ident, flags, qd = struct.unpack("!HHH", data[:6])
    i, labels = 12, []
    while data[i]:
        labels.append(data[i + 1:i + 1 + data[i]].decode(errors="replace"))
        i += 1 + data[i]
    qt, qc = struct.unpack("!HH", data[i + 1:i + 5])
    question = data[12:i + 5]
    name = ".".join(labels).lower()
    rcode, ans = 0, []
    recs = records.get((name, qt)) or []
    if not recs and qt in (A, AAAA):
        cn = records.get((name, CNAME))
        if cn:
            recs, qt = cn, CNAME
    if recs:
        ans = [(qt, rd) for rd in recs]
    elif name not in known:
        rcode = 3
    hdr = struct.pack("!HHHHHH", ident, 0x8400 | (flags & 0x0100) | rcode, 1, len(ans), 0, 0)
    body = b"".join(b"\xc0\x0c" + struct.pack("!HHIH", t, 1, 5, len(rd)) + rd for t, rd in ans)
    return hdr + question + body


class UDP(socketserver.BaseRequestHandler):
    def handle(self):
        data, sock = self.request
        try:
            sock.sendto(answer(data), self.client_address)
        except Exception as e:
            print("udp:", e, flush=True)


class TCP(socketserver.StreamRequestHandler):
    def handle(self):
        try:
            while True:
                n = self.rfile.read(2)
                if len(n) < 2:
                    return
                r = answer(self.rfile.read(struct.unpack("!H", n)[0]))
                self.wfile.write(struct.pack("!H", len(r)) + r)
        except Exception as e:
            print("tcp:", e, flush=True)


def poll():
    global records, known
    while True:
        try:
            records, known = rebuild()
        except Exception as e:
            print("poll:", e, flush=True)
        time.sleep(1)


def server(cls, handler, ip):
    kind = type(cls.__name__, (cls,), {"allow_reuse_address": True,
                                       "address_family": socket.AF_INET6 if ":" in ip else socket.AF_INET})
    return kind((ip, a.port), handler)


threading.Thread(target=poll, daemon=True).start()
servers = [server(c, h, ip) for ip in a.listen for c, h in ((socketserver.ThreadingUDPServer, UDP),
                                                           (socketserver.ThreadingTCPServer, TCP))]
for s in servers[1:]:
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("serving DNS on", ", ".join(a.listen), flush=True)
servers[0].serve_forever()
