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
