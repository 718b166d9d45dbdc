//! The workspace's plan, checked against the code (docs/architecture.md):
//! no import circle between the files of a product crate, no product crate
//! built on a lab crate, and the dataplanes and sources built on the model,
//! not on each other. Reads the sources as text; runs nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Crates that exist for tests, benchmarks and the demo.
const LAB: &[&str] = &["kp-netlab", "kp-testkit", "kp-bench", "kp-demo"];
/// The dataplanes and the sources: each builds on the model and the shared
/// layers (kp-netlink, kp-xtables) only.
const PARTS: &[&str] = &[
    "kp-nftables",
    "kp-iptables",
    "kp-ipvs",
    "kp-userspace",
    "kp-ebpf",
    "kp-source",
];
/// Known exceptions to [`PARTS`], each to be removed (none left: the
/// iptables restore runner kp-ipvs used is kp-xtables, below both modes).
const PART_EXCEPTIONS: &[(&str, &str)] = &[];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root")
}

fn crates() -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(workspace().join("crates"))
        .expect("crates/")
        .filter_map(|e| e.ok())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .filter(|(_, p)| p.join("Cargo.toml").is_file())
        .collect();
    out.sort();
    out
}

/// Every crate but the lab's.
fn product_crates() -> Vec<(String, PathBuf)> {
    crates()
        .into_iter()
        .filter(|(name, _)| !LAB.contains(&name.as_str()))
        .collect()
}

/// The crate names in a manifest's `[dependencies]` (not dev- or build-).
fn dependencies(manifest: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(manifest).expect("reading a Cargo.toml");
    let mut deps = BTreeSet::new();
    let mut inside = false;
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            inside = l == "[dependencies]";
            continue;
        }
        if inside {
            if let Some((name, _)) = l.split_once('=') {
                let name = name.trim().trim_end_matches(".workspace").trim();
                if !name.is_empty() && !name.starts_with('#') {
                    deps.insert(name.to_string());
                }
            }
        }
    }
    deps
}

