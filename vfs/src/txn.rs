//! The write transaction. All writes go to blocks that neither the committed state, nor the
//! fallback state, nor any live snapshot references (copy-on-write). Commit writes the new
//! blocks, flushes, writes the superblock, and flushes: the commit happens atomically at the
//! superblock write. Dropping a transaction without committing discards it.

use crate::alloc::{Allocator, Bitmap};
use crate::blockio::{chain_blocks, read_verified, write_chain, WriteQueue};
use crate::device::{self, AlignedBuf, BlockDevice, IoOp};
use crate::error::{BlockFault, Error, Result};
use crate::format::records::{
    bits_per_chunk, encode_alloc_dir, encode_catalog, CatalogEntry, ContextRecord, FileRoots, ModelShape, ParentLink,
    MAX_NAME_LEN,
};
use crate::format::{BlockHeader, BlockKind, BlockRef, Owner, StreamTag, Superblock, FORMAT_VERSION, HEADER_LEN};
use crate::lock::{Access, StoreLock};
use crate::store::{
    chunk_expect, record_chain, ContextMeta, FileStream, LazyStream, Readers, Snapshot, Store, WriterState,
    ALLOC_CHAIN, CATALOG_CHAIN,
};
use crate::stream::{check_payload, StreamDraft, StreamId, StreamMap};
use std::collections::BTreeMap;
use std::sync::{Arc, MutexGuard};

enum Slot {
    Clean(Arc<ContextMeta>),
    Draft(Box<ContextDraft>),
}

impl Slot {
    /// The record. A draft brings its stream roots up to date only at commit.
    fn record(&self) -> &ContextRecord {
        match self {
            Slot::Clean(meta) => &meta.record,
            Slot::Draft(d) => &d.record,
        }
    }

    fn token_count(&self) -> u64 {
        match self {
            Slot::Clean(meta) => meta.record.token_count(),
            Slot::Draft(d) => {
                let own = d.tokens.bytes / 4 + d.token_tail.len() as u64;
                d.record.parent.map_or(0, |p| p.prefix_tokens).saturating_add(own)
            }
        }
    }
}

struct ContextDraft {
    record: ContextRecord,
    /// The committed version this draft replaces, if any.
    old: Option<Arc<ContextMeta>>,
    tokens: StreamDraft,
    /// Tokens not yet written: the partial last block, written at commit.
    token_tail: Vec<u32>,
    files: Vec<[StreamDraft; 2]>,
}

impl ContextDraft {
    fn streams_mut(&mut self) -> impl Iterator<Item = &mut StreamDraft> {
        std::iter::once(&mut self.tokens).chain(self.files.iter_mut().flatten())
    }

    /// Frees every block the draft holds: written, reserved, and its committed record.
    fn free(mut self, alloc: &mut Allocator) {
        for s in self.streams_mut() {
            s.unreserve(alloc);
            let root = s.root();
            StreamDraft::free_all(&s.map, &root, alloc);
        }
        if let Some(old) = &self.old {
            for &b in &old.record_blocks {
                alloc.free(b);
            }
        }
    }
}

/// Every block a committed context holds. Reading all of them before freeing any means a
/// read error changes nothing.
fn committed_blocks(meta: &ContextMeta, dev: &dyn BlockDevice, generation: u64) -> Result<Vec<u64>> {
    let mut blocks = meta.record_blocks.clone();
    for s in meta.streams() {
        blocks.extend(s.map(dev, generation)?.device_blocks());
        blocks.extend(s.root.extents.iter().map(|r| r.block));
    }
    Ok(blocks)
}

pub struct Txn<'s> {
    store: &'s Store,
    w: MutexGuard<'s, WriterState>,
    base: Arc<Snapshot>,
    generation: u64,
    contexts: BTreeMap<String, Slot>,
    /// Contexts deleted by name but kept for their descendants, by id.
    retired: BTreeMap<u32, Slot>,
    next_context_id: u32,
    queue: WriteQueue,
    /// Set when a write failed: the transaction can only be dropped.
    failed: Option<String>,
    done: bool,
}

fn tokens_per_block(block_size: usize) -> usize {
    (block_size - HEADER_LEN) / 4
}

