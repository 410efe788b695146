//! Progress bars on a terminal; silence otherwise.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// A bar counting bytes.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    styled(len, what, "{msg:>16} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
}

/// A bar counting blocks.
pub fn blocks_bar(len: u64, what: &str) -> ProgressBar {
    styled(len, what, "{msg:>16} [{bar:30}] {pos}/{len} blocks {per_sec} eta {eta}")
}

fn styled(len: u64, what: &str, template: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(ProgressStyle::with_template(template).expect("valid template").progress_chars("=> "));
    pb.set_message(what.to_string());
    pb
}
