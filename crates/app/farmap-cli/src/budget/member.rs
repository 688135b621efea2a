//! `farmap run --budget NAME`'s side: join the budget with the run's agent, take the first
//! share, and stay joined (the connection open) while the run lasts.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use farmap_migrate::agent::BudgetNote;
use tokio::io::{AsyncWriteExt, BufReader};

use super::proto::{self, Answer, Hello};

/// Joins budget `name` with the agent at `agent` for a heap of `region_bytes`; returns the
/// first share. The membership lasts until this process ends (a task keeps the connection,
/// and says so if the budget goes away: the heap then keeps its last bound).
pub async fn join(name: &str, agent: &Path, region_bytes: u64) -> anyhow::Result<BudgetNote> {
    let path = proto::socket_path(name)?;
    let s = tokio::net::UnixStream::connect(&path)
        .await
        .with_context(|| {
            format!(
            "no farmap budget answers on {} (start it first: farmap budget {name} --total SIZE)",
            path.display()
        )
        })?;
    let (rd, mut wr) = s.into_split();
    let hello = Hello::Join {
        agent: std::path::absolute(agent)?,
        region_bytes,
    };
    wr.write_all(&proto::line(&hello)).await?;
    let mut rd = BufReader::new(rd);
    let line = tokio::time::timeout(Duration::from_secs(15), proto::read_line(&mut rd))
        .await
        .context("the budget did not answer the join")??
        .context("the budget closed the connection")?;
    let note = match serde_json::from_str::<Answer>(&line)? {
        Answer::Joined { note } => note,
        Answer::Error { message } => bail!("the budget {name} refused: {message}"),
        other => bail!("the budget answered with an unexpected {other:?}"),
    };
    let name = note.name.clone();
    tokio::spawn(async move {
        let _keep = wr;
        while let Ok(Some(_)) = proto::read_line(&mut rd).await {}
        status!("farmap run: the budget {name} went away; the heap keeps its last bound");
    });
    Ok(note)
}