fn validate_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(Error::InvalidArgument(format!(
            "context name must be 1..={MAX_NAME_LEN} bytes, got {}",
            name.len()
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::InvalidArgument(format!("context name {name:?} contains control characters")));
    }
    Ok(())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl<'s> Txn<'s> {
    pub(crate) fn begin(store: &'s Store) -> Result<Txn<'s>> {
        if store.readers.read_only() {
            return Err(Error::ReadOnly("a transaction"));
        }
        let here = std::thread::current().id();
        if *store.lock_writer_thread() == Some(here) {
            return Err(Error::InvalidArgument(
                "this thread's transaction is still open: a write cannot start inside another (from its progress \
                 callback, say)"
                    .into(),
            ));
        }
        let mut w = store.lock_writer();
        if let Some(why) = &w.poisoned {
            return Err(Error::Poisoned(why.clone()));
        }
        let base = store.snapshot();
        if base.generation() >= crate::lock::MAX_GENERATION {
            return Err(Error::InvalidArgument(format!(
                "generation {} is the last a store reaches ({}): no commit can follow it; the superblock is likely \
                 damaged (ctxfs fsck)",
                base.generation(),
                crate::lock::MAX_GENERATION
            )));
        }
        w.alloc.release(base.generation(), store.readers.oldest());
        store.publish_space(&w.alloc);
        *store.lock_writer_thread() = Some(here);
        let contexts = base.contexts.iter().map(|(k, v)| (k.clone(), Slot::Clean(v.clone()))).collect();
        let retired = base.retired.iter().map(|(&id, v)| (id, Slot::Clean(v.clone()))).collect();
        Ok(Txn {
            generation: base.generation() + 1,
            next_context_id: base.superblock.next_context_id,
            queue: WriteQueue::new(store.dev.clone()),
            store,
            w,
            base,
            contexts,
            retired,
            failed: None,
            done: false,
        })
    }

    /// The generation this transaction will commit as.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    fn dev(&self) -> &'s dyn BlockDevice {
        self.store.dev.as_ref()
    }

    fn check(&self) -> Result<()> {
        match &self.failed {
            Some(why) => Err(Error::Poisoned(format!("an earlier write of this transaction failed: {why}"))),
            None => Ok(()),
        }
    }

    /// Records a failure: after a failed write the transaction cannot commit.
    fn guard<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if matches!(e, Error::BlockIo { .. } | Error::Io(_)) {
                self.failed = Some(e.to_string());
            }
        }
        r
    }

    pub fn create_context(&mut self, name: &str, shape: ModelShape, tokens: &[u32]) -> Result<()> {
        self.create(name, shape, None, tokens)
    }

    /// Creates a context whose token sequence is the first `prefix_tokens` tokens of the
    /// committed context `parent`, then `tokens`. It shares the parent's blocks for that
    /// prefix instead of copying them: its own streams hold only what follows the prefix.
    pub fn create_child_context(&mut self, name: &str, parent: &str, prefix_tokens: u64, tokens: &[u32]) -> Result<()> {
        self.check()?;
        let slot = self.contexts.get(parent).ok_or_else(|| Error::NoSuchContext(parent.to_string()))?;
        let record = slot.record();
        // The parent's id must be in the committed state the new record will point into.
        if self.base.contexts.get(parent).is_none_or(|m| m.record.id != record.id) {
            return Err(Error::InvalidArgument(format!(
                "context {parent:?} was created in this transaction; commit it before deriving children from it"
            )));
        }
        let available = slot.token_count();
        if prefix_tokens == 0 || prefix_tokens > available {
            return Err(Error::InvalidArgument(format!(
                "a child of {parent:?} shares 1..={available} of its tokens, not {prefix_tokens}"
            )));
        }
        let (shape, id) = (record.shape, record.id);
        self.create(name, shape, Some(ParentLink { id, prefix_tokens }), tokens)
    }

    fn create(&mut self, name: &str, shape: ModelShape, parent: Option<ParentLink>, tokens: &[u32]) -> Result<()> {
        self.check()?;
        validate_name(name)?;
        shape.validate().map_err(Error::InvalidArgument)?;
        if self.contexts.contains_key(name) {
            return Err(Error::ContextExists(name.to_string()));
        }
        if let Some(d) = self.base.damaged_named(name) {
            return Err(d.error());
        }
        let id = self.next_context_id;
        self.next_context_id =
            id.checked_add(1).ok_or_else(|| Error::InvalidArgument("context ids exhausted".into()))?;
        let kv = shape.kv_heads as usize;
        let files = (0..shape.files())
            .map(|i| {
                let owner = Owner::file(id, (i / kv) as u16, (i % kv) as u16);
                [
                    StreamDraft::new(StreamId { owner, tag: StreamTag::Index }),
                    StreamDraft::new(StreamId { owner, tag: StreamTag::Data }),
                ]
            })
            .collect();
        let draft = ContextDraft {
            record: ContextRecord {
                id,
                name: name.to_string(),
                shape,
                created_unix_ms: now_ms(),
                parent,
                retired: false,
                tokens: Default::default(),
                files: Vec::new(),
            },
            old: None,
            tokens: StreamDraft::new(StreamId { owner: Owner::context(id), tag: StreamTag::Tokens }),
            token_tail: Vec::new(),
            files,
        };
        self.contexts.insert(name.to_string(), Slot::Draft(Box::new(draft)));
        self.append_tokens(name, tokens)
    }

    pub fn append_tokens(&mut self, name: &str, tokens: &[u32]) -> Result<()> {
        self.check()?;
        let per_block = tokens_per_block(self.dev().block_size());
        let dev = self.dev();
        let generation = self.generation;
        let base_generation = self.base.generation();
        let r = (|| {
            let d = draft_in(&mut self.contexts, dev, base_generation, name)?;
            let alloc = &mut self.w.alloc;
            let queue = &mut self.queue;
            // A partial last block on disk is read back and rewritten with the new tokens. The
            // record's byte count fits its blocks (checked when the catalog was read), so the
            // last block exists and should hold the count's remainder.
            let tail_bytes = d.tokens.bytes % (per_block as u64 * 4);
            if d.token_tail.is_empty() && tail_bytes != 0 {
                let last = d.tokens.map.len() - 1;
                let at = d.tokens.map.locate(last).expect("last block exists");
                let b = read_verified(dev, at.block, &d.tokens.id.expect(last, at.crc, base_generation))?;
                if b.payload().len() as u64 != tail_bytes {
                    let what = format!("holds {} bytes of tokens; its record says {tail_bytes}", b.payload().len());
                    return Err(Error::damaged(
                        at.block,
                        "tokens",
                        d.tokens.id.owner.to_string(),
                        BlockFault::Malformed(what),
                    ));
                }
                d.token_tail =
                    b.payload().chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
                d.tokens.pop(alloc, b.payload().len() as u64);
            }
            d.token_tail.extend_from_slice(tokens);
            while d.token_tail.len() >= per_block {
                let block: Vec<u8> = d.token_tail.drain(..per_block).flat_map(u32::to_le_bytes).collect();
                d.tokens.push(alloc, queue, dev, generation, &block)?;
            }
            Ok(())
        })();
        self.guard(r)
    }

    /// Appends one block to the index or data stream of vector file (layer, kv head).
    /// Returns the block's logical index in that stream.
    pub fn append_block(
        &mut self,
        name: &str,
        layer: u16,
        head: u16,
        which: FileStream,
        payload: &[u8],
    ) -> Result<u64> {
        self.in_file(name, layer, head, |streams, alloc, queue, dev, generation| {
            streams[which as usize].push(alloc, queue, dev, generation, payload)
        })
    }

    /// Appends one block to each of the index and data streams of vector file (layer, kv
    /// head), on adjacent device blocks where the allocator has two free side by side (the
    /// index block first), so that one read of two blocks returns both. Returns the blocks'
    /// logical indexes in their streams. A store without two adjacent free blocks gets the
    /// pair apart: the same contents, read as two.
    pub fn append_block_pair(
        &mut self,
        name: &str,
        layer: u16,
        head: u16,
        index_payload: &[u8],
        data_payload: &[u8],
    ) -> Result<(u64, u64)> {
        self.in_file(name, layer, head, |[index, data], alloc, queue, dev, generation| {
            check_payload(dev, index_payload)?;
            check_payload(dev, data_payload)?;
            let hint = index.map.next_block().max(data.map.next_block());
            let (first, got) = alloc.alloc_run(hint, 2).ok_or_else(|| alloc.full(2))?;
            let second = if got == 2 { first + 1 } else { alloc.alloc(first + 1).ok_or_else(|| alloc.full(1))? };
            let i = index.push_to(first, queue, dev, generation, index_payload)?;
            let d = data.push_to(second, queue, dev, generation, data_payload)?;
            Ok((i, d))
        })
    }

    /// Gives back the blocks the streams of vector file (layer, kv head) reserved and did not
    /// write. A writer done with a file calls it, so that an import of many files holds one
    /// file's spare reservation at a time, not every file's until its commit (up to 255
    /// blocks a stream: on a nearly full store those were the blocks the next file lacked).
    /// Appending to the file after it only reserves anew.
    pub fn finish_file(&mut self, name: &str, layer: u16, head: u16) -> Result<()> {
        self.in_file(name, layer, head, |streams, alloc, _, _, _| {
            streams.iter_mut().for_each(|s| s.unreserve(alloc));
            Ok(())
        })
    }

    /// Runs `f` on the index and data streams of vector file (layer, kv head) of context
    /// `name`, with the transaction's allocator, write queue, device and generation.
    fn in_file<R>(
        &mut self,
        name: &str,
        layer: u16,
        head: u16,
        f: impl FnOnce(&mut [StreamDraft; 2], &mut Allocator, &mut WriteQueue, &dyn BlockDevice, u64) -> Result<R>,
    ) -> Result<R> {
        self.check()?;
        let dev = self.dev();
        let generation = self.generation;
        let base_generation = self.base.generation();
        let r = (|| {
            let d = draft_in(&mut self.contexts, dev, base_generation, name)?;
            let file = file_of(d.record.shape, name, layer, head)?;
            f(&mut d.files[file], &mut self.w.alloc, &mut self.queue, dev, generation)
        })();
        self.guard(r)
    }

    /// Deletes a context. Its blocks are freed by this commit and reused only after the next.
    /// A context that others derive from is retired instead: its name goes (and may be
    /// reused), its blocks stay until the last context that reads them is deleted.
    pub fn delete_context(&mut self, name: &str) -> Result<()> {
        self.check()?;
        let (id, parent) = match self.contexts.get(name) {
            None => return Err(self.base.missing(name)),
            Some(slot) => (slot.record().id, slot.record().parent),
        };
        // A damaged record may name this context as its parent if its id is the higher (a
        // parent is always older): then a deleted context is retired, its blocks kept, and
        // fsck frees what nothing needs once the damaged one is dropped.
        if self.has_children(id, &[]) || self.base.damaged.keys().any(|&damaged| damaged > id) {
            let d = draft_in(&mut self.contexts, self.store.dev.as_ref(), self.base.generation(), name)?;
            d.record.retired = true;
            let slot = self.contexts.remove(name).expect("drafted above");
            self.retired.insert(id, slot);
            return Ok(());
        }
        // Retired ancestors that only this context still needed go with it.
        let mut doomed = vec![id];
        let mut up = parent;
        while let Some(link) = up {
            match self.retired.get(&link.id) {
                Some(p) if !self.has_children(link.id, &doomed) => {
                    doomed.push(link.id);
                    up = p.record().parent;
                }
                _ => break,
            }
        }
        let (dev, generation) = (self.dev(), self.base.generation());
        let mut blocks = Vec::new();
        for (i, id) in doomed.iter().enumerate() {
            let slot = if i == 0 { &self.contexts[name] } else { &self.retired[id] };
            if let Slot::Clean(meta) = slot {
                blocks.extend(committed_blocks(meta, dev, generation)?);
            }
        }
        let mut slots = vec![self.contexts.remove(name).expect("looked up above")];
        slots.extend(doomed[1..].iter().map(|id| self.retired.remove(id).expect("looked up above")));
        let alloc = &mut self.w.alloc;
        for slot in slots {
            if let Slot::Draft(d) = slot {
                d.free(alloc);
            }
        }
        for b in blocks {
            alloc.free(b);
        }
        Ok(())
    }

    /// Whether a context other than those in `except` names `id` as its parent.
    fn has_children(&self, id: u32, except: &[u32]) -> bool {
        self.contexts
            .values()
            .chain(self.retired.values())
            .map(Slot::record)
            .any(|r| r.parent.is_some_and(|p| p.id == id) && !except.contains(&r.id))
    }

    /// Takes a committed context out of the catalog and frees its blocks (fsck repair, for
    /// contexts that are intact but no longer wanted).
    pub(crate) fn discard_context(&mut self, id: u32) -> Result<()> {
        let found = self.retired.get(&id).or_else(|| self.contexts.values().find(|s| s.record().id == id));
        let Some(Slot::Clean(meta)) = found else {
            return Err(Error::InvalidArgument(format!("no unchanged context with id {id} to discard")));
        };
        let blocks = committed_blocks(meta, self.store.dev.as_ref(), self.base.generation())?;
        self.contexts.retain(|_, s| s.record().id != id);
        self.retired.remove(&id);
        for b in blocks {
            self.w.alloc.free(b);
        }
        Ok(())
    }

    /// Replaces the allocation of the state being built (fsck repair). Blocks dropped from it
    /// are quarantined like any other freed block.
    pub(crate) fn set_allocation(&mut self, wanted: &Bitmap) {
        let alloc = &mut self.w.alloc;
        for b in 0..wanted.len() {
            match (alloc.is_allocated(b), wanted.get(b)) {
                (true, false) => alloc.free(b),
                (false, true) => {
                    let got = alloc.alloc(b);
                    debug_assert_eq!(got, Some(b));
                }
                _ => {}
            }
        }
    }

    /// Makes every change of this transaction durable and visible, atomically.
    pub fn commit(mut self) -> Result<u64> {
        self.check()?;
        let r = self.write_commit();
        let r = self.guard(r);
        self.done = r.is_ok();
        r
    }

    fn write_commit(&mut self) -> Result<u64> {
        let dev = self.dev();
        let generation = self.generation;
        let bs = dev.block_size();
        let mut queue = std::mem::replace(&mut self.queue, WriteQueue::new(self.store.dev.clone()));
        let alloc = &mut self.w.alloc;

        // 1. Remaining tokens, extent blocks and records of every changed context.
        let mut metas = BTreeMap::new();
        for (name, slot) in std::mem::take(&mut self.contexts) {
            metas.insert(name, write_slot(slot, alloc, &mut queue, dev, generation)?);
        }
        let mut retired = BTreeMap::new();
        for (id, slot) in std::mem::take(&mut self.retired) {
            retired.insert(id, write_slot(slot, alloc, &mut queue, dev, generation)?);
        }

        // 2. The catalog, sorted by name; a retired context keeps its name, which may repeat.
        // Damaged entries go forward as they are: their blocks stay allocated until fsck.
        let mut entries: Vec<CatalogEntry> = metas
            .values()
            .chain(retired.values())
            .map(|m| CatalogEntry { id: m.record.id, name: m.record.name.clone(), record: m.record_ref })
            .chain(self.base.damaged.values().map(|d| d.entry.clone()))
            .collect();
        entries.sort_by(|a, b| (&a.name, a.id).cmp(&(&b.name, b.id)));
        let blob = encode_catalog(&entries);
        for &b in self.base.catalog_blocks() {
            alloc.free(b);
        }
        let catalog_blocks = alloc_blocks(alloc, chain_blocks(bs, blob.len()))?;
        let catalog = write_chain(&mut queue, CATALOG_CHAIN, generation, &blob, &catalog_blocks)?;

        // 3. The allocator: new copies of changed bitmap chunks and a new directory. Taking
        // blocks for them changes the bitmap too, so repeat until every change has a block.
        let total = alloc.total();
        let bpc = bits_per_chunk(bs);
        let chunks = total.div_ceil(bpc) as usize;
        // Cloned, not taken: a commit that fails must leave them describing the committed state.
        let old_chunks = self.w.chunk_refs.clone();
        let old_dir_blocks = self.w.alloc_dir_blocks.clone();
        let alloc = &mut self.w.alloc;
        for b in old_dir_blocks {
            alloc.free(b);
        }
        let dir_len = encode_alloc_dir(total, &vec![BlockRef::default(); chunks]).len();
        let dir_blocks = alloc_blocks(alloc, chain_blocks(bs, dir_len))?;
        let mut new_chunk: BTreeMap<u64, u64> = BTreeMap::new();
        loop {
            let pending: Vec<u64> = if old_chunks.len() != chunks {
                (0..chunks as u64).filter(|c| !new_chunk.contains_key(c)).collect()
            } else {
                alloc.dirty_chunks().iter().copied().filter(|c| !new_chunk.contains_key(c)).collect()
            };
            if pending.is_empty() {
                break;
            }
            for c in pending {
                if let Some(old) = old_chunks.get(c as usize) {
                    alloc.free(old.block);
                }
                new_chunk.insert(c, alloc_blocks(alloc, 1)?[0]);
            }
        }
        let mut chunk_refs = old_chunks.clone();
        chunk_refs.resize(chunks, BlockRef::default());
        for (&c, &block) in &new_chunk {
            let start = c * bpc;
            let bits = alloc.next().to_bytes(start, bpc.min(total - start));
            let header = BlockHeader {
                kind: BlockKind::Alloc,
                stream: StreamTag::Meta,
                owner: Owner::SYSTEM,
                payload_len: bits.len() as u32,
                logical: c,
                generation,
            };
            chunk_refs[c as usize] = BlockRef { block, crc: queue.push(block, &header, &bits)? };
        }
        debug_assert!(chunk_refs
            .iter()
            .enumerate()
            .all(|(c, r)| chunk_expect(c as u64, r.crc, generation).kind == BlockKind::Alloc && r.block >= 2));
        let alloc_root =
            write_chain(&mut queue, ALLOC_CHAIN, generation, &encode_alloc_dir(total, &chunk_refs), &dir_blocks)?;

        // A block the committed state references but its bitmap calls free was freed above:
        // committing would persist the disagreement, and the block could be handed out twice.
        if let Some(block) = alloc.stray_free() {
            return Err(Error::damaged(
                block,
                "alloc",
                "system",
                BlockFault::Malformed(
                    "referenced by the committed state, but free in the allocator bitmap (or beyond the store's \
                     blocks, or referenced twice)"
                        .into(),
                ),
            ));
        }

        // 4. Everything new is written and durable before the superblock points at it.
        queue.finish()?;
        dev.flush()?;

        // 5. The commit point.
        let allocated = alloc.next().count_ones();
        let sb = Superblock {
            format_version: FORMAT_VERSION,
            generation,
            catalog,
            alloc: alloc_root,
            allocated_blocks: allocated,
            next_context_id: self.next_context_id,
            commit_unix_ms: now_ms(),
            ..self.base.superblock
        };
        let mut buf = AlignedBuf::zeroed(bs);
        sb.encode_into(&mut buf);
        let written = dev.submit(&mut [IoOp::Write { block: sb.slot(), buf: &buf }]).pop().expect("one result");
        let durable = written.and_then(|()| dev.flush());
        if let Err(e) = durable {
            // The superblock may or may not have reached the medium: only reopening can tell.
            let why = format!("superblock write or flush of generation {generation} failed: {e}");
            self.w.poisoned = Some(why.clone());
            return Err(Error::Poisoned(why));
        }

        // 6. Publish.
        let oldest = self.store.readers.oldest();
        self.w.alloc.commit(generation, oldest.map(|g| g.min(self.base.generation())));
        self.store.publish_space(&self.w.alloc);
        self.w.chunk_refs = chunk_refs;
        self.w.alloc_dir_blocks = dir_blocks;
        self.store.publish(Snapshot {
            dev: self.store.dev.clone(),
            superblock: sb,
            contexts: metas,
            retired,
            damaged: self.base.damaged.clone(),
            catalog_blocks,
            _ticket: Some(self.store.readers.ticket(generation)),
        });
        self.queue = queue;
        Ok(generation)
    }
}

