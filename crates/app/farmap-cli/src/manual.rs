//! `farmap completions SHELL` and `farmap man`: shell completions and man pages, made from
//! the same clap definitions as `--help`, so they never drift from it.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, ValueEnum};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
    Elvish,
    Powershell,
}

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for. Bash: `farmap completions bash >
    /// /etc/bash_completion.d/farmap` (or `source <(farmap completions bash)`); zsh: into a
    /// directory of $fpath as `_farmap`; fish: `~/.config/fish/completions/farmap.fish`.
    shell: Shell,
}

#[derive(Debug, Args)]
pub struct ManArgs {
    /// Write `farmap.1` and one page per command (`farmap-mount.1`, ...) into this
    /// directory (made if missing) instead of printing `farmap.1` to stdout. Install with
    /// e.g. `farmap man --dir /usr/local/share/man/man1`.
    #[arg(long)]
    dir: Option<PathBuf>,
}

pub fn completions(args: CompletionsArgs, mut cmd: clap::Command) -> anyhow::Result<ExitCode> {
    use clap_complete::Shell as S;
    let shell = match args.shell {
        Shell::Bash => S::Bash,
        Shell::Zsh => S::Zsh,
        Shell::Fish => S::Fish,
        Shell::Elvish => S::Elvish,
        Shell::Powershell => S::PowerShell,
    };
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, "farmap", &mut out);
    print(&out)
}

/// Writes `bytes` to stdout; a reader that stopped early (`| head`) is not an error.
fn print(bytes: &[u8]) -> anyhow::Result<ExitCode> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing to stdout"))
        }
        _ => Ok(ExitCode::SUCCESS),
    }
}

pub fn man(args: ManArgs, cmd: clap::Command) -> anyhow::Result<ExitCode> {
    let Some(dir) = args.dir else {
        let mut out = Vec::new();
        clap_mangen::Man::new(cmd)
            .render(&mut out)
            .context("rendering the man page")?;
        return print(&out);
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let pages = pages(cmd, "farmap");
    for (name, page) in &pages {
        let path = dir.join(format!("{name}.1"));
        let mut out = Vec::new();
        clap_mangen::Man::new(page.clone())
            .render(&mut out)
            .context("rendering a man page")?;
        std::fs::write(&path, out).with_context(|| format!("writing {}", path.display()))?;
    }
    eprintln!(
        "farmap man: wrote {} pages to {}",
        pages.len(),
        dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The page of `cmd` (named `name`) and those of its visible subcommands, recursively
/// (`farmap-region-limit`).
fn pages(cmd: clap::Command, name: &str) -> Vec<(String, clap::Command)> {
    // The page's title and file name (`farmap-region-limit`); usage lines read `farmap
    // region limit`.
    let cmd = cmd
        .display_name(name.to_owned())
        .bin_name(name.replace('-', " "));
    let mut out = Vec::new();
    for sub in cmd.get_subcommands() {
        if sub.is_hide_set() || sub.get_name() == "help" {
            continue;
        }
        out.extend(pages(sub.clone(), &format!("{name}-{}", sub.get_name())));
    }
    out.insert(0, (name.to_owned(), cmd));
    out
}
