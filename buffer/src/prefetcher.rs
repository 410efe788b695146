//! A prefetch thread: reads blocks into the pool while the thread that asked goes on.
//!
//! A decode step searches one q head, then the next; each search's value blocks are needed
//! only when the group's values are summed. Handing them here right after each search puts
//! the reads under the following searches instead of after them. Requests queued while a
//! read is in flight go to the device together, as one submission.

use crate::pool::BufferPool;
use crate::request::BlockRequest;
use crossbeam_channel::{Receiver, Sender};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::thread::JoinHandle;

/// Most requests merged into one submission.
const MERGE: usize = 64;

struct Job {
    reqs: Vec<BlockRequest>,
    done: Sender<usize>,
}

pub struct Prefetcher {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// A prefetch in flight.
#[must_use = "wait for it before using its blocks, to count the reads it made"]
pub struct Prefetched(Receiver<usize>);

impl Prefetched {
    /// Waits until the blocks are read (or found unreadable); returns how many this prefetch
    /// read. Zero if the prefetch thread is gone: the caller's own reads then fetch them.
    pub fn wait(self) -> usize {
        self.0.recv().unwrap_or(0)
    }
}

impl Prefetcher {
    /// Starts the prefetch thread. Where the system will not start one (a process or thread
    /// limit reached), prefetches read nothing and the callers' own reads fetch the blocks.
    pub fn start(pool: Arc<BufferPool>) -> Prefetcher {
        let (jobs, queue) = crossbeam_channel::unbounded::<Job>();
        let thread = std::thread::Builder::new().name("ctxfs-prefetch".into()).spawn(move || {
            while let Ok(first) = queue.recv() {
                let mut batch = vec![first];
                while batch.len() < MERGE {
                    match queue.try_recv() {
                        Ok(job) => batch.push(job),
                        Err(_) => break,
                    }
                }
                // One submission for all of them; each job is told how many of its blocks
                // were read, a block wanted by two jobs counting for the first.
                let all: Vec<BlockRequest> = batch.iter().flat_map(|j| j.reqs.iter().copied()).collect();
                let mut read: BTreeSet<u64> = pool.prefetch(&all).into_iter().collect();
                for job in batch {
                    let mine = job.reqs.iter().filter(|r| read.remove(&r.block)).count();
                    let _ = job.done.send(mine);
                }
            }
        });
        match thread {
            Ok(thread) => Prefetcher { jobs: Some(jobs), thread: Some(thread) },
            Err(_) => Prefetcher { jobs: None, thread: None },
        }
    }

    /// Queues `reqs` to be read into the pool.
    pub fn submit(&self, reqs: Vec<BlockRequest>) -> Prefetched {
        let (done, wait) = crossbeam_channel::bounded(1);
        if let Some(jobs) = &self.jobs {
            // A send fails only if the thread is gone; `wait` then answers zero.
            let _ = jobs.send(Job { reqs, done });
        }
        Prefetched(wait)
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
