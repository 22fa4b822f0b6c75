//! docs/flags.md against the CLI's own definition (clap's Command tree):
//! every subcommand has a section, every long flag, environment variable and
//! accepted value of it is named there, and the section names no flag the
//! subcommand does not have. A renamed or added flag fails here until the
//! page follows.

use std::{collections::BTreeMap, path::Path};

use clap::CommandFactory;
use proxy_user::cli::Cli;

/// Sections of the page by the command in their heading ("ebpf-proxy run").
fn sections(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            current = Some(heading.trim_matches(|c| c == '`' || c == ' ').to_string());
            out.insert(current.clone().unwrap(), String::new());
        } else if let Some(name) = &current {
            let body = out.get_mut(name).unwrap();
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}

/// Every `--flag` written in `text` (not table rules such as `|------|`).
fn flags_named(text: &str) -> Vec<String> {
    text.match_indices("--")
        .filter(|(i, _)| !text[..*i].ends_with('-'))
        .map(|(i, _)| text[i + 2..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect::<String>())
        .filter(|name| name.starts_with(|c: char| c.is_ascii_alphanumeric()))
        .collect()
}

fn check(cmd: &clap::Command, path: &str, pages: &BTreeMap<String, String>, problems: &mut Vec<String>) {
    let Some(section) = pages.get(path) else {
        problems.push(format!("no section `## `{path}`` in docs/flags.md"));
        return;
    };
    let mut known = vec!["help".to_string(), "version".to_string()];
    for arg in cmd.get_arguments() {
        if let Some(long) = arg.get_long() {
            known.push(long.to_string());
            if !section.contains(&format!("--{long}")) {
                problems.push(format!("{path}: --{long} is not documented"));
            }
        }
        if let Some(env) = arg.get_env() {
            let env = env.to_string_lossy();
            if !section.contains(env.as_ref()) {
                problems.push(format!("{path}: environment variable {env} ({}) is not documented", arg.get_id()));
            }
        }
        // Switches (--masquerade-all) list true/false; only values one types count.
        let values = if arg.get_action().takes_values() { arg.get_possible_values() } else { Vec::new() };
        for value in values {
            if !arg.is_hide_possible_values_set() && !value.is_hide_set() && !section.contains(&format!("`{}`", value.get_name())) {
                problems.push(format!("{path}: value `{}` of {} is not documented", value.get_name(), arg.get_id()));
            }
        }
    }
    for named in flags_named(section) {
        if !known.contains(&named) {
            problems.push(format!("{path}: docs/flags.md names --{named}, which `{path}` does not take"));
        }
    }
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        check(sub, &format!("{path} {}", sub.get_name()), pages, problems);
    }
}

#[test]
fn flags_page_documents_every_subcommand_flag_and_value() {
    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/flags.md");
    let text = std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
    let pages = sections(&text);
    let cli = Cli::command();
    let mut problems = Vec::new();
    check(&cli, cli.get_name(), &pages, &mut problems);
    assert!(problems.is_empty(), "docs/flags.md is out of step with the CLI:\n{}", problems.join("\n"));
}

#[test]
fn the_check_sees_a_missing_and_a_stale_flag() {
    let cmd = clap::Command::new("tool")
        .subcommand(clap::Command::new("go").arg(clap::Arg::new("fast").long("fast").action(clap::ArgAction::SetTrue)));
    let mut problems = Vec::new();
    check(&cmd, "tool", &sections("## `tool`\n## `tool go`\n`--slow`\n"), &mut problems);
    assert_eq!(problems, ["tool go: --fast is not documented", "tool go: docs/flags.md names --slow, which `tool go` does not take"]);
}
