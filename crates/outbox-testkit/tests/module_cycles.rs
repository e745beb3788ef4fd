//! No module of a crate in this workspace reaches itself through the paths it imports (issue
//! 26: "no module cycles"). A cycle makes two files one unit that neither can be read, tested
//! or moved without the other; the pure decision modules of `outbox-relay` had five of them
//! around `pipeline.rs` until 2026-12-06.
//!
//! What counts as an import here: a path written from the crate's root (`crate::a::b`), from
//! the parent (`super::x`) or from the module itself (`self::x`), in code (comments are left
//! out), resolved to the longest module of the crate it names. A child module naming its
//! parent is how Rust splits a module over files, so a module's own descendants and ancestors
//! are not edges; everything else is. Binaries under `src/bin` are crates of their own.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file below `dir`, sorted.
fn rs_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The module a file of `src` holds (`lib.rs` and `main.rs`: the root, ""); `None` for a
/// binary's file under `src/bin`.
fn module_of(rel: &Path) -> Option<String> {
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    let mut names: Vec<String> = parts.clone();
    let file = names.pop()?;
    let stem = file.trim_end_matches(".rs");
    if !matches!(stem, "lib" | "main" | "mod") {
        names.push(stem.to_string());
    }
    Some(names.join("::"))
}

fn parent(m: &str) -> String {
    m.rsplit_once("::")
        .map_or(String::new(), |(p, _)| p.to_string())
}

fn is_within(m: &str, ancestor: &str) -> bool {
    ancestor.is_empty() || m == ancestor || m.starts_with(&format!("{ancestor}::"))
}

/// The modules a module's code names by path, resolved against `modules`.
fn references(code: &str, module: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in code.lines() {
        // Code only: a comment (doc or not) ends the line's code.
        let line = line.split("//").next().unwrap_or("");
        for (prefix, base) in [
            ("crate::", String::new()),
            ("super::", parent(module)),
            ("self::", module.to_string()),
        ] {
            let mut rest = line;
            while let Some(at) = rest.find(prefix) {
                // `super::` inside `crate::super::`-like text cannot occur; a word character
                // before the prefix means another identifier (`outbox_crate::`), not this one.
                let before = rest[..at].chars().last();
                rest = &rest[at + prefix.len()..];
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    continue;
                }
                let path: Vec<&str> = rest
                    .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                    .next()
                    .unwrap_or("")
                    .split("::")
                    .filter(|s| !s.is_empty())
                    .collect();
                // The longest prefix of the path that is a module of the crate.
                let mut target = base.clone();
                for seg in path {
                    let next = if target.is_empty() {
                        seg.to_string()
                    } else {
                        format!("{target}::{seg}")
                    };
                    if modules.contains(&next) {
                        target = next;
                    } else {
                        break;
                    }
                }
                if !is_within(&target, module) && !is_within(module, &target) {
                    out.insert(target);
                }
            }
        }
    }
    out
}

/// The import graph of the crate whose sources are below `src`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let files: Vec<(String, PathBuf)> = rs_files(src)
        .into_iter()
        .filter_map(|p| {
            let m = module_of(p.strip_prefix(src).ok()?)?;
            Some((m, p))
        })
        .collect();
    let modules: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, p) in &files {
        let code = std::fs::read_to_string(p).expect("a readable source file");
        g.entry(m.clone())
            .or_default()
            .extend(references(&code, m, &modules));
    }
    g
}

/// The cycles of `g`: its strongly connected components of more than one module (Tarjan).
fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> T<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on.insert(v);
            for w in self.g.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.g.contains_key(w) {
                    continue;
                }
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut scc = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    scc.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    self.out.push(scc);
                }
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

fn workspace_crates() -> Vec<PathBuf> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&crates)
        .expect("the workspace's crates folder")
        .flatten()
        .map(|e| e.path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    out
}

#[test]
fn no_crate_of_the_workspace_has_a_module_cycle() {
    let crates = workspace_crates();
    assert!(
        crates.len() >= 10,
        "found only {} crates under crates/: is the workspace laid out as the test expects?",
        crates.len()
    );
    let mut found = Vec::new();
    let mut edges = 0;
    for src in &crates {
        let g = graph(src);
        edges += g.values().map(BTreeSet::len).sum::<usize>();
        for c in cycles(&g) {
            found.push(format!("{}: {}", src.display(), c.join(" <-> ")));
        }
    }
    // The graph is not empty: a parser that saw no import would pass any tree.
    assert!(
        edges > 100,
        "only {edges} imports between modules were read"
    );
    assert!(
        found.is_empty(),
        "module cycles (each module reaches the others through the paths it imports; move what they share into a module both read):\n{}",
        found.join("\n")
    );
}

#[test]
fn a_planted_cycle_is_found_and_a_parent_child_pair_is_not_one() {
    let dir = std::env::temp_dir().join(format!("module-cycles-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("core")).unwrap();
    std::fs::write(
        src.join("lib.rs"),
        "pub mod a;\npub mod b;\npub mod core;\n",
    )
    .unwrap();
    // a -> b -> a through a re-export and a full path; core/mod.rs and its child name each
    // other (one module split over files); a comment naming `crate::core` is not an import.
    std::fs::write(src.join("a.rs"), "pub use crate::b::B;\npub struct A;\n").unwrap();
    std::fs::write(
        src.join("b.rs"),
        "pub struct B(pub crate::a::A);\n// crate::core::Thing\n",
    )
    .unwrap();
    std::fs::write(
        src.join("core/mod.rs"),
        "mod inner;\npub use self::inner::Thing;\n",
    )
    .unwrap();
    std::fs::write(
        src.join("core/inner.rs"),
        "pub struct Thing;\nimpl Thing { fn f(_: &super::Thing) {} }\n",
    )
    .unwrap();
    let g = graph(&src);
    let found = cycles(&g);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(found, vec![vec!["a".to_string(), "b".to_string()]], "{g:?}");
    assert!(
        !g["b"].contains("core"),
        "a comment is not an import: {g:?}"
    );
}