#[test]
fn no_product_crate_builds_on_a_lab_crate_and_parts_stand_on_the_model() {
    let mut wrong = Vec::new();
    for (name, dir) in product_crates() {
        let deps = dependencies(&dir.join("Cargo.toml"));
        for d in &deps {
            if LAB.contains(&d.as_str()) {
                wrong.push(format!("{name} depends on the lab crate {d}"));
            }
            if PARTS.contains(&name.as_str())
                && PARTS.contains(&d.as_str())
                && !PART_EXCEPTIONS.contains(&(name.as_str(), d.as_str()))
            {
                wrong.push(format!(
                    "{name} depends on another dataplane or source, {d}"
                ));
            }
        }
    }
    for (a, b) in PART_EXCEPTIONS {
        let deps = dependencies(&workspace().join("crates").join(a).join("Cargo.toml"));
        if !deps.contains(*b) {
            wrong.push(format!(
                "{a} no longer depends on {b}: remove the exception from PART_EXCEPTIONS"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A module path (`["config", "flags"]`) for each source file of a crate's
/// library (`src/lib.rs` and the files below it; binaries are other crates
/// that nothing imports).
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    fn walk(dir: &Path, prefix: &[String], out: &mut BTreeMap<Vec<String>, PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.filter_map(|e| e.ok()) {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                if prefix.is_empty() && name == "bin" {
                    continue;
                }
                let mut m = prefix.to_vec();
                m.push(name);
                walk(&p, &m, out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                let mut m = prefix.to_vec();
                match stem {
                    "mod" => {}
                    "lib" if prefix.is_empty() => {}
                    "main" if prefix.is_empty() => continue,
                    s => m.push(s.to_string()),
                }
                out.insert(m, p);
            }
        }
    }
    let mut out = BTreeMap::new();
    if src.join("lib.rs").is_file() {
        walk(src, &[], &mut out);
    }
    out
}

/// `a::b::{c, d::e}` -> its paths: `a::b::c`, `a::b::d::e` (one level of
/// braces is enough for the imports here; deeper ones add their prefix).
fn expand(path: &str) -> Vec<Vec<String>> {
    let ident = |s: &str| {
        s.split("::")
            .map(|x| x.trim().to_string())
            .take_while(|x| !x.is_empty() && x.chars().all(|c| c.is_alphanumeric() || c == '_'))
            .collect::<Vec<String>>()
    };
    match path.split_once('{') {
        None => vec![ident(path)],
        Some((head, rest)) => {
            let head = ident(head.trim_end_matches("::"));
            let inner = rest.rsplit_once('}').map_or(rest, |(i, _)| i);
            let mut depth = 0;
            let mut items = vec![String::new()];
            for c in inner.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        items.push(String::new());
                        continue;
                    }
                    _ => {}
                }
                if let Some(last) = items.last_mut() {
                    last.push(c);
                }
            }
            items
                .iter()
                .filter(|i| !i.trim().is_empty())
                .flat_map(|i| expand(i.trim()))
                .map(|tail| head.iter().cloned().chain(tail).collect())
                .collect()
        }
    }
}

/// A file's code: without comment lines and its test module (from
/// `#[cfg(test)]` on).
fn code_of(text: &str) -> String {
    text.lines()
        .take_while(|l| l.trim() != "#[cfg(test)]")
        .filter(|l| !l.trim_start().starts_with("//"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The paths a file names through `crate::`, `super::`, `self::` or a
/// child module it declares, as absolute module paths. Comments and the
/// file's test module (from `#[cfg(test)]` on) are not read.
fn references(text: &str, module: &[String]) -> Vec<Vec<String>> {
    let code = code_of(text);
    let children: BTreeSet<String> = code
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l
                .strip_prefix("pub mod ")
                .or_else(|| l.strip_prefix("pub(crate) mod "))
                .or_else(|| l.strip_prefix("mod "))?;
            rest.strip_suffix(';').map(|n| n.trim().to_string())
        })
        .collect();
    // A file's own module is `module` (a mod.rs's too); `super` is its
    // parent.
    let parent: Vec<String> = module[..module.len().saturating_sub(1)].to_vec();
    let mut out = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let at_word = i == 0
            || !(bytes[i - 1].is_alphanumeric() || bytes[i - 1] == '_' || bytes[i - 1] == ':');
        if !at_word {
            i += 1;
            continue;
        }
        // The path text from here: identifiers, `::`, braces, commas.
        let mut j = i;
        let mut depth = 0;
        while j < bytes.len() {
            let c = bytes[j];
            let ok = c.is_alphanumeric()
                || c == '_'
                || c == ':'
                || (depth > 0 && (c == ',' || c.is_whitespace() || c == '*'))
                || c == '{'
                || (c == '}' && depth > 0);
            if !ok {
                break;
            }
            if c == '{' {
                depth += 1;
            }
            if c == '}' {
                depth -= 1;
            }
            j += 1;
        }
        let word: String = bytes[i..j].iter().collect();
        i = j.max(i + 1);
        if !word.contains("::") {
            continue;
        }
        for p in expand(&word) {
            let Some(first) = p.first() else { continue };
            let abs: Vec<String> = match first.as_str() {
                "crate" => p[1..].to_vec(),
                "super" => parent
                    .iter()
                    .cloned()
                    .chain(p[1..].iter().cloned())
                    .collect(),
                "self" => module
                    .iter()
                    .cloned()
                    .chain(p[1..].iter().cloned())
                    .collect(),
                c if children.contains(c) => {
                    module.iter().cloned().chain(p.iter().cloned()).collect()
                }
                _ => continue,
            };
            out.push(abs);
        }
    }
    out
}

/// Strongly connected components of more than one node (Tarjan).
fn circles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    struct T<'a> {
        edges: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on: BTreeSet<&'a PathBuf>,
        out: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a PathBuf) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.edges.get(v) {
            for w in ws {
                let Some((w, _)) = t.edges.get_key_value(w) else {
                    continue;
                };
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let lw = t.low[w];
                    let lv = t.low[v];
                    t.low.insert(v, lv.min(lw));
                } else if t.on.contains(w) {
                    let iw = t.index[w];
                    let lv = t.low[v];
                    t.low.insert(v, lv.min(iw));
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                scc.push(w.clone());
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                t.out.push(scc);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

/// What a file re-exports: `pub use a::b::Thing;` maps `Thing` to the
/// absolute path `a::b::Thing`, and `pub use a::b::*;` adds `a::b` to its
/// globs. A path through a re-export names the file that defines the item,
/// not the file that passes it on: a `mod.rs` (or the crate root) that only
/// re-exports must not hide a circle.
#[derive(Default)]
struct Reexports {
    items: BTreeMap<String, Vec<String>>,
    globs: Vec<Vec<String>>,
}

fn reexports(text: &str, module: &[String]) -> Reexports {
    let mut out = Reexports::default();
    let code = code_of(text);
    // The file's `mod` lines go with each statement: they say which first
    // names are its own child modules.
    let decls: String = code
        .lines()
        .filter(|l| l.trim_start().starts_with("mod ") || l.contains(" mod "))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut rest = code.as_str();
    while let Some((at, len)) = ["pub use ", "pub(crate) use "]
        .iter()
        .filter_map(|k| rest.find(k).map(|i| (i, k.len())))
        .min()
    {
        let body = &rest[at + len..];
        let Some(end) = body.find(';') else { break };
        // `x::Y as Z` is read as `x::Y` (the alias is rare here, and a
        // miss only keeps the edge at the re-exporting file).
        let stmt = body[..end].replace('*', "_glob").replace(" as ", "@");
        rest = &body[end..];
        for p in references(&format!("{decls}{stmt}\n"), module) {
            match p.split_last() {
                Some((last, head)) if last == "_glob" => out.globs.push(head.to_vec()),
                Some((last, _)) => {
                    out.items.insert(last.clone(), p.clone());
                }
                None => {}
            }
        }
    }
    out
}

/// True when `text` defines an item called `name`.
fn defines(text: &str, name: &str) -> bool {
    [
        "struct", "enum", "fn", "trait", "type", "const", "static", "mod", "union",
    ]
    .iter()
    .any(|k| {
        let key = format!("{k} {name}");
        text.match_indices(&key).any(|(i, _)| {
            let after = text[i + key.len()..].chars().next();
            let before = text[..i].chars().last();
            !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
                && !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
    })
}

/// The import edges between a crate's library files: file -> the file
/// that defines what each of its paths names, following re-exports (the
/// crate root, which only declares and re-exports, is left out, and so are
/// a mod.rs's uses of the files in its own folder).
fn file_edges(src: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mods = modules(src);
    let texts: BTreeMap<&PathBuf, String> = mods
        .values()
        .map(|f| {
            (
                f,
                std::fs::read_to_string(f).expect("reading a source file"),
            )
        })
        .collect();
    let re: BTreeMap<&PathBuf, Reexports> = mods
        .iter()
        .map(|(m, f)| (f, reexports(&texts[f], m)))
        .collect();
    // The file a path lands in, after at most a few re-export hops.
    let land = |path: &[String]| -> Option<&PathBuf> {
        let mut path = path.to_vec();
        for _ in 0..8 {
            let k = (1..=path.len())
                .rev()
                .find(|k| mods.contains_key(&path[..*k]))?;
            let file = &mods[&path[..k]];
            let Some(name) = path.get(k) else {
                return Some(file);
            };
            let r = &re[file];
            if let Some(to) = r.items.get(name) {
                path = to.iter().chain(&path[k + 1..]).cloned().collect();
                continue;
            }
            let glob = r.globs.iter().find(|g| {
                mods.get(g.as_slice())
                    .is_some_and(|f| defines(&texts[f], name) || re[f].items.contains_key(name))
            });
            match glob {
                Some(g) => path = g.iter().chain(&path[k..]).cloned().collect(),
                None => return Some(file),
            }
        }
        None
    };
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for (module, file) in &mods {
        let e = edges.entry(file.clone()).or_default();
        for path in references(&texts[file], module) {
            let target = land(&path)
                .filter(|t| *t != file && !t.ends_with("lib.rs"))
                // A folder's mod.rs using its own files is the folder's
                // face, not a tie between rooms (farm-studio draws it so).
                .filter(|t| {
                    !(file.ends_with("mod.rs") && file.parent().is_some_and(|d| t.starts_with(d)))
                });
            if let Some(t) = target {
                e.insert(t.clone());
            }
        }
    }
    edges
}

#[test]
fn no_import_circle_between_product_files() {
    let mut found = Vec::new();
    let mut files = 0;
    for (_, dir) in product_crates() {
        let edges = file_edges(&dir.join("src"));
        files += edges.len();
        for c in circles(&edges) {
            let root = workspace();
            let names: Vec<String> = c
                .iter()
                .map(|p| p.strip_prefix(&root).unwrap_or(p).display().to_string())
                .collect();
            let ties: Vec<String> = c
                .iter()
                .flat_map(|a| {
                    edges[a]
                        .iter()
                        .filter(|b| c.contains(b))
                        .map(move |b| format!("{} -> {}", a.display(), b.display()))
                })
                .collect();
            found.push(format!(
                "{}\n    {}",
                names.join(" <-> "),
                ties.join("\n    ")
            ));
        }
    }
    assert!(files > 50, "read only {files} product files");
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// The circles of a made-up crate whose `src/` holds `files` (path, text).
fn circles_of(name: &str, files: &[(&str, &str)]) -> Vec<Vec<PathBuf>> {
    let dir = std::env::temp_dir().join(format!("kp-house-{name}-{}", std::process::id()));
    let src = dir.join("src");
    for (path, text) in files {
        let p = src.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let edges = file_edges(&src);
    let _ = std::fs::remove_dir_all(&dir);
    let found = circles(&edges);
    assert_eq!(found.len(), 1, "{name}: {edges:?}");
    found
}

/// The reader itself: it sees a circle where there is one.
#[test]
fn the_circle_finder_sees_a_circle() {
    let found = circles_of(
        "plain",
        &[
            ("lib.rs", "pub mod a;\npub mod c;\n"),
            ("a/mod.rs", "pub mod b;\nuse b::Thing;\n"),
            (
                "a/b.rs",
                "use crate::{c::{Other, More}, x};\npub struct Thing;\n",
            ),
            (
                "c.rs",
                "// crate::a::Nothing in a comment\npub fn f() { super::a::b::Thing; }\n",
            ),
        ],
    );
    assert_eq!(found[0].len(), 2, "{found:?}");
    assert!(found[0].iter().any(|p| p.ends_with("a/b.rs")), "{found:?}");
    assert!(found[0].iter().any(|p| p.ends_with("c.rs")), "{found:?}");
}

/// A circle through a re-export: settings.rs uses modes/u.rs, which takes
/// `Config` from `crate::cfg`, whose mod.rs only passes settings.rs's
/// `Config` on (by name, or by a glob). Without following the re-export the
/// edge ends at cfg/mod.rs and the circle is invisible.
#[test]
fn the_circle_finder_follows_reexports() {
    for (n, reexport) in ["pub use settings::Config;", "pub use settings::*;"]
        .iter()
        .enumerate()
    {
        let cfg = format!("mod settings;\n{reexport}\n");
        let found = circles_of(
            &format!("reexport{n}"),
            &[
                ("lib.rs", "pub mod cfg;\npub mod modes;\n"),
                ("cfg/mod.rs", &cfg),
                (
                    "cfg/settings.rs",
                    "pub struct Config;\npub fn flags() -> crate::modes::u::Flags {\n    crate::modes::u::Flags\n}\n",
                ),
                ("modes/mod.rs", "pub mod u;\n"),
                ("modes/u.rs", "use crate::cfg::Config;\npub struct Flags;\npub fn f(_: &Config) {}\n"),
            ],
        );
        let ends = |s: &str| found[0].iter().any(|p| p.ends_with(s));
        assert!(
            ends("cfg/settings.rs") && ends("modes/u.rs"),
            "{reexport}: {found:?}"
        );
    }
}

/// The no-unwrap policy lives once, in the workspace's `[workspace.lints]`:
/// every product crate takes it (`[lints] workspace = true`), none keeps a
/// copy of its own in its source.
#[test]
fn every_product_crate_takes_the_workspace_lints() {
    let root = std::fs::read_to_string(workspace().join("Cargo.toml")).unwrap();
    let lints = root
        .split("[workspace.lints.clippy]")
        .nth(1)
        .expect("[workspace.lints.clippy] in the workspace Cargo.toml");
    for l in ["unwrap_used = \"deny\"", "expect_used = \"deny\""] {
        assert!(lints.contains(l), "[workspace.lints.clippy] lacks {l}");
    }
    let mut wrong = Vec::new();
    for (name, dir) in product_crates() {
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        if !manifest.contains("[lints]\nworkspace = true") {
            wrong.push(format!(
                "{name}: Cargo.toml has no `[lints] workspace = true`"
            ));
        }
        for root in ["src/lib.rs", "src/main.rs"] {
            let text = std::fs::read_to_string(dir.join(root)).unwrap_or_default();
            if text.contains("#![deny(clippy::unwrap_used") {
                wrong.push(format!("{name}/{root}: a copy of the workspace lints"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Test helpers (kp_model::testing, kp_ipvs::internals) sit behind the
/// `testing` feature, which only dev-dependencies turn on: the product is
/// built without them (`cargo build` would fail if it used one).
#[test]
fn test_helpers_stay_out_of_the_product() {
    let mut wrong = Vec::new();
    for (name, dir) in product_crates() {
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        let mut section = String::new();
        for line in manifest.lines() {
            let l = line.trim();
            if l.starts_with('[') {
                section = l.to_string();
            } else if section == "[dependencies]" && l.contains("\"testing\"") {
                wrong.push(format!(
                    "{name}: [dependencies] turns on a testing feature: {l}"
                ));
            }
        }
    }
    for (krate, module) in [
        ("kp-model", "pub mod testing;"),
        ("kp-ipvs", "pub mod internals"),
    ] {
        let lib =
            std::fs::read_to_string(workspace().join("crates").join(krate).join("src/lib.rs"))
                .unwrap();
        let at = lib
            .find(module)
            .unwrap_or_else(|| panic!("{krate}: no `{module}`"));
        let before = lib[..at].lines().rev().nth(1).unwrap_or_default();
        assert!(
            lib[..at]
                .trim_end()
                .ends_with("#[cfg(any(test, feature = \"testing\"))]"),
            "{krate}: `{module}` is not behind the testing feature (line before: {before:?})"
        );
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

// ---------------------------------------------------------------------------
// docs/architecture.md, checked against the tree.
//
// What counts as a citation (everything else in the doc is prose):
//
// * Paths, which must name a file or a folder that exists. A citation is a
//   code span made only of path characters (letters, digits, `_ - . / * <
//   >`), not starting with `/`, `-` or `.`, that holds a `/` or ends in a
//   file extension (`EXTENSIONS`); a word of the prose or of a fenced block
//   that starts with `crates/`, `docs/`, `deploy/`, `e2e/`, `examples/` or
//   a crate's folder name; a relative link target (`](file.md#anchor)`,
//   read from docs/). Where it is looked for:
//   - `crates/...`, `docs/...`, `deploy/...`, `e2e/...`, `examples/...` and
//     a top-level file (`demo.sh`): from the workspace root;
//   - `<crate>/...` (`kp-model/src/dataplane.rs`): under crates/;
//   - `src/...` and `tests/...`: in the crate named nearby, else in the
//     binary's folder (kube-proxy-rs);
//   - any other span that ends in an extension or in `/` (`metrics.rs`,
//     `proxier/full.rs`, `modes/`): as the end of a path under the folder
//     named nearby, or under the binary's (the doc names the binary's
//     files bare).
//   "Named nearby" is the last crate (a span `kp-x`, or a path into it) or
//   top-level folder (`deploy/monitoring/...`) cited earlier in the same
//   paragraph, list item or table row. Other spans with a `/`
//   (`api/nftables`, annotation keys) are not paths. `*` and
//   `<placeholder>` match any part of one path segment; something must
//   match.
// * Rust names, in code spans, which must be defined:
//   - every `kp_x::a::B` (and `kube_proxy_rs::...`) anywhere in a span:
//     each segment after the crate, in that crate's `src/`;
//   - every `crate::a::B` anywhere in a span: each segment, anywhere;
//   - a span that is, whole, a path `A::b`, `a::B::c` or `Type.field` (a
//     trailing call `(..)` or `!`, generic arguments `<..>` and a
//     pattern's ` { .. }` dropped first): each segment anywhere (`Type::x`
//     may name a field, as rustdoc does), a `.field` as some struct's
//     field, and every CamelCase generic argument; a path whose first
//     segment is a dependency named in Cargo.lock (`clap::Args`) or `std`
//     is not ours to check;
//   - a span that is, whole, one CamelCase name (`Schedule`): anywhere, or
//     one of Rust's own names in `STD`.
//   "Defined" is `struct|enum|trait|type|fn|const|static|mod|union|
//   macro_rules! Name` or an enum variant (for a CamelCase segment), in the
//   `.rs` files under crates/ (tests included: the doc cites them too),
//   comments left out. Bare lowercase words (`render_service`, `full`) are
//   not checked: too many are fields, options or plain words. A name that
//   is not Rust (an Event reason, a taint) is written in quotes or prose.
// ---------------------------------------------------------------------------

/// Rust's own names the doc may write bare.
const STD: &[&str] = &[
    "Arc", "Box", "Clone", "Debug", "Default", "Display", "FromStr", "None", "Option", "Result",
    "Send", "Some", "String", "Sync", "Vec",
];

/// Extensions that make a span a file path.
const EXTENSIONS: &[&str] = &[
    "rs", "c", "h", "md", "toml", "yml", "yaml", "sh", "py", "json", "txt",
];

/// The binary's folder: where `src/...`, `tests/...` and bare file names
/// are looked for when no other crate is named nearby.
const BINARY: &str = "crates/kube-proxy-rs";

/// Top-level folders a path may start from.
const ROOTS: &[&str] = &["crates", "docs", "deploy", "e2e", "examples"];

/// What the workspace holds, for the citations to be checked against.
struct Tree {
    /// Every file and folder, relative to the root, with `/` separators
    /// (folders without a trailing `/`).
    paths: BTreeSet<String>,
    /// The folder names under crates/.
    crates: BTreeSet<String>,
    /// Names defined per crate folder, in its `src/`.
    defined_in: BTreeMap<String, BTreeSet<String>>,
    /// Names defined anywhere under crates/ (items, enum variants).
    defined: BTreeSet<String>,
    /// Struct field names anywhere under crates/.
    fields: BTreeSet<String>,
    /// Crates from outside the workspace (Cargo.lock), as Rust names.
    outside: BTreeSet<String>,
}

fn is_ident(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_alphanumeric() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

/// `Schedule`, `IpvsProxier`: an uppercase first letter and a lowercase one.
fn is_camel(s: &str) -> bool {
    is_ident(s)
        && s.starts_with(|c: char| c.is_ascii_uppercase())
        && s.chars().any(|c| c.is_ascii_lowercase())
}

/// The identifiers of a source text, comments left out.
fn tokens(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let code = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        let mut word = String::new();
        for c in code.chars().chain(std::iter::once(' ')) {
            if c.is_alphanumeric() || c == '_' {
                word.push(c);
            } else if !word.is_empty() {
                out.push((n, std::mem::take(&mut word)));
            }
        }
    }
    out
}

/// The names a Rust file defines: items, enum variants, struct fields.
fn definitions(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    const ITEMS: &[&str] = &[
        "struct",
        "enum",
        "trait",
        "type",
        "fn",
        "const",
        "static",
        "mod",
        "union",
        "macro_rules",
    ];
    let mut defs = BTreeSet::new();
    let mut fields = BTreeSet::new();
    let toks = tokens(text);
    for w in toks.windows(2) {
        if ITEMS.contains(&w[0].1.as_str()) && is_ident(&w[1].1) {
            defs.insert(w[1].1.clone());
        }
    }
    // Enum variants and struct fields: the lines directly inside an
    // `enum X {` / `struct X {` body.
    let lines: Vec<&str> = text.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let t = t
            .strip_prefix("pub(crate) ")
            .or_else(|| t.strip_prefix("pub "))
            .unwrap_or(t);
        let is_enum = t.starts_with("enum ");
        if !(is_enum || t.starts_with("struct ")) || !t.trim_end().ends_with('{') {
            continue;
        }
        let mut depth = 0i32;
        for body in &lines[i + 1..] {
            let b = body.trim();
            if depth == 0 {
                if b.starts_with('}') {
                    break;
                }
                if !b.starts_with("//") && !b.starts_with('#') {
                    let b = b
                        .strip_prefix("pub(crate) ")
                        .or_else(|| b.strip_prefix("pub "))
                        .unwrap_or(b);
                    let name: String = b
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if is_enum && is_camel(&name) {
                        defs.insert(name);
                    } else if !is_enum && b[name.len()..].starts_with(':') && is_ident(&name) {
                        fields.insert(name);
                    }
                }
            }
            for c in b.split("//").next().unwrap_or_default().chars() {
                match c {
                    '{' | '(' | '[' => depth += 1,
                    '}' | ')' | ']' => depth -= 1,
                    _ => {}
                }
            }
            if depth < 0 {
                break;
            }
        }
    }
    (defs, fields)
}

fn tree() -> Tree {
    let root = workspace();
    let mut paths = BTreeSet::new();
    let mut rust = Vec::new();
    fn walk(dir: &Path, root: &Path, paths: &mut BTreeSet<String>, rust: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.filter_map(|e| e.ok()) {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || (dir == root && name == "target") {
                continue;
            }
            let rel = p
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            paths.insert(rel);
            if p.is_dir() {
                walk(&p, root, paths, rust);
            } else if name.ends_with(".rs") {
                rust.push(p);
            }
        }
    }
    walk(&root, &root, &mut paths, &mut rust);
    let crates: BTreeSet<String> = crates().into_iter().map(|(n, _)| n).collect();
    let mut defined_in: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut defined = BTreeSet::new();
    let mut fields = BTreeSet::new();
    for f in &rust {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        let (d, fl) = definitions(&text);
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let mut parts = rel.split('/');
        if let (Some("crates"), Some(krate), Some("src")) =
            (parts.next(), parts.next(), parts.next())
        {
            defined_in
                .entry(krate.to_string())
                .or_default()
                .extend(d.iter().cloned());
        }
        defined.extend(d);
        fields.extend(fl);
    }
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).unwrap();
    let mut outside: BTreeSet<String> = lock
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .map(|n| n.trim_end_matches('"').replace('-', "_"))
        .filter(|n| !crates.contains(&n.replace('_', "-")))
        .collect();
    outside.extend(["std", "core", "alloc"].map(String::from));
    Tree {
        paths,
        crates,
        defined_in,
        defined,
        fields,
        outside,
    }
}

/// One path segment against a pattern segment with `*` and `<..>`.
fn segment_matches(pattern: &str, name: &str) -> bool {
    // `<mode>` is a wildcard like `*`.
    let mut pat = String::new();
    let mut inside = false;
    for c in pattern.chars() {
        match c {
            '<' => {
                inside = true;
                pat.push('*');
            }
            '>' if inside => inside = false,
            _ if inside => {}
            c => pat.push(c),
        }
    }
    let parts: Vec<&str> = pat.split('*').collect();
    if parts.len() == 1 {
        return pat == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first)
        || !name[first.len()..].ends_with(last)
        || name.len() < first.len() + last.len()
    {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// Whether `path` (relative, `/`-separated, maybe with wildcards) names
/// something of the tree: from `base` (`""` is the root), or, with
/// `tail`, as the end of any path under `base`.
fn path_exists(t: &Tree, base: &str, path: &str, tail: bool) -> bool {
    let want: Vec<&str> = path.trim_end_matches('/').split('/').collect();
    t.paths.iter().any(|p| {
        let Some(rel) = (if base.is_empty() {
            Some(p.as_str())
        } else {
            p.strip_prefix(base).and_then(|r| r.strip_prefix('/'))
        }) else {
            return false;
        };
        let have: Vec<&str> = rel.split('/').collect();
        if tail {
            have.len() >= want.len()
                && want
                    .iter()
                    .zip(&have[have.len() - want.len()..])
                    .all(|(w, h)| segment_matches(w, h))
        } else {
            have.len() == want.len() && want.iter().zip(&have).all(|(w, h)| segment_matches(w, h))
        }
    })
}

/// Whether a span is a path citation (see the rule above).
fn looks_like_path(s: &str) -> bool {
    let chars_ok = s
        .chars()
        .all(|c| c.is_alphanumeric() || "_-./*<>".contains(c));
    let ext = s
        .rsplit('/')
        .next()
        .and_then(|f| f.rsplit_once('.'))
        .is_some_and(|(stem, e)| !stem.is_empty() && EXTENSIONS.contains(&e));
    chars_ok && !s.starts_with(['/', '-', '.']) && (s.contains('/') || ext)
}

/// What is wrong with the path `s`, cited where `context` is the folder
/// named nearby (`crates/kp-sync`, `deploy`); None when it exists.
fn check_path(t: &Tree, s: &str, context: Option<&str>) -> Option<String> {
    let first = s.split('/').next().unwrap_or_default();
    let ext = s
        .rsplit('/')
        .next()
        .and_then(|f| f.rsplit_once('.'))
        .is_some_and(|(_, e)| EXTENSIONS.contains(&e));
    let krate = context.filter(|c| c.starts_with("crates/"));
    let (bases, tail) =
        if ROOTS.contains(&first) || (!s.contains('/') && path_exists(t, "", s, false)) {
            (vec![String::new()], false)
        } else if t.crates.contains(first) {
            (vec!["crates".to_string()], false)
        } else if first == "src" || first == "tests" {
            (vec![krate.unwrap_or(BINARY).to_string()], false)
        } else if ext || s.ends_with('/') {
            // The binary's files are named bare everywhere (the doc says so).
            let mut b: Vec<String> = context.into_iter().map(String::from).collect();
            b.push(BINARY.to_string());
            (b, true)
        } else {
            return None;
        };
    if bases.iter().any(|b| path_exists(t, b, s, tail)) {
        return None;
    }
    let where_ = bases
        .iter()
        .map(|b| match (b.as_str(), tail) {
            ("", _) => "in the workspace".to_string(),
            (b, false) => format!("in {b}/"),
            (b, true) => format!("at the end of a path under {b}/"),
        })
        .collect::<Vec<_>>()
        .join(" or ");
    Some(format!("no file or folder `{s}` {where_}"))
}

/// What is wrong with the Rust path `segs` (one name cited in a span);
/// `krate` restricts the definitions to one crate's `src/`.
fn check_segments(t: &Tree, segs: &[&str], krate: Option<&str>) -> Vec<String> {
    let defs = match krate {
        Some(k) => match t.defined_in.get(k) {
            Some(d) => d,
            None => return vec![format!("no crate `{k}` with a src/")],
        },
        None => &t.defined,
    };
    segs.iter()
        .enumerate()
        .filter(|(i, s)| {
            // `Type::field` is how rustdoc names a field.
            let field = *i > 0 && is_camel(segs[i - 1]) && t.fields.contains(**s);
            let std_name = krate.is_none() && STD.contains(*s);
            let known = defs.contains(**s) || field || std_name;
            !known
        })
        .map(|(_, s)| match krate {
            Some(k) => format!("nothing called `{s}` is defined in crates/{k}/src"),
            None => format!("nothing called `{s}` is defined in the workspace"),
        })
        .collect()
}

/// The whole span as a name citation: `A::b`, `a::B::c`, `Type.field`,
/// `Name`, after dropping a call, generics and a pattern. None when the
/// span is not one.
fn check_name_span(t: &Tree, span: &str) -> Option<Vec<String>> {
    let mut s = span.trim().to_string();
    if let Some(i) = s.find(" {") {
        if s.ends_with('}') {
            s.truncate(i);
        }
    }
    let mut generics = Vec::new();
    if let Some(i) = s.find('<') {
        if s.ends_with('>') {
            generics = s[i + 1..s.len() - 1]
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .filter(|w| is_camel(w))
                .map(String::from)
                .collect();
            s.truncate(i);
        }
    }
    if let Some(i) = s.find('(') {
        s.truncate(i);
    }
    let s = s.trim_end_matches('!');
    let mut out = Vec::new();
    if let Some((ty, field)) = s.split_once('.') {
        if !(is_camel(ty) && is_ident(field)) {
            return None;
        }
        out.extend(check_segments(t, &[ty], None));
        if !t.fields.contains(field) {
            out.push(format!("no struct has a field `{field}`"));
        }
        return Some(out);
    }
    let segs: Vec<&str> = s.split("::").collect();
    if !segs.iter().all(|x| is_ident(x)) {
        return None;
    }
    if segs.len() == 1 && !is_camel(segs[0]) {
        return None;
    }
    if t.outside.contains(segs[0]) {
        return Some(out);
    }
    out.extend(check_segments(t, &segs, None));
    let g: Vec<&str> = generics.iter().map(String::as_str).collect();
    out.extend(check_segments(t, &g, None));
    Some(out)
}

/// Every `prefix::a::b` path inside a span, as its segments.
fn qualified_paths<'a>(span: &'a str, prefix: &str) -> Vec<Vec<&'a str>> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = span[from..].find(prefix) {
        let at = from + i;
        from = at + prefix.len();
        let before = span[..at].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let end = span[at..]
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .map_or(span.len(), |e| at + e);
        let segs: Vec<&str> = span[at..end].trim_end_matches(':').split("::").collect();
        if segs.len() >= 2 && segs.iter().all(|x| is_ident(x)) {
            out.push(segs);
        }
    }
    out
}

/// Every citation of `doc` (named `name`, read from docs/) that names
/// nothing in the tree: `name:line: what`.
fn doc_citation_errors(t: &Tree, name: &str, doc: &str) -> Vec<String> {
    let mut errors = Vec::new();
    let mut report = |line: usize, span: &str, why: String| {
        errors.push(format!("{name}:{line}: `{span}`: {why}"));
    };
    // Paragraphs (a table row and a list item each are one), the line each
    // starts on; fenced blocks apart.
    let mut paragraphs: Vec<(usize, String)> = Vec::new();
    let mut fenced: Vec<(usize, &str)> = Vec::new();
    let mut in_fence = false;
    let mut current: Option<(usize, String)> = None;
    for (i, line) in doc.lines().enumerate() {
        let n = i + 1;
        let t0 = line.trim_start();
        if t0.starts_with("```") {
            in_fence = !in_fence;
            paragraphs.extend(current.take());
            continue;
        }
        if in_fence {
            fenced.push((n, line));
            continue;
        }
        let starts = t0.is_empty()
            || t0.starts_with('|')
            || t0.starts_with("* ")
            || t0.starts_with("- ")
            || t0.starts_with('#');
        if starts {
            paragraphs.extend(current.take());
        }
        if t0.is_empty() {
            continue;
        }
        match &mut current {
            Some((_, text)) => {
                text.push('\n');
                text.push_str(line);
            }
            None => current = Some((n, line.to_string())),
        }
    }
    paragraphs.extend(current);

    let rooted_word = |w: &str| {
        let punct = |c: char| "()[],.;:\"'`".contains(c);
        let w = w
            .trim_matches(punct)
            .trim_end_matches("'s")
            .trim_matches(punct);
        let first = w.split('/').next().unwrap_or_default();
        let ok = w.contains('/') && (ROOTS.contains(&first) || t.crates.contains(first));
        ok.then(|| w.to_string())
    };
    for (n, line) in &fenced {
        for w in line.split_whitespace().filter_map(rooted_word) {
            if let Some(why) = check_path(t, &w, None) {
                report(*n, &w, why);
            }
        }
    }
    for (start, text) in &paragraphs {
        let line_at = |i: usize| start + text[..i].matches('\n').count();
        let mut context: Option<String> = None;
        // The paragraph with its spans blanked out (lines kept): its prose.
        let mut prose: Vec<char> = text.chars().collect();
        let ticks: Vec<usize> = text.match_indices('`').map(|(i, _)| i).collect();
        for pair in ticks.chunks(2) {
            let [a, b] = pair else { break };
            let (ca, cb) = (text[..*a].chars().count(), text[..*b].chars().count());
            for c in &mut prose[ca..=cb] {
                if *c != '\n' {
                    *c = ' ';
                }
            }
            let span: String = text[a + 1..*b]
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            let line = line_at(*a);
            if looks_like_path(&span) {
                if let Some(why) = check_path(t, &span, context.as_deref()) {
                    report(line, &span, why);
                }
                let mut parts = span.split('/');
                let first = parts.next().unwrap_or_default();
                let second = parts.next().unwrap_or_default();
                if first == "crates" && t.crates.contains(second) {
                    context = Some(format!("crates/{second}"));
                } else if t.crates.contains(first) {
                    context = Some(format!("crates/{first}"));
                } else if ROOTS.contains(&first) && first != "crates" && span.contains('/') {
                    context = Some(first.to_string());
                }
                continue;
            }
            if t.crates.contains(span.as_str()) {
                context = Some(format!("crates/{span}"));
                continue;
            }
            let mut qualified = false;
            for (prefix, krate) in t
                .crates
                .iter()
                .map(|c| (format!("{}::", c.replace('-', "_")), Some(c.as_str())))
                .chain(std::iter::once(("crate::".to_string(), None)))
            {
                for segs in qualified_paths(&span, &prefix) {
                    qualified = true;
                    for why in check_segments(t, &segs[1..], krate) {
                        report(line, &span, why);
                    }
                }
            }
            if qualified {
                continue;
            }
            for why in check_name_span(t, &span).unwrap_or_default() {
                report(line, &span, why);
            }
        }
        let prose: String = prose.into_iter().collect();
        for (i, l) in prose.lines().enumerate() {
            for w in l.split_whitespace().filter_map(rooted_word) {
                if let Some(why) = check_path(t, &w, None) {
                    report(start + i, &w, why);
                }
            }
        }
        let mut from = 0;
        while let Some(i) = text[from..].find("](") {
            let at = from + i + 2;
            let end = text[at..].find(')').map_or(text.len(), |e| at + e);
            from = end;
            let target = &text[at..end];
            if target.contains("://") || target.starts_with('#') || target.starts_with("mailto:") {
                continue;
            }
            let file = target.split('#').next().unwrap_or_default();
            let mut parts: Vec<&str> = vec!["docs"];
            for seg in file.split('/') {
                match seg {
                    ".." => {
                        parts.pop();
                    }
                    "." | "" => {}
                    s => parts.push(s),
                }
            }
            let resolved = parts.join("/");
            if !path_exists(t, "", &resolved, false) {
                report(
                    line_at(at),
                    target,
                    format!("the link's target `{resolved}` does not exist"),
                );
            }
        }
    }
    errors
}

/// docs/architecture.md, the first thing a maintainer reads, names only
/// paths and Rust names that exist (the rule above).
#[test]
fn architecture_doc_cites_only_what_exists() {
    let t = tree();
    assert!(
        t.defined.len() > 1000 && t.crates.len() > 10,
        "read too little of the tree"
    );
    let doc = std::fs::read_to_string(workspace().join("docs/architecture.md")).unwrap();
    let errors = doc_citation_errors(&t, "docs/architecture.md", &doc);
    assert!(
        errors.is_empty(),
        "docs/architecture.md cites {} things that do not exist:\n{}",
        errors.len(),
        errors.join("\n")
    );
}

/// The checker itself: a made-up doc's wrong names and paths are found, each
/// with its line, and its right ones are not.
#[test]
fn the_doc_checker_finds_what_does_not_exist() {
    let t = tree();
    let doc = "\
# A doc

`kp_model::EndpointSelection` and `kp_model::NoSuchThing`, `Schedule`,
`NoSuchType`, `SyncLoop::run`, `Due::Check`, `Due::Nowhere`.

| `kp-sync` | `src/schedule.rs` and `src/nothing.rs`, `schedule.rs` |

* `crates/kp-model/src/dataplane.rs`, `crates/kp-model/src/gone.rs`, and
  `tests/convert_node.rs`, `ProxierConfig.node_ips`, `schedule.rs`,
  `ProxierConfig.no_field`, `clap::Args`, `std::sync::Arc`, `Arc`,
  [a link](nftables.md#x), [a dead link](gone.md), docs/gone.md,
  `Known<NoSuchArg>`, `if sp.node_port != 0`, `api/nftables`.

`tests/house.rs`, `tests/conformance_<mode>.rs`, `tests/convert_node.rs`,
`kube-proxy-rs/src/metrics/mod.rs`, `metrics.rs`, `crates/*`, deploy/'s files,
`SyncLoop::node_check`, `deploy/monitoring/alerts.test.yml`, `alerts.rules.yml`.
";
    let errors = doc_citation_errors(&t, "made-up.md", doc);
    let wanted = [
        "made-up.md:3: `kp_model::NoSuchThing`",
        "made-up.md:4: `NoSuchType`",
        "made-up.md:4: `Due::Nowhere`",
        "made-up.md:6: `src/nothing.rs`",
        "made-up.md:8: `crates/kp-model/src/gone.rs`",
        "made-up.md:10: `ProxierConfig.no_field`",
        "made-up.md:11: `gone.md`",
        "made-up.md:9: `schedule.rs`",
        "made-up.md:11: `docs/gone.md`",
        "made-up.md:12: `Known<NoSuchArg>`",
        "made-up.md:14: `tests/convert_node.rs`",
    ];
    for w in wanted {
        assert!(
            errors.iter().any(|e| e.starts_with(w)),
            "not found: {w}\nfound:\n{}",
            errors.join("\n")
        );
    }
    assert_eq!(errors.len(), wanted.len(), "{}", errors.join("\n"));
}

/// The most BENCHMARKS.md may hold: the current figure of each table, its
/// command and the note that makes it meaningful. History goes to
/// docs/benchmarks-history.md.
const BENCHMARKS_MAX_LINES: usize = 1000;

/// BENCHMARKS.md stays short, and every table a bench writes into it
/// (`--write BENCHMARKS.md`, between `<!-- NAME begin -->` and `<!-- NAME
/// end -->`, kp-bench's `lab::write_into`) is there once, whole: a marker
/// that appears twice, or an end without its begin, would make the next
/// `--write` replace the wrong text or append a copy. Each marker's first
/// word must start a string in kp-bench's sources, so none names a bench
/// that writes nothing.
#[test]
fn benchmarks_md_is_short_and_its_markers_whole() {
    let root = workspace();
    let text = std::fs::read_to_string(root.join("BENCHMARKS.md")).unwrap();
    let lines = text.lines().count();
    let mut wrong = Vec::new();
    if lines > BENCHMARKS_MAX_LINES {
        wrong.push(format!(
            "BENCHMARKS.md has {lines} lines, more than {BENCHMARKS_MAX_LINES}: move history, superseded runs and discussion to docs/benchmarks-history.md"
        ));
    }
    // Every source file of kp-bench, its subcommands' folders included.
    let mut bench_src = String::new();
    let mut dirs = vec![root.join("crates/kp-bench/src")];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                bench_src.push_str(&std::fs::read_to_string(p).unwrap());
            }
        }
    }
    let mut names = BTreeSet::new();
    for (n, line) in text.lines().enumerate() {
        let Some(rest) = line.trim().strip_prefix("<!-- ") else {
            continue;
        };
        let Some(rest) = rest.strip_suffix(" -->") else {
            continue;
        };
        if let Some(name) = rest.strip_suffix(" begin") {
            names.insert(name.to_string());
        } else if let Some(name) = rest.strip_suffix(" end") {
            if !text.contains(&format!("<!-- {name} begin -->")) {
                wrong.push(format!(
                    "BENCHMARKS.md:{}: `{name}` ends but never begins",
                    n + 1
                ));
            }
        }
    }
    for name in &names {
        let begin = format!("<!-- {name} begin -->");
        let end = format!("<!-- {name} end -->");
        let (b, e) = (text.matches(&begin).count(), text.matches(&end).count());
        if b != 1 || e != 1 {
            wrong.push(format!(
                "`{name}`: {b} begin and {e} end markers, not one each"
            ));
        } else if text.find(&begin) > text.find(&end) {
            wrong.push(format!("`{name}`: its end comes before its begin"));
        }
        let first = name.split_whitespace().next().unwrap_or_default();
        if !bench_src.contains(&format!("\"{first}")) {
            wrong.push(format!(
                "`{name}`: no string in crates/kp-bench starts with `{first}`"
            ));
        }
    }
    assert!(
        names.len() >= 10,
        "found only {} markers in BENCHMARKS.md",
        names.len()
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The binary is grouped by concern (metrics/, http/, kube/, cli/, config/,
/// modes/, render/): its src/ root holds main, lib and the two modules with
/// no better home, and every folder is declared by lib.rs.
#[test]
fn the_binary_root_holds_only_main_lib_and_homeless_modules() {
    let src = workspace().join("crates/kube-proxy-rs/src");
    let allowed = ["lib.rs", "main.rs", "host.rs", "logging.rs"];
    let mut stray = Vec::new();
    let mut folders = Vec::new();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        if e.file_type().unwrap().is_dir() {
            folders.push(name);
        } else if !allowed.contains(&name.as_str()) {
            stray.push(name);
        }
    }
    assert!(
        stray.is_empty(),
        "files at the binary's src/ root that belong in a folder by concern: {stray:?}"
    );
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    for f in folders.iter().filter(|f| *f != "bin") {
        assert!(
            lib.contains(&format!("pub mod {f};")),
            "src/{f}/ is not a module of lib.rs"
        );
    }
}
