//! `farmap completions` and `farmap man`: the bash script completes farmap's commands and
//! flags when bash runs it; a man page per visible command, none for hidden ones, each
//! rendered by man(1) where it is installed.

mod common;
use common::farmap;

/// What bash's completion offers for `words` (the last one being completed).
fn complete(script: &str, words: &[&str]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("farmap.bash");
    std::fs::write(&path, script).unwrap();
    let line = format!(
        "source {}; COMP_WORDS=({}); COMP_CWORD={}; COMP_LINE=\"{}\"; COMP_POINT=${{#COMP_LINE}}; \
         _farmap farmap \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"; \
         printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        path.display(),
        words.join(" "),
        words.len() - 1,
        words.join(" ")
    );
    farmap_testkit::process::stdout_of(std::process::Command::new("bash").args(["-c", &line]))
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn bash_completes_commands_and_flags() {
    let script = farmap().ok(&["completions", "bash"]);
    let syntax = std::process::Command::new("bash")
        .args(["-n", "-c", &script])
        .status()
        .unwrap();
    assert!(syntax.success(), "the bash script does not parse");
    let commands = complete(&script, &["farmap", "mo"]);
    assert!(commands.contains(&"mount".to_owned()), "{commands:?}");
    assert!(
        !commands.iter().any(|c| c.starts_with("__")),
        "{commands:?}"
    );
    let flags = complete(&script, &["farmap", "doctor", "--"]);
    assert!(flags.contains(&"--json".to_owned()), "{flags:?}");
    // Every shell clap knows gets a script.
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        assert!(
            farmap().ok(&["completions", shell]).contains("farmap"),
            "{shell}"
        );
    }
    farmap().fails(&["completions", "tcsh"]);
}

#[test]
fn man_pages_cover_every_visible_command() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("man1");
    farmap().ok(&["man", "--dir", out.to_str().unwrap()]);
    let pages: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for page in [
        "farmap.1",
        "farmap-doctor.1",
        "farmap-mount.1",
        "farmap-region-limit.1",
        "farmap-seed.1",
    ] {
        assert!(pages.contains(&page.to_owned()), "no {page} in {pages:?}");
    }
    assert!(
        !pages
            .iter()
            .any(|p| p.contains("__") || p.contains("-help")),
        "hidden commands have no pages: {pages:?}"
    );
    let doctor = std::fs::read_to_string(out.join("farmap-doctor.1")).unwrap();
    assert!(doctor.contains(".TH farmap-doctor 1") && doctor.contains("json"));
    // The page on stdout is farmap.1.
    assert_eq!(
        farmap().ok(&["man"]),
        std::fs::read_to_string(out.join("farmap.1")).unwrap()
    );
    if let Some(man) = farmap_testkit::tools::which("man") {
        let shown = std::process::Command::new(man)
            .arg("-l")
            .arg(out.join("farmap-region-limit.1"))
            .env("MANWIDTH", "100")
            .env("MANPAGER", "cat")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&shown.stdout);
        assert!(
            text.contains("farmap region limit") && text.contains("--app"),
            "{text}"
        );
    }
}
