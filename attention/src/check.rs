//! What fsck's block walk cannot judge: whether each vector file's index agrees with its
//! context's record. A block whose checksum holds may still describe another shape (a
//! writer's bug, or a block written for another file); sessions refuse such a file when they
//! open it, and `ctxfs fsck` reports it beforehand, naming the block.

use crate::footprint::IndexParts;
use crate::Db;
use ctxfs_index::paged::{Layout, PagedIndex};
use ctxfs_vfs::format::Owner;
use ctxfs_vfs::fsck::{Fix, Problem, Report};
use ctxfs_vfs::ModelShape;

/// What is wrong when an index's layout does not describe the file its record says: `tokens`
/// of the record's head dimension and element type. Sessions and fsck ask the same.
pub(crate) fn layout_disagrees(l: &Layout, tokens: u64, shape: &ModelShape) -> Option<String> {
    (u64::from(l.tokens) != tokens || l.dim != u32::from(shape.head_dim) || l.dtype != shape.dtype).then(|| {
        format!(
            "the index says {} tokens of dimension {} in {}, the record {tokens} of {} in {}",
            l.tokens,
            l.dim,
            l.dtype.name(),
            shape.head_dim,
            shape.dtype.name()
        )
    })
}

impl Db {
    /// Reads every vector file's index meta blocks (the graph layout and the coarse runs' meta
    /// blocks: one to four blocks a file) and adds a problem to `report` for each file whose
    /// index cannot serve its context: unreadable, or of another token count, head dimension
    /// or element type than the record says. Repair does not fix these; dropping the context
    /// does. A file whose blocks the block walk already found bad is left out: the walk named
    /// the block, and reading the file would only fail on it again.
    pub fn check_indexes(&self, report: &mut Report) {
        let snap = self.inner.store.snapshot();
        let pool = &self.inner.pool;
        // The files with a block the walk found damaged (what dropping the context repairs), not
        // those a leaked block merely names.
        let walked: std::collections::HashSet<String> =
            report.problems.iter().filter(|p| p.fix == Fix::DropContext).map(|p| p.owner.clone()).collect();
        let names = snap.contexts().map(|r| (r, Some(r.name.clone())));
        for (rec, name) in names.chain(snap.retired_contexts().map(|r| (r, None))) {
            let shape = rec.shape;
            for layer in 0..shape.layers {
                for head in 0..shape.kv_heads {
                    let owner = Owner::file(rec.id, layer, head).to_string();
                    if walked.contains(&owner) {
                        continue;
                    }
                    let mut problem = |block: Option<u64>, message: String| {
                        report.problems.push(Problem {
                            block,
                            kind: "index".into(),
                            owner: owner.clone(),
                            context: name.clone(),
                            message,
                            fix: Fix::None,
                        })
                    };
                    let file = match self.inner.file(&snap, rec.id, layer, head) {
                        Ok(file) => file,
                        Err(e) => {
                            problem(None, e.to_string());
                            continue;
                        }
                    };
                    let meta = file.index().first().map(|b| b.block);
                    let layout = PagedIndex::open(pool, file.index(), &file.index_hints).map(|i| *i.layout());
                    match layout {
                        Err(e) => problem(meta, e),
                        Ok(l) => {
                            // The coarse runs' meta blocks; their errors name the block.
                            if let Err(e) = IndexParts::read(pool, &file, "index") {
                                problem(meta, e.to_string());
                            }
                            if let Some(why) = layout_disagrees(&l, rec.own_token_count(), &shape) {
                                problem(meta, why);
                            }
                        }
                    }
                }
            }
        }
    }
}
