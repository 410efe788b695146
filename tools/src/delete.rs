//! `ctxfs delete`: removes a context by name in one commit. Contexts stored on top of it keep
//! the prefix they share; its other blocks become free once no reader holds them.

use anyhow::Result;
use ctxfs_vfs::{DeviceChoice, Store};
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    store: PathBuf,
    /// The context to delete.
    name: String,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let store = Store::open_path(&args.store, choice)?;
    let before = store.space();
    let mut txn = store.begin()?;
    txn.delete_context(&args.name)?;
    let generation = txn.commit()?;
    let after = store.space();
    if args.json {
        let v = json!({"deleted": args.name, "generation": generation, "used_blocks_before": before.used, "used_blocks_after": after.used});
        outln!("{v}")?;
    } else {
        outln!(
            "deleted {:?} at generation {generation}: {} blocks in use, were {}",
            args.name,
            after.used,
            before.used
        )?;
    }
    Ok(())
}
