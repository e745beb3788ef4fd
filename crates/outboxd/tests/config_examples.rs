//! Every configuration example a team copies parses: each ```toml block of the README and of
//! docs/*.md is loaded with the same `FileConfig::load` as `outboxd run --config` (unknown keys
//! and misplaced keys are errors). A newcomer's first `check --config` failed on the README's
//! own block (`log_format` below `[relay]`; issue 34).

use std::path::{Path, PathBuf};

use outboxd::config::FileConfig;

/// The ```toml blocks of `text`, with the line each starts on.
fn toml_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        match &mut current {
            None if line.trim_start().starts_with("```toml") => {
                current = Some((i + 1, String::new()));
            }
            Some(_) if line.trim_start().starts_with("```") => {
                blocks.push(current.take().unwrap());
            }
            Some((_, body)) => {
                body.push_str(line);
                body.push('\n');
            }
            None => {}
        }
    }
    assert!(current.is_none(), "a ```toml block is not closed");
    blocks
}

fn documents() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut docs = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            docs.push(path);
        }
    }
    docs.sort();
    docs
}

#[test]
fn every_toml_example_in_the_readme_and_docs_parses() {
    let dir = tempfile::tempdir().unwrap();
    let mut parsed = 0;
    let mut failures = Vec::new();
    let mut readme_blocks = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for (line, body) in toml_blocks(&text) {
            let file = dir.path().join(format!("example-{parsed}.toml"));
            std::fs::write(&file, &body).unwrap();
            match FileConfig::load(&file) {
                Ok(_) => parsed += 1,
                Err(e) => failures.push(format!("{}:{line}: {e:#}", doc.display())),
            }
            if doc.ends_with("README.md") {
                readme_blocks += 1;
            }
        }
    }
    assert!(
        failures.is_empty(),
        "configuration examples that `outboxd run --config` refuses:\n{}",
        failures.join("\n")
    );
    // The README's full example is among them, or this proves nothing about it.
    assert!(readme_blocks >= 1, "no ```toml block in the README");
    assert!(parsed >= 5, "only {parsed} examples found");
}

#[test]
fn a_misplaced_key_is_refused_by_name() {
    // The README's old mistake, kept as the case the test above must catch.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        "[relay]\nmax_in_flight = 10\n\nlog_format = \"json\"\n",
    )
    .unwrap();
    let err = format!("{:#}", FileConfig::load(&file).unwrap_err());
    assert!(err.contains("log_format"), "{err}");
}

/// `[default: X]` of every flag of every `outboxd` subcommand's `--help`.
fn help_defaults() -> std::collections::HashMap<String, String> {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(args)
            .output()
            .expect("run outboxd --help");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let top = run(&["--help"]);
    let subcommands: Vec<String> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| !l.starts_with("Options:"))
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    assert!(subcommands.len() >= 8, "subcommands found: {subcommands:?}");
    let mut defaults = std::collections::HashMap::new();
    for sub in &subcommands {
        let mut flag: Option<String> = None;
        for line in run(&[sub, "--help"]).lines() {
            let t = line.trim_start();
            if let Some(rest) = t.strip_prefix("--") {
                flag = rest.split([' ', '=', '<']).next().map(str::to_string);
            } else if t.starts_with('-') && t.contains(", --") {
                flag = t
                    .split(", --")
                    .nth(1)
                    .and_then(|r| r.split([' ', '=', '<']).next())
                    .map(str::to_string);
            }
            if let (Some(f), Some(i)) = (&flag, line.find("[default: ")) {
                let v = &line[i + 10..];
                if let Some(end) = v.find(']') {
                    defaults
                        .entry(f.clone())
                        .or_insert_with(|| v[..end].to_string());
                }
            }
        }
    }
    defaults
}

/// A number as the docs write it ("5 000", "1,000", "5 s" for a `-ms` flag) in the flag's unit.
fn doc_number(flag: &str, text: &str) -> Option<String> {
    let t = text.trim();
    let (digits, unit) = match t.find(|c: char| !(c.is_ascii_digit() || c == ' ' || c == ',')) {
        Some(i) => (&t[..i], t[i..].trim()),
        None => (t, ""),
    };
    let n: u64 = digits.replace([' ', ','], "").parse().ok()?;
    match (unit, flag.ends_with("-ms")) {
        ("", _) => Some(n.to_string()),
        ("s", true) => Some((n * 1000).to_string()),
        ("ms", true) => Some(n.to_string()),
        _ => None,
    }
}

/// Every "`--flag` ... (default N" the docs write agrees with `--help`: the docs said
/// `--max-in-flight` "(default 10 000)" while the binary's default was 5000 (issue 34).
#[test]
fn defaults_written_in_the_docs_are_the_binarys() {
    let defaults = help_defaults();
    assert!(
        defaults.contains_key("max-in-flight"),
        "no default read from `outboxd run --help`: {defaults:?}"
    );
    let mut compared = 0;
    let mut wrong = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for (n, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(i) = rest.find("`--") {
                let after = &rest[i + 3..];
                let Some(end) = after.find('`') else { break };
                let flag = after[..end]
                    .split([' ', '='])
                    .next()
                    .unwrap_or("")
                    .to_string();
                let tail = &after[end..];
                rest = tail;
                // The default named right after the flag, before another flag is named.
                let window = tail.split("`--").next().unwrap_or("");
                let Some(d) = window.find("(default ") else {
                    continue;
                };
                let value: String = window[d + 9..]
                    .chars()
                    .take_while(|c| *c != ')' && *c != ';' && *c != ':')
                    .collect();
                let (Some(help), Some(doc_value)) =
                    (defaults.get(&flag), doc_number(&flag, &value))
                else {
                    continue;
                };
                compared += 1;
                if help.replace([' ', ','], "") != doc_value {
                    wrong.push(format!(
                        "{}:{}: `--{flag}` (default {value}) but `--help` says [default: {help}]",
                        doc.display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(
        compared >= 3,
        "only {compared} documented defaults compared"
    );
}
