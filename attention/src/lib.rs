//! ctxfs-attention: the product users call (AlayaDB Table 2).
//!
//! * [`Db`]: a mounted store; [`Db::import`] streams a context in and indexes it,
//!   [`Db::create_session`] reuses the longest stored prefix of a prompt (a partial one
//!   too), [`Db::store_session`] persists a session's new tokens on top of the prefix it
//!   reused, sharing the prefix's blocks;
//! * [`Session`]: [`Session::update`] appends tokens, [`Session::attention`] answers all q
//!   heads of a layer: the window exactly, the rest through the optimizer's plan
//!   ([`plan`]), merged with the log-sum-exp rule.
//!
//! `docs/architecture.md` in the repository follows one decode query from
//! [`Session::attention`] through the index and the buffer pool to the disk and back.

mod check;
mod db;
pub mod describe;
mod device_codes;
mod error;
pub mod footprint;
mod import;
pub mod kv;
pub mod layout;
pub mod plan;
mod poison;
pub mod queries;
mod session;
pub mod trie;

pub use db::{Db, DbConfig, PqCodes, WarmReport, Window};
pub use device_codes::KeptOnDevice;
pub use error::{Error, Result};
pub use footprint::Footprint;
pub use import::WriteReport;
pub use kv::{KvSource, SafetensorsKv};
pub use plan::{Choice, Plan, Request, Rules};
pub use session::{Attention, AttentionOptions, Device, HeadReport, HeadTiming, Session, WARM_START_TOKENS};
