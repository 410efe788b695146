//! Checking and repairing a store. `check` reads every block the newest valid superblock
//! reaches and verifies it through its reference; it compares what is reachable with what the
//! allocator says. `repair` does only safe things: free leaked blocks, mark referenced blocks
//! allocated, rebuild an unreadable allocator, rewrite a damaged fallback superblock, fall back
//! to the older state when the newest one's catalog is unreadable, free retired contexts that
//! no live context descends from, and (only when asked) drop contexts whose blocks are
//! unreadable, with the contexts that derive from them.

use crate::alloc::Bitmap;
use crate::blockio::{read_chain, read_many, read_raw_many};
use crate::device::{AlignedBuf, BlockDevice, IoOp};
use crate::error::{Error, Result};
use crate::format::header::unseal;
use crate::format::records::{decode_catalog, ContextRecord, ModelShape, ParentLink, StreamRoot};
use crate::format::{BlockKind, Expect, Owner, StreamTag, Superblock, SUPERBLOCK_SLOTS};
use crate::lock::{Access, StoreLock};
use crate::store::{
    load_bitmap, pick, read_slots, record_chain, AllocSource, Readers, SlotStatus, Store, CATALOG_CHAIN,
};
use crate::stream::{StreamId, StreamMap};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// What repair would do about a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fix {
    /// Nothing safe can be done.
    None,
    FreeLeaked,
    MarkAllocated,
    RebuildAllocator,
    RewriteFallbackSuperblock,
    FallBackToOlderState,
    /// A retired context that no live context descends from: free it.
    FreeRetired,
    /// Only with `--drop-damaged`.
    DropContext,
}

impl Fix {
    pub fn name(self) -> &'static str {
        match self {
            Fix::None => "none",
            Fix::FreeLeaked => "free-leaked",
            Fix::MarkAllocated => "mark-allocated",
            Fix::RebuildAllocator => "rebuild-allocator",
            Fix::RewriteFallbackSuperblock => "rewrite-fallback-superblock",
            Fix::FallBackToOlderState => "fall-back-to-older-state",
            Fix::FreeRetired => "free-retired",
            Fix::DropContext => "drop-context (--drop-damaged)",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Problem {
    /// The device block, where the problem is about one.
    pub block: Option<u64>,
    pub kind: String,
    pub owner: String,
    /// The context's name, where the problem belongs to one.
    pub context: Option<String>,
    pub message: String,
    pub fix: Fix,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub active_generation: Option<u64>,
    pub fallback_generation: Option<u64>,
    /// Context records in the catalog, retired ones included.
    pub contexts: usize,
    /// Of those, the retired ones whose records are readable (deleted, kept for the contexts
    /// stored on top of them).
    pub retired_contexts: usize,
    pub blocks_checked: u64,
    pub problems: Vec<Problem>,
    /// What repair did.
    pub repaired: Vec<String>,
}

/// e2fsck's exit codes.
pub const EXIT_CLEAN: i32 = 0;
pub const EXIT_CORRECTED: i32 = 1;
pub const EXIT_UNCORRECTED: i32 = 4;
pub const EXIT_OPERATIONAL: i32 = 8;

impl Report {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
    pub fn exit_code(&self) -> i32 {
        match (self.problems.is_empty(), self.repaired.is_empty()) {
            (true, true) => EXIT_CLEAN,
            (true, false) => EXIT_CORRECTED,
            (false, _) => EXIT_UNCORRECTED,
        }
    }
    /// Every block named by a problem.
    pub fn damaged_blocks(&self) -> BTreeSet<u64> {
        self.problems.iter().filter_map(|p| p.block).collect()
    }
}

/// The result of walking one state from its superblock.
struct Walk<'p> {
    progress: Progress<'p>,
    /// Blocks the walk expects to read (the allocated count), for progress.
    expected: u64,
    problems: Vec<Problem>,
    reach: Bitmap,
    /// How many references find each block that more than one references (rare: only damage
    /// makes them), so repair frees such a block only when every owner referencing it goes.
    claims: BTreeMap<u64, u32>,
    /// A second reference to a block, reported after the walk: not a context's own damage.
    /// Every reference is verified against the block's header, so of two references at most
    /// one holds and the other fails on its own; the context whose reference holds is intact.
    shared: Vec<Problem>,
    /// False when unreadable metadata hides references, so leaks cannot be judged.
    reach_complete: bool,
    /// Metadata of the state itself (catalog) unreadable.
    catalog_damaged: bool,
    /// Contexts with any damage, by id, with their names and the blocks they were seen to use.
    damaged: BTreeMap<u32, (String, Vec<u64>)>,
    /// Ids of contexts whose record itself is unreadable.
    record_damaged: BTreeSet<u32>,
    /// Every context whose record is readable.
    family: Family,
    /// Where the problems of the context being walked begin: every later one is its own.
    context_problems: usize,
    persisted: Option<Bitmap>,
    /// References that found the wrong block: where the block they expected was wanted.
    failed: Vec<(u64, Expect)>,
    contexts: usize,
    blocks_checked: u64,
}

/// Called as fsck reads blocks: (blocks checked so far, blocks expected in all).
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Sync);