/// Writes what a context's draft holds back (token tail, extent blocks, record) and gives
/// the context as the new state holds it.
fn write_slot(
    slot: Slot,
    alloc: &mut Allocator,
    queue: &mut WriteQueue,
    dev: &dyn BlockDevice,
    generation: u64,
) -> Result<Arc<ContextMeta>> {
    let mut d = match slot {
        Slot::Clean(meta) => return Ok(meta),
        Slot::Draft(d) => d,
    };
    let bs = dev.block_size();
    debug_assert!(d.token_tail.len() < tokens_per_block(bs));
    if !d.token_tail.is_empty() {
        let block: Vec<u8> = d.token_tail.drain(..).flat_map(u32::to_le_bytes).collect();
        d.tokens.push(alloc, queue, dev, generation, &block)?;
    }
    for s in d.streams_mut() {
        s.unreserve(alloc);
        s.write_extents(alloc, queue, dev, generation)?;
    }
    d.record.tokens = d.tokens.root();
    d.record.files = d.files.iter().map(|[i, dd]| FileRoots { index: i.root(), data: dd.root() }).collect();
    if let Some(old) = &d.old {
        for &b in &old.record_blocks {
            alloc.free(b);
        }
    }
    let blob = d.record.encode();
    let blocks = alloc_blocks(alloc, chain_blocks(bs, blob.len()))?;
    let record_ref = write_chain(queue, record_chain(d.record.id), generation, &blob, &blocks)?;
    let ContextDraft { record, tokens, files, .. } = *d;
    let mut meta = ContextMeta::from_record(record, record_ref, blocks);
    // The new snapshot starts with the maps already in memory.
    meta.tokens = LazyStream::with_map(tokens.id, tokens.root(), tokens.map);
    meta.files = files
        .into_iter()
        .map(|[i, dd]| [LazyStream::with_map(i.id, i.root(), i.map), LazyStream::with_map(dd.id, dd.root(), dd.map)])
        .collect();
    Ok(Arc::new(meta))
}

