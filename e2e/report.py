#!/usr/bin/env python3
"""Results of e2e.sh runs.

  report.py summary JUNIT --focus RE --proxy P --mode M [--family F] --up S --run S --out result.json
      prints "N passed, M failed, K skipped" over the specs the focus selects
      (K: selected, then skipped by --skip or by the spec itself) and writes
      result.json (each spec: state, seconds, failure message).
  report.py docs RESULT.json... --out docs/e2e.md [--section NAME]
      rewrites the results section of docs/e2e.md (between the markers; with
      --section, the markers of that name) with a table: each spec that ran,
      its result and time per proxy/mode/family."""
import json, os, re, sys, xml.etree.ElementTree as ET
from datetime import datetime, timezone

BEGIN, END = "<!-- e2e.sh results: begin -->", "<!-- e2e.sh results: end -->"


def opt(args, name, default=None):
    return args[args.index(name) + 1] if name in args else default


def summary(args):
    junit, focus = args[0], re.compile(opt(args, "--focus", r"\[sig-network\]"))
    specs = []
    for tc in ET.parse(junit).getroot().iter("testcase"):
        name = tc.get("name", "")
        if name.startswith("[It] "):
            name = name[5:]
        # JUnit appends the spec's labels as a last bracket group: "... [sig-network, Conformance]"
        name = re.sub(r" \[sig-[^\[\]]*\]$", "", name)
        if not focus.search(name):
            continue
        state = tc.get("status") or ("failed" if tc.find("failure") is not None else
                                     "skipped" if tc.find("skipped") is not None else "passed")
        if state not in ("passed", "skipped"):
            state = "failed"
        msg = ""
        f = tc.find("failure")
        if f is None:
            f = tc.find("error")
        if f is not None:
            msg = (f.get("message") or f.text or "").strip()
        specs.append({"name": name, "state": state, "seconds": round(float(tc.get("time") or 0), 1), "failure": msg[:2000]})
    n = {s: sum(1 for x in specs if x["state"] == s) for s in ("passed", "failed", "skipped")}
    res = {"proxy": opt(args, "--proxy"), "mode": opt(args, "--mode"), "family": opt(args, "--family", "ipv4"),
           "proxy_args": opt(args, "--args", ""), "focus": focus.pattern,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "cluster_up_seconds": int(opt(args, "--up", 0)), "run_seconds": int(opt(args, "--run", 0)),
           "tree": opt(args, "--tree", ""), "counts": n, "specs": specs}
    if opt(args, "--out"):
        with open(opt(args, "--out"), "w") as f:
            json.dump(res, f, indent=1)
    for s in specs:
        if s["state"] == "failed":
            print("FAILED:", s["name"], "--", s["failure"].splitlines()[0][:300] if s["failure"] else "", file=sys.stderr)
    print(f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped")


def docs(args):
    out = opt(args, "--out")
    section = opt(args, "--section")
    begin, end = (BEGIN, END) if not section else (BEGIN.replace("results:", f"results {section}:"),
                                                   END.replace("results:", f"results {section}:"))
    files = [a for a in args if a.endswith(".json")]
    files.sort(key=lambda f: (os.path.basename(os.path.dirname(f)).endswith("-conformance"), f))
    runs = [json.load(open(f)) for f in files]
    # a column per run, named by its report directory (e.g. ours-nftables)
    cols = [os.path.basename(os.path.dirname(os.path.abspath(f))) or f"{r['proxy']} {r['mode']}" for f, r in zip(files, runs)]
    names = sorted({s["name"] for r in runs for s in r["specs"] if s["state"] != "skipped"})
    lines = [begin, "", "| run | family | date | build | focus | passed | failed | skipped | cluster up | suite |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, r in zip(cols, runs):
        k = r["counts"]
        run = f"{c} (`{r['proxy_args']}`)" if r.get("proxy_args") else c
        lines.append(f"| {run} | {r.get('family', 'ipv4')} | {r['date']} | {r.get('tree', '')} | `{r['focus'].replace('|', '&#124;')}` | {k['passed']} | {k['failed']} | {k['skipped']} | "
                     f"{r['cluster_up_seconds']} s | {r['run_seconds']} s |")
    lines += ["", "| spec | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name in names:
        cells = []
        for r in runs:
            s = next((x for x in r["specs"] if x["name"] == name), None)
            cells.append("-" if s is None else f"{s['state']} ({s['seconds']:.0f} s)" if s["state"] != "failed"
                         else f"**failed** ({s['seconds']:.0f} s)")
        lines.append(f"| {name.replace('|', '/')} | " + " | ".join(cells) + " |")
    fails = [(c, s) for c, r in zip(cols, runs) for s in r["specs"] if s["state"] == "failed"]
    if fails:
        lines += ["", "Failures (first line of the message):", ""]
        for c, s in fails:
            first = (s["failure"].splitlines() or [""])[0][:400].replace("|", "/")
            lines.append(f"* {c}: {s['name']}: `{first}`")
    lines += ["", end]
    text = open(out).read()
    if begin in text:
        text = text[:text.index(begin)] + "\n".join(lines) + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    open(out, "w").write(text)


{"summary": summary, "docs": docs}[sys.argv[1]](sys.argv[2:])