/// No progress reporting.
pub fn quiet(_: u64, _: u64) {}

impl Walk<'_> {
    fn checked(&mut self, blocks: u64) {
        self.blocks_checked += blocks;
        (self.progress)(self.blocks_checked, self.expected.max(self.blocks_checked));
    }

    fn problem(&mut self, e: &Error, context: Option<&str>, fix: Fix) {
        let (block, kind, owner, message) = match e {
            Error::Damaged { block, kind, owner, fault, expected } => {
                if let Some(expect) = expected {
                    self.failed.push((*block, **expect));
                }
                (Some(*block), kind.to_string(), owner.clone(), fault.to_string())
            }
            Error::BlockIo { block, source } => {
                (Some(*block), "unknown".into(), "unknown".into(), format!("I/O error: {source}"))
            }
            other => (other.block(), "unknown".into(), "unknown".into(), other.to_string()),
        };
        self.problems.push(Problem { block, kind, owner, context: context.map(str::to_string), message, fix });
    }

    fn note(
        &mut self,
        block: Option<u64>,
        kind: &str,
        owner: String,
        context: Option<&str>,
        message: String,
        fix: Fix,
    ) {
        self.problems.push(noted(block, kind, owner, context, message, fix));
    }

    /// Marks a block reachable; a second claim is a block used twice.
    fn claim(&mut self, block: u64, kind: &str, owner: Owner, context: Option<&str>, seen: &mut Vec<u64>) {
        seen.push(block);
        if block >= self.reach.len() {
            self.note(
                Some(block),
                kind,
                owner.to_string(),
                context,
                "referenced block lies beyond the device".into(),
                Fix::None,
            );
        } else if self.reach.get(block) {
            *self.claims.entry(block).or_insert(1) += 1;
            let message = "block is referenced twice".into();
            self.shared.push(noted(Some(block), kind, owner.to_string(), context, message, Fix::None));
        } else {
            self.reach.set(block, true);
        }
    }
}

/// A problem found by a structure check ([`Walk::note`]).
fn noted(block: Option<u64>, kind: &str, owner: String, context: Option<&str>, message: String, fix: Fix) -> Problem {
    Problem { block, kind: kind.into(), owner, context: context.map(str::to_string), message, fix }
}