/// Turns a committed context into a draft that can be appended to.
fn draft_in<'a>(
    contexts: &'a mut BTreeMap<String, Slot>,
    dev: &dyn BlockDevice,
    generation: u64,
    name: &str,
) -> Result<&'a mut ContextDraft> {
    let slot = contexts.get_mut(name).ok_or_else(|| Error::NoSuchContext(name.to_string()))?;
    if let Slot::Clean(meta) = slot {
        let draft_of = |s: &LazyStream| -> Result<StreamDraft> {
            Ok(StreamDraft::from_committed(s.id, StreamMap::clone(&*s.map(dev, generation)?), &s.root))
        };
        let tokens = draft_of(&meta.tokens)?;
        let files = meta.files.iter().map(|[i, d]| Ok([draft_of(i)?, draft_of(d)?])).collect::<Result<Vec<_>>>()?;
        *slot = Slot::Draft(Box::new(ContextDraft {
            record: meta.record.clone(),
            old: Some(meta.clone()),
            tokens,
            token_tail: Vec::new(),
            files,
        }));
    }
    match slot {
        Slot::Draft(d) => Ok(d),
        Slot::Clean(_) => unreachable!("converted above"),
    }
}

/// The position of vector file (layer, kv head) in a context's files.
fn file_of(shape: ModelShape, name: &str, layer: u16, head: u16) -> Result<usize> {
    if layer >= shape.layers || head >= shape.kv_heads {
        return Err(Error::InvalidArgument(format!(
            "context {name:?} has {} layers and {} kv heads; no layer {layer} head {head}",
            shape.layers, shape.kv_heads
        )));
    }
    Ok(layer as usize * shape.kv_heads as usize + head as usize)
}

