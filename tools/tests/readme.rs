//! The README and docs/ as a user reads them: every `ctxfs` command line in their code
//! blocks names a command (and options) the binary has, and every relative link they make
//! points to a file or directory in the repository.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root (this package lives in `tools/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tools/ has a parent").to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `ctxfs ARGS --help`, as text.
fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ctxfs"))
        .args(args)
        .arg("--help")
        .env_remove("CTXFS_DEVICE")
        .output()
        .expect("run ctxfs");
    assert!(out.status.success(), "ctxfs {args:?} --help failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// The subcommand names of a `--help` text's "Commands:" section.
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// A `ctxfs` invocation found in a code block: its words after the program name.
struct Invocation {
    file: String,
    line: usize,
    words: Vec<String>,
}

/// The lines of fenced code blocks that run `ctxfs`: `ctxfs ...`, `path/to/ctxfs ...`, or
/// `cargo run ... -p ctxfs -- ...`. A trailing ` # comment` and anything after a pipe are
/// dropped.
fn invocations(file: &str, text: &str) -> Vec<Invocation> {
    let mut found = Vec::new();
    let mut in_code = false;
    for (i, raw) in text.lines().enumerate() {
        if raw.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if !in_code {
            continue;
        }
        let mut line = raw.trim().trim_start_matches("$ ");
        if let Some(at) = line.find(" #") {
            line = &line[..at];
        }
        if let Some(at) = line.find(" | ") {
            line = &line[..at];
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let args = match words.first() {
            Some(&w) if w == "ctxfs" || w.ends_with("/ctxfs") => &words[1..],
            Some(&"cargo") if words.get(1) == Some(&"run") && line.contains("-p ctxfs") => {
                match words.iter().position(|w| *w == "--") {
                    Some(at) => &words[at + 1..],
                    None => continue,
                }
            }
            _ => continue,
        };
        found.push(Invocation {
            file: file.to_string(),
            line: i + 1,
            words: args.iter().map(|w| w.to_string()).collect(),
        });
    }
    found
}

/// The long options a command line names (`[--dtype f16|bf16]` names `--dtype`).
fn options(words: &[String]) -> Vec<String> {
    words
        .iter()
        .filter_map(|w| {
            let at = w.find("--")?;
            let name: String =
                w[at + 2..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-').collect();
            (!name.is_empty()).then(|| format!("--{name}"))
        })
        .collect()
}

/// The relative targets of a markdown text's links, `[text](target)`, without their anchors.
fn relative_links(text: &str) -> Vec<String> {
    let mut links = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = rest[..end].trim();
        rest = &rest[end..];
        if target.is_empty() || target.starts_with('#') || target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        links.push(target.split('#').next().unwrap_or(target).to_string());
    }
    links
}

/// Checks every `ctxfs` invocation of `docs` against the binary's help; returns how many
/// there were.
fn check_commands(docs: &[(String, String)]) -> usize {
    let top = help(&[]);
    let commands = subcommands(&top);
    assert!(commands.iter().any(|c| c == "mkfs"), "`ctxfs --help` lists no commands:\n{top}");
    let bench = subcommands(&help(&["bench"]));
    let mut failures = Vec::new();
    let mut count = 0;
    for (file, text) in docs {
        for inv in invocations(file, text) {
            count += 1;
            let at = format!("{}:{}: ctxfs {}", inv.file, inv.line, inv.words.join(" "));
            let Some(cmd) = inv.words.first() else {
                failures.push(format!("{at}: no command"));
                continue;
            };
            if !commands.contains(cmd) {
                failures.push(format!("{at}: `{cmd}` is not in `ctxfs --help`"));
                continue;
            }
            let mut path = vec![cmd.as_str()];
            let mut rest = &inv.words[1..];
            if cmd == "bench" {
                match rest.first() {
                    Some(sub) if bench.contains(sub) => {
                        path.push(sub);
                        rest = &rest[1..];
                    }
                    other => {
                        failures
                            .push(format!("{at}: `bench {}` is not in `ctxfs bench --help`", other.map_or("", |s| s)));
                        continue;
                    }
                }
            }
            let text = help(&path);
            for option in options(rest) {
                if !text.contains(&option) {
                    failures.push(format!("{at}: `{option}` is not in `ctxfs {} --help`", path.join(" ")));
                }
            }
        }
    }
    assert!(failures.is_empty(), "commands the binary does not have:\n{}", failures.join("\n"));
    count
}

/// Checks every relative link of `docs` (each resolved against its file's directory).
fn check_links(docs: &[(String, String)]) -> usize {
    let mut missing = Vec::new();
    let mut count = 0;
    for (file, text) in docs {
        let dir = root().join(file).parent().expect("a file has a directory").to_path_buf();
        for link in relative_links(text) {
            count += 1;
            if !dir.join(&link).exists() {
                missing.push(format!("{file}: ({link}) does not exist"));
            }
        }
    }
    assert!(missing.is_empty(), "broken links:\n{}", missing.join("\n"));
    count
}

/// README.md and every markdown file in docs/, as (path from the root, text).
fn docs() -> Vec<(String, String)> {
    let mut files = vec!["README.md".to_string()];
    let mut more: Vec<String> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.expect("a docs/ entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    more.sort();
    files.extend(more);
    files.into_iter().map(|f| (f.clone(), read(&root().join(&f)))).collect()
}

#[test]
fn readme_commands_exist_in_the_binary() {
    let readme = [("README.md".to_string(), read(&root().join("README.md")))];
    let invs = invocations("README.md", &readme[0].1);
    // The tour runs each of these; a README without them (or a parser that finds nothing)
    // fails here rather than passing on an empty list.
    for cmd in ["demo", "mkfs", "gen", "import", "query", "inspect", "fsck", "bench"] {
        assert!(invs.iter().any(|i| i.words.first().is_some_and(|w| w == cmd)), "README.md runs no `ctxfs {cmd}`");
    }
    assert!(check_commands(&readme) >= 10);
}

#[test]
fn readme_links_exist() {
    let readme = [("README.md".to_string(), read(&root().join("README.md")))];
    assert!(check_links(&readme) > 0, "README.md links nothing");
}

#[test]
fn docs_commands_and_links_exist() {
    let docs = docs();
    assert!(docs.len() > 1, "docs/ has no markdown files");
    check_commands(&docs);
    check_links(&docs);
}

#[test]
fn the_parsers_find_what_they_must() {
    let text = "x\n```sh\nctxfs bench io S --mib 1 # c\ncargo run --release -p ctxfs -- demo\n\
                target/release/ctxfs query S [--mode auto|full] | head\nls\n```\nctxfs gen outside\n\
                [a](docs/a.md) [b](https://x.y) [c](#here) [d](vfs/#x)\n";
    let invs = invocations("t", text);
    let words: Vec<String> = invs.iter().map(|i| i.words.join(" ")).collect();
    assert_eq!(words, ["bench io S --mib 1", "demo", "query S [--mode auto|full]"]);
    assert_eq!(options(&invs[2].words), ["--mode"]);
    assert_eq!(relative_links(text), ["docs/a.md", "vfs/"]);
}