fn walk<'p>(dev: &dyn BlockDevice, sb: &Superblock, progress: Progress<'p>) -> Walk<'p> {
    let mut w = Walk {
        progress,
        expected: sb.allocated_blocks,
        problems: Vec::new(),
        reach: Bitmap::new(sb.total_blocks),
        claims: BTreeMap::new(),
        shared: Vec::new(),
        reach_complete: true,
        catalog_damaged: false,
        damaged: BTreeMap::new(),
        record_damaged: BTreeSet::new(),
        family: Family::default(),
        context_problems: 0,
        persisted: None,
        failed: Vec::new(),
        contexts: 0,
        blocks_checked: 2,
    };
    w.reach.set(0, true);
    w.reach.set(1, true);
    let mut sink = Vec::new();
    let g = sb.generation;

    match read_chain(dev, sb.catalog, CATALOG_CHAIN, g) {
        Err(e) => {
            w.problem(&e, None, Fix::FallBackToOlderState);
            w.reach_complete = false;
            w.catalog_damaged = true;
        }
        Ok((blob, blocks)) => {
            w.checked(blocks.len() as u64);
            for b in blocks {
                w.claim(b, "catalog", Owner::SYSTEM, None, &mut sink);
            }
            match decode_catalog(&blob) {
                Err(f) => {
                    w.note(
                        Some(sb.catalog.block),
                        "catalog",
                        "system".into(),
                        None,
                        f.to_string(),
                        Fix::FallBackToOlderState,
                    );
                    w.reach_complete = false;
                    w.catalog_damaged = true;
                }
                Ok(entries) => {
                    w.contexts = entries.len();
                    let mut ids = BTreeSet::new();
                    for entry in entries {
                        let owner = Owner::context(entry.id).to_string();
                        if !ids.insert(entry.id) || entry.id == 0 || entry.id >= sb.next_context_id {
                            w.note(
                                Some(sb.catalog.block),
                                "catalog",
                                owner,
                                Some(&entry.name),
                                format!("context id {} repeats or is out of range", entry.id),
                                Fix::None,
                            );
                            w.catalog_damaged = true;
                            continue;
                        }
                        walk_context(dev, sb, &mut w, entry.id, &entry.name, entry.record);
                    }
                    check_names(sb, &mut w);
                    check_family(&mut w, &ids);
                }
            }
        }
    }

    match load_bitmap(dev, sb) {
        Err(e) => w.problem(&e, None, Fix::RebuildAllocator),
        Ok((bitmap, chunks, dir)) => {
            w.checked((chunks.len() + dir.len()) as u64);
            for c in &chunks {
                w.claim(c.block, "alloc", Owner::SYSTEM, None, &mut sink);
            }
            for b in dir {
                w.claim(b, "alloc", Owner::SYSTEM, None, &mut sink);
            }
            if bitmap.count_ones() != sb.allocated_blocks {
                w.note(
                    Some(sb.slot()),
                    "superblock",
                    "system".into(),
                    None,
                    format!(
                        "superblock counts {} allocated blocks, the bitmap {}",
                        sb.allocated_blocks,
                        bitmap.count_ones()
                    ),
                    Fix::RebuildAllocator,
                );
            }
            w.persisted = Some(bitmap);
        }
    }

    if let (true, Some(persisted)) = (w.reach_complete, w.persisted.clone()) {
        for b in 0..sb.total_blocks {
            match (persisted.get(b), w.reach.get(b)) {
                (true, false) => w.note(
                    Some(b),
                    "leaked",
                    "none".into(),
                    None,
                    "allocated but not referenced (leaked)".into(),
                    Fix::FreeLeaked,
                ),
                (false, true) => w.note(
                    Some(b),
                    "unallocated",
                    "unknown".into(),
                    None,
                    "referenced but marked free".into(),
                    Fix::MarkAllocated,
                ),
                _ => {}
            }
        }
    }
    if !w.reach_complete {
        scan_unreached(dev, sb, &mut w);
    }
    let shared = std::mem::take(&mut w.shared);
    w.problems.extend(shared);
    w
}

/// When unreadable metadata hides part of the tree, the blocks it hides are still checked:
/// each must pass its own checksum, and a block that is exactly what a failed reference
/// expected (its CRC and header match) sits in the wrong place: a misdirected or swapped write.
fn scan_unreached(dev: &dyn BlockDevice, sb: &Superblock, w: &mut Walk) {
    // A block already reported (a damaged record the walk failed on) is not reported again.
    let named: BTreeSet<u64> = w.problems.iter().filter_map(|p| p.block).collect();
    let unreached = |b: &u64| !w.reach.get(*b) && !named.contains(b);
    let candidates: Vec<u64> = match &w.persisted {
        Some(p) => p.iter_ones().filter(unreached).collect(),
        // Without the bitmap free blocks cannot be told apart, so only misplaced blocks count.
        None => (SUPERBLOCK_SLOTS..sb.total_blocks).filter(unreached).collect(),
    };
    let wanted: BTreeMap<u32, (u64, Expect)> = w.failed.iter().map(|&(block, e)| (e.crc, (block, e))).collect();
    for chunk in candidates.chunks(256) {
        w.checked(chunk.len() as u64);
        for (&block, raw) in chunk.iter().zip(read_raw_many(dev, chunk)) {
            let buf = match raw {
                Ok(buf) => buf,
                Err(e) => {
                    w.problem(&e, None, Fix::None);
                    continue;
                }
            };
            let buf = buf.bytes();
            match unseal(buf) {
                Err(fault) if w.persisted.is_some() => w.note(
                    Some(block),
                    "unknown",
                    "unknown".into(),
                    None,
                    format!("allocated block under unreadable metadata fails its own check: {fault}"),
                    Fix::None,
                ),
                // A zeroed block may be free space that was never written.
                Err(fault) if buf.iter().any(|&b| b != 0) => w.note(
                    Some(block),
                    "unknown",
                    "unknown".into(),
                    None,
                    format!(
                        "block fails its own check (the allocator is unreadable, so it may be free space): {fault}"
                    ),
                    Fix::None,
                ),
                Err(_) => {}
                Ok((h, crc)) => match wanted.get(&crc) {
                    Some(&(home, e))
                        if home != block
                            && h.kind == e.kind
                            && h.owner == e.owner
                            && h.logical == e.logical
                            && h.stream == e.stream =>
                    {
                        w.note(
                            Some(block),
                            h.kind.name(),
                            h.owner.to_string(),
                            None,
                            format!(
                                "holds the {} block that belongs at block {home} (misdirected or swapped write)",
                                h.kind.name()
                            ),
                            Fix::None,
                        )
                    }
                    _ if h.kind == BlockKind::Superblock => w.note(
                        Some(block),
                        "superblock",
                        "system".into(),
                        None,
                        "superblock outside the superblock slots".into(),
                        Fix::None,
                    ),
                    _ => {}
                },
            }
        }
    }
}

