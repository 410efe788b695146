//! Work split across threads, where a thread the system will not start (a process or
//! thread limit reached) is no failure: the caller does that share itself.

use std::thread::{Builder, ScopedJoinHandle};

/// Runs `f` over `0..n` split across `threads`, collecting results in order.
pub(crate) fn parallel<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let chunk = n.div_ceil(threads.max(1)).max(1);
    let f = &f;
    let run = move |start: usize| (start..(start + chunk).min(n)).map(f).collect::<Vec<T>>();
    std::thread::scope(|s| {
        let parts: Vec<Result<ScopedJoinHandle<'_, Vec<T>>, usize>> = (0..n)
            .step_by(chunk)
            .map(|start| Builder::new().spawn_scoped(s, move || run(start)).map_err(|_| start))
            .collect();
        parts
            .into_iter()
            .flat_map(|part| match part {
                Ok(thread) => thread.join().expect("worker thread panicked"),
                Err(start) => run(start),
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::parallel;

    #[test]
    fn results_come_in_order_whatever_the_split() {
        for (n, threads) in [(0, 3), (1, 4), (10, 1), (10, 3), (10, 20), (1000, 7)] {
            assert_eq!(
                parallel(n, threads, |i| i * i),
                (0..n).map(|i| i * i).collect::<Vec<_>>(),
                "{n} over {threads}"
            );
        }
    }
}
