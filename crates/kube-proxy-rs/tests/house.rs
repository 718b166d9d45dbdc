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
    "kp-socketlb",
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