fn walk_context(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    w: &mut Walk,
    id: u32,
    name: &str,
    record_ref: crate::format::BlockRef,
) {
    let before = w.problems.len();
    w.context_problems = before;
    let mut seen = Vec::new();
    let record = match read_chain(dev, record_ref, record_chain(id), sb.generation) {
        Err(e) => {
            w.problem(&e, Some(name), Fix::DropContext);
            None
        }
        Ok((blob, blocks)) => {
            w.checked(blocks.len() as u64);
            for b in blocks {
                w.claim(b, "catalog", Owner::context(id), Some(name), &mut seen);
            }
            match ContextRecord::decode(&blob) {
                Err(f) => {
                    w.note(
                        Some(record_ref.block),
                        "catalog",
                        Owner::context(id).to_string(),
                        Some(name),
                        f.to_string(),
                        Fix::DropContext,
                    );
                    None
                }
                Ok(r) if r.id != id || r.name != name => {
                    w.note(
                        Some(record_ref.block),
                        "catalog",
                        Owner::context(id).to_string(),
                        Some(name),
                        format!("record says {} {:?}", r.id, r.name),
                        Fix::DropContext,
                    );
                    None
                }
                Ok(r) => Some(r),
            }
        }
    };
    match record {
        None => {
            w.reach_complete = false;
            w.record_damaged.insert(id);
        }
        Some(record) => {
            let node = Node {
                name: name.to_string(),
                parent: record.parent,
                retired: record.retired,
                shape: record.shape,
                tokens: record.token_count(),
                record_block: record_ref.block,
            };
            w.family.insert(id, node);
            let kv = record.shape.kv_heads as usize;
            let mut streams = vec![(StreamId { owner: Owner::context(id), tag: StreamTag::Tokens }, &record.tokens)];
            for (i, f) in record.files.iter().enumerate() {
                let owner = Owner::file(id, (i / kv) as u16, (i % kv) as u16);
                streams.push((StreamId { owner, tag: StreamTag::Index }, &f.index));
                streams.push((StreamId { owner, tag: StreamTag::Data }, &f.data));
            }
            for (sid, root) in streams {
                walk_stream(dev, sb, w, sid, root, name, &mut seen);
            }
        }
    }
    if w.problems.len() > before {
        w.damaged.insert(id, (name.to_string(), seen));
    }
}