fn alloc_blocks(alloc: &mut Allocator, n: usize) -> Result<Vec<u64>> {
    let mut out = Vec::with_capacity(n);
    let mut hint = 2;
    for _ in 0..n {
        let b = alloc.alloc(hint).ok_or_else(|| alloc.full((n - out.len()) as u64))?;
        hint = b + 1;
        out.push(b);
    }
    Ok(out)
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        // A batch still in flight is written before `w` (a field) unlocks the writer: the
        // next transaction may be handed this one's blocks.
        let _ = self.queue.settle();
        if !self.done {
            self.w.alloc.abort();
        }
        // Before `w` (a field) unlocks the writer: the next holder sets its own thread.
        *self.store.lock_writer_thread() = None;
    }
}

/// Smallest store, in blocks: two superblocks plus room for the catalog and allocator of
/// both states and some data.
pub const MIN_STORE_BLOCKS: u64 = 64;

/// Writes an empty store onto a device: generation 1, then an empty commit (generation 2), so
/// that both superblock slots hold a valid state.
pub fn format(dev: Arc<dyn BlockDevice>) -> Result<Store> {
    format_with(dev, None)
}

/// [`format()`] under the writer lock of the device's path: refused while another process
/// reads the old store (its pins would guard blocks that formatting overwrites).
pub fn format_locked(dev: Arc<dyn BlockDevice>, lock: StoreLock) -> Result<Store> {
    if lock.access() != Access::Write {
        return Err(Error::ReadOnly("formatting"));
    }
    refuse_readers(&lock, "formatting")?;
    format_with(dev, Some(lock))
}