fn walk_stream(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    w: &mut Walk,
    id: StreamId,
    root: &StreamRoot,
    name: &str,
    seen: &mut Vec<u64>,
) {
    for r in &root.extents {
        w.claim(r.block, "extent", id.owner, Some(name), seen);
    }
    w.checked(root.extents.len() as u64);
    let map = match StreamMap::load(dev, id, root, sb.generation) {
        Ok(map) => map,
        Err(e) => {
            // Without the extent map, the stream's blocks cannot be found.
            w.problem(&e, Some(name), Fix::DropContext);
            w.reach_complete = false;
            return;
        }
    };
    let kind = id.kind().name();
    for b in map.device_blocks() {
        w.claim(b, kind, id.owner, Some(name), seen);
    }
    const BATCH: u64 = 256;
    let mut bytes = 0u64;
    for start in (0..map.len()).step_by(BATCH as usize) {
        let reqs: Vec<_> = (start..(start + BATCH).min(map.len()))
            .map(|l| {
                let at = map.locate(l).expect("within map");
                (at.block, id.expect(l, at.crc, sb.generation))
            })
            .collect();
        w.checked(reqs.len() as u64);
        for res in read_many(dev, &reqs) {
            match res {
                Ok(b) => bytes += b.payload().len() as u64,
                Err(e) => w.problem(&e, Some(name), Fix::DropContext),
            }
        }
    }
    let complete = w.problems.len() == w.context_problems;
    if complete && bytes != root.bytes {
        w.note(
            root.extents.first().map(|r| r.block),
            "extent",
            id.owner.to_string(),
            Some(name),
            format!("{} stream holds {bytes} bytes, the record says {}", id.tag.name(), root.bytes),
            Fix::DropContext,
        );
    }
    if id.tag == StreamTag::Tokens && !root.bytes.is_multiple_of(4) {
        w.note(
            None,
            "catalog",
            id.owner.to_string(),
            Some(name),
            format!("token stream of {} bytes is not whole u32 ids", root.bytes),
            Fix::DropContext,
        );
    }
}

/// What fsck knows of a context's place among its relatives.
struct Node {
    name: String,
    parent: Option<ParentLink>,
    retired: bool,
    shape: ModelShape,
    /// The whole sequence: the parent's prefix, then the own tokens.
    tokens: u64,
    record_block: u64,
}

/// The contexts whose records are readable, by id.
#[derive(Default)]
struct Family(BTreeMap<u32, Node>);

impl Family {
    fn insert(&mut self, id: u32, node: Node) {
        self.0.insert(id, node);
    }

    /// The ids up the parent links from `id`. Stops at a parent it does not know, and after
    /// as many steps as there are contexts, since damaged links may loop.
    fn ancestors(&self, id: u32) -> impl Iterator<Item = u32> + '_ {
        let up = |id: &u32| self.0.get(id).and_then(|n| n.parent).map(|p| p.id);
        std::iter::successors(up(&id), up).take(self.0.len())
    }

    /// Contexts outside `gone` that descend from one in it.
    fn descendants(&self, gone: &BTreeSet<u32>) -> BTreeSet<u32> {
        let from_gone = |id: &u32| !gone.contains(id) && self.ancestors(*id).any(|a| gone.contains(&a));
        self.0.keys().copied().filter(from_gone).collect()
    }

    /// Retired contexts outside `gone` that no live context outside `gone` descends from.
    fn unneeded(&self, gone: &BTreeSet<u32>) -> Vec<u32> {
        let live = self.0.iter().filter(|(id, n)| !n.retired && !gone.contains(id));
        let needed: BTreeSet<u32> = live.flat_map(|(&id, _)| self.ancestors(id)).collect();
        let unneeded = |(id, n): &(&u32, &Node)| n.retired && !gone.contains(id) && !needed.contains(id);
        self.0.iter().filter(unneeded).map(|(&id, _)| id).collect()
    }
}

/// Live contexts' names are unique. A retired context keeps the name it had, which a live
/// context may have taken since.
fn check_names(sb: &Superblock, w: &mut Walk) {
    let mut names = BTreeSet::new();
    let repeated: Vec<(u32, String)> = w
        .family
        .0
        .iter()
        .filter(|(_, n)| !n.retired && !names.insert(n.name.as_str()))
        .map(|(&id, n)| (id, n.name.clone()))
        .collect();
    for (id, name) in repeated {
        let owner = Owner::context(id).to_string();
        let message = format!("context name {name:?} repeats");
        w.note(Some(sb.catalog.block), "catalog", owner, Some(&name), message, Fix::None);
        w.catalog_damaged = true;
    }
}

/// Each parent link names a context of the catalog with the same shape and at least the
/// prefix's tokens, and links never loop. A retired context is kept only while a live
/// context descends from it; that is judged only when every record could be read.
fn check_family(w: &mut Walk, ids: &BTreeSet<u32>) {
    let mut found = Vec::new();
    for (&id, node) in &w.family.0 {
        let Some(link) = node.parent else {
            continue;
        };
        let what = match w.family.0.get(&link.id) {
            _ if w.family.ancestors(id).any(|a| a == id) => Some("parent links loop back to it".to_string()),
            None if !ids.contains(&link.id) => Some(format!("parent context {} does not exist", link.id)),
            // The parent's record is unreadable, which is reported on its own.
            None => None,
            Some(_) if link.prefix_tokens == 0 => Some("shares a prefix of 0 tokens with its parent".into()),
            Some(p) if link.prefix_tokens > p.tokens => Some(format!(
                "prefix of {} tokens exceeds the {} tokens of parent context {}",
                link.prefix_tokens, p.tokens, link.id
            )),
            Some(p) if p.shape != node.shape => {
                Some(format!("model shape {:?} differs from parent context {}'s {:?}", node.shape, link.id, p.shape))
            }
            Some(_) => None,
        };
        found.extend(what.map(|m| (id, m, Fix::None)));
    }
    if w.record_damaged.is_empty() {
        let leaked = w.family.unneeded(&BTreeSet::new());
        found.extend(
            leaked.into_iter().map(|id| (id, "no live context descends from it (leaked)".into(), Fix::FreeRetired)),
        );
    }
    for (id, message, fix) in found {
        let node = &w.family.0[&id];
        let (block, name) = (node.record_block, node.name.clone());
        let message = format!("{}context {id}: {message}", if node.retired { "retired " } else { "" });
        w.note(Some(block), "catalog", Owner::context(id).to_string(), Some(&name), message, fix);
    }
}

struct Checked<'p> {
    report: Report,
    active: Option<(Superblock, Walk<'p>)>,
    fallback: Option<Superblock>,
}

fn superblock_problem(block: Option<u64>, message: String, fix: Fix) -> Problem {
    Problem { block, kind: "superblock".into(), owner: "system".into(), context: None, message, fix }
}

fn check_inner<'p>(dev: &dyn BlockDevice, progress: Progress<'p>) -> Result<Checked<'p>> {
    check_slots(dev, read_slots(dev)?, progress)
}

fn check_slots<'p>(dev: &dyn BlockDevice, slots: Vec<SlotStatus>, progress: Progress<'p>) -> Result<Checked<'p>> {
    let mut report = Report::default();
    let (active, fallback) = match pick(&slots) {
        Ok(pair) => pair,
        Err(e) => {
            for s in &slots {
                if let Err(msg) = &s.result {
                    report.problems.push(superblock_problem(Some(s.slot), msg.clone(), Fix::None));
                }
            }
            report.problems.push(superblock_problem(None, e.to_string(), Fix::None));
            return Ok(Checked { report, active: None, fallback: None });
        }
    };
    report.active_generation = Some(active.generation);
    report.fallback_generation = fallback.map(|f| f.generation);
    for s in &slots {
        if let Err(msg) = &s.result {
            let raw = crate::blockio::read_raw(dev, s.slot).ok();
            let newer = match raw.and_then(|b| crate::format::header::claimed_generation(&b)) {
                Some(g) if g > active.generation => format!(
                    " (its header claims generation {g}, newer than the {} served: a commit cut short by a crash \
                     while its superblock was written, or damage since; that generation's changes are not served)",
                    active.generation
                ),
                _ => String::new(),
            };
            report.problems.push(superblock_problem(
                Some(s.slot),
                format!("fallback superblock unreadable: {msg}{newer}"),
                Fix::RewriteFallbackSuperblock,
            ));
        }
    }
    let w = walk(dev, &active, progress);
    report.contexts = w.contexts;
    report.retired_contexts = w.family.0.values().filter(|n| n.retired).count();
    report.blocks_checked = w.blocks_checked;
    report.problems.extend(w.problems.iter().cloned());
    Ok(Checked { report, active: Some((active, w)), fallback })
}

/// Checks a store without changing it.
pub fn check(dev: &dyn BlockDevice) -> Result<Report> {
    check_with(dev, &quiet)
}

/// [`check`] beside a writer in another process: the state checked is pinned through `lock`
/// (a reader's lock, docs/format.md "Processes"), so the writer reuses none of its blocks
/// while fsck reads them.
pub fn check_pinned(dev: &dyn BlockDevice, lock: StoreLock, progress: Progress<'_>) -> Result<Report> {
    let readers = Arc::new(Readers::with_lock(Some(lock)));
    let (slots, _pin) = readers.pin_committed(dev)?;
    Ok(check_slots(dev, slots, progress)?.report)
}