/// Fails while another process reads the store `lock` locks: formatting, resizing or
/// repairing (`doing`) would take blocks its pins guard.
pub(crate) fn refuse_readers(lock: &StoreLock, doing: &str) -> Result<()> {
    match lock.oldest_pinned_elsewhere()? {
        Some(generation) => Err(Error::InvalidArgument(format!(
            "another process is reading the store there (it holds generation {generation}); close it before {doing}"
        ))),
        None => Ok(()),
    }
}

fn format_with(dev: Arc<dyn BlockDevice>, lock: Option<StoreLock>) -> Result<Store> {
    let bs = dev.block_size();
    device::check_block_size(bs).map_err(Error::InvalidArgument)?;
    let total = dev.num_blocks();
    if total < MIN_STORE_BLOCKS {
        return Err(Error::InvalidArgument(format!(
            "device holds {total} blocks of {bs} bytes; a store needs at least {MIN_STORE_BLOCKS}"
        )));
    }
    // Old superblocks must not outlive a half-finished mkfs.
    let zero = AlignedBuf::zeroed(2 * bs);
    dev.submit(&mut [IoOp::Write { block: 0, buf: &zero }])
        .pop()
        .expect("one result")
        .map_err(|source| Error::BlockIo { block: 0, source })?;
    dev.flush()?;
    let mut bitmap = Bitmap::new(total);
    bitmap.set(0, true);
    bitmap.set(1, true);
    let mut store_id = [0u8; 16];
    getrandom(&mut store_id);
    let sb = Superblock {
        format_version: FORMAT_VERSION,
        block_size: bs as u32,
        total_blocks: total,
        generation: 0,
        store_id,
        catalog: BlockRef::default(),
        alloc: BlockRef::default(),
        allocated_blocks: 2,
        next_context_id: 1,
        commit_unix_ms: now_ms(),
    };
    let readers = Arc::new(Readers::with_lock(lock));
    let snapshot = Snapshot {
        dev: dev.clone(),
        superblock: sb,
        contexts: BTreeMap::new(),
        retired: BTreeMap::new(),
        damaged: Default::default(),
        catalog_blocks: Vec::new(),
        _ticket: None,
    };
    let writer = WriterState {
        alloc: Allocator::new(bitmap, bits_per_chunk(bs)),
        chunk_refs: Vec::new(),
        alloc_dir_blocks: Vec::new(),
        poisoned: None,
    };
    let store = Store::assemble(dev, snapshot, writer, readers, Vec::new());
    store.begin()?.commit()?;
    store.begin()?.commit()?;
    Ok(store)
}

/// A random store id from the kernel; a clock-derived id if that fails.
fn getrandom(out: &mut [u8; 16]) {
    use std::io::Read;
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(out)).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        *out = (t ^ std::process::id() as u128).to_le_bytes();
    }
}