/// [`check`], reporting progress as it reads.
pub fn check_with(dev: &dyn BlockDevice, progress: Progress<'_>) -> Result<Report> {
    Ok(check_inner(dev, progress)?.report)
}

/// Repairs what can be repaired safely, then checks again. The returned report lists what
/// was done and what is left.
pub fn repair(dev: Arc<dyn BlockDevice>, drop_damaged: bool) -> Result<Report> {
    repair_with(dev, drop_damaged, &quiet)
}

/// [`repair_with`] under the store's writer lock: a repair that would write is refused while
/// another process reads the store, whose pinned state's blocks a rebuilt allocation would
/// not know.
pub fn repair_locked(
    dev: Arc<dyn BlockDevice>,
    lock: &StoreLock,
    drop_damaged: bool,
    progress: Progress<'_>,
) -> Result<Report> {
    if lock.access() != Access::Write {
        return Err(Error::ReadOnly("a repair"));
    }
    repair_inner(dev, drop_damaged, progress, Some(lock))
}

/// [`repair`], reporting progress of its checks as they read.
pub fn repair_with(dev: Arc<dyn BlockDevice>, drop_damaged: bool, progress: Progress<'_>) -> Result<Report> {
    repair_inner(dev, drop_damaged, progress, None)
}

fn repair_inner(
    dev: Arc<dyn BlockDevice>,
    drop_damaged: bool,
    progress: Progress<'_>,
    lock: Option<&StoreLock>,
) -> Result<Report> {
    let first = check_inner(dev.as_ref(), progress)?;
    if first.report.is_clean() {
        return Ok(first.report);
    }
    let Some((active, walk)) = first.active else {
        return Ok(first.report);
    };
    // Checked where a write would come: a store with nothing to repair is checked beside readers.
    let refuse_readers = || lock.map_or(Ok(()), |l| crate::txn::refuse_readers(l, "repairing"));
    let mut repaired = Vec::new();

    // The newest state's catalog is unreadable but the older one is intact: make the older
    // one newest again, writing over the damaged slot so the intact one is never at risk. A
    // damaged context record leaves the rest served (`Store::open`); it is dropped only with
    // `drop_damaged`, as its problem says, not by giving up the newest commit.
    if walk.catalog_damaged {
        let mut report = first.report;
        if let Some(older) = first.fallback {
            let older_walk = self::walk(dev.as_ref(), &older, progress);
            // The older state will do if what is wrong with it is damage to contexts, which
            // the store serves around (and `drop_damaged` drops), or space to free.
            let tolerable = |p: &Problem| matches!(p.fix, Fix::DropContext | Fix::FreeRetired | Fix::FreeLeaked);
            if let Some(bad) = older_walk.problems.iter().find(|p| !tolerable(p)) {
                report.problems.push(superblock_problem(
                    Some(older.slot()),
                    format!(
                        "cannot fall back to generation {}: its own state is damaged too ({}{})",
                        older.generation,
                        bad.block.map(|b| format!("block {b}: ")).unwrap_or_default(),
                        bad.message
                    ),
                    Fix::None,
                ));
            } else {
                refuse_readers()?;
                let revived = Superblock { generation: active.generation + 2, ..older };
                debug_assert_eq!(revived.slot(), active.slot());
                let mut buf = AlignedBuf::zeroed(dev.block_size());
                revived.encode_into(&mut buf);
                dev.submit(&mut [IoOp::Write { block: revived.slot(), buf: &buf }])
                    .pop()
                    .expect("one result")
                    .map_err(|source| Error::BlockIo { block: revived.slot(), source })?;
                dev.flush()?;
                repaired.push(format!(
                    "fell back to generation {} (as generation {}): generation {} had unreadable metadata, and what \
                     it committed is undone (a context it imported or stored is gone, one it deleted is back)",
                    older.generation, revived.generation, active.generation
                ));
                // What the revived state still has wrong (a damaged context, space to free)
                // is repaired there; its catalog is readable, so this does not come back here.
                let mut after = repair_inner(dev, drop_damaged, progress, lock)?;
                after.repaired.splice(0..0, repaired);
                return Ok(after);
            }
        }
        report.repaired = repaired;
        return Ok(report);
    }

    let dropping: BTreeSet<u32> = if drop_damaged { walk.damaged.keys().copied().collect() } else { BTreeSet::new() };
    let can_rebuild = walk.reach_complete || walk.record_damaged.iter().all(|id| dropping.contains(id));
    if !can_rebuild {
        let mut report = first.report;
        // Say why the fixes the problems name were not made.
        let mut waiting: Vec<&str> = report
            .problems
            .iter()
            .filter(|p| !matches!(p.fix, Fix::None | Fix::DropContext))
            .map(|p| p.fix.name())
            .collect();
        waiting.sort_unstable();
        waiting.dedup();
        if !waiting.is_empty() {
            let ids: Vec<String> = walk.record_damaged.iter().map(u32::to_string).collect();
            report.problems.push(superblock_problem(
                None,
                format!(
                    "not repaired ({}): the blocks of damaged context(s) {} are unknown, so the allocation cannot \
                     be judged around them; --drop-damaged drops them first",
                    waiting.join(", "),
                    ids.join(", ")
                ),
                Fix::None,
            ));
        }
        return Ok(report);
    }
    // A context's tokens begin with its parent's, so a dropped context takes its descendants
    // along; then retired contexts that nothing left descends from go too.
    let orphaned = walk.family.descendants(&dropping);
    let mut gone: BTreeSet<u32> = dropping.union(&orphaned).copied().collect();
    let unneeded = walk.family.unneeded(&gone);
    gone.extend(&unneeded);
    // Nothing to drop or free and nothing to rebuild: no commit (it would overwrite the
    // fallback state for nothing).
    let rebuilds =
        first.report.problems.iter().any(|p| !matches!(p.fix, Fix::None | Fix::DropContext | Fix::FreeRetired));
    if gone.is_empty() && !rebuilds {
        return Ok(first.report);
    }
    refuse_readers()?;
    // Damaged contexts are left out of the catalog and their blocks out of the allocation;
    // intact ones are freed through their extent maps, which can be read. A block that damage
    // made two owners reference stays allocated while any owner that keeps it remains (the
    // catalog, the allocator, a live context): freeing it would free what they still use.
    let mut wanted = walk.reach.clone();
    let mut skip = BTreeSet::new();
    let mut dropped_claims: BTreeMap<u64, u32> = BTreeMap::new();
    for (&id, (_, seen)) in walk.damaged.iter().filter(|(id, _)| gone.contains(id)) {
        skip.insert(id);
        for &b in seen.iter().filter(|&&b| b < wanted.len()) {
            *dropped_claims.entry(b).or_default() += 1;
        }
    }
    for (b, dropped) in dropped_claims {
        if dropped >= walk.claims.get(&b).copied().unwrap_or(1) {
            wanted.set(b, false);
        }
    }
    let store = Store::open_with(dev.clone(), AllocSource::Rebuilt(walk.reach.clone()), &skip, Readers::default())?;
    let mut txn = store.begin()?;
    txn.set_allocation(&wanted);
    for &id in gone.difference(&skip) {
        txn.discard_context(id)?;
    }
    txn.commit()?;
    let label = |id: &u32| match (walk.family.0.get(id), walk.damaged.get(id)) {
        (Some(n), _) if n.retired => format!("retired context {id} (once {:?})", n.name),
        (Some(Node { name, .. }), _) | (None, Some((name, _))) => format!("context {name:?}"),
        (None, None) => format!("context {id}"),
    };
    repaired.extend(dropping.iter().map(|id| format!("dropped damaged {}", label(id))));
    repaired.extend(orphaned.iter().map(|id| format!("dropped {}: it derives from a dropped context", label(id))));
    repaired.extend(unneeded.iter().map(|id| format!("freed {}: no live context descends from it", label(id))));
    let fixes: BTreeSet<&str> = first
        .report
        .problems
        .iter()
        .filter(|p| !matches!(p.fix, Fix::None | Fix::DropContext | Fix::FreeRetired))
        .map(|p| p.fix.name())
        .collect();
    for f in fixes {
        repaired.push(format!("applied {f}"));
    }
    drop(store);
    let mut after = check_with(dev.as_ref(), progress)?;
    after.repaired = repaired;
    Ok(after)
}

/// Reads a block's raw bytes for inspection (no verification).
pub use crate::blockio::read_raw as raw_block;
