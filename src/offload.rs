//! Blocking work off the async workers: [`blocking`], used by the provider and the isolator for
//! every step that fsyncs, calls a mount syscall, reads the mount table or `/proc`, or sleeps
//! between EBUSY retries ([`start_blocking`]: the same, waited for a step later), and
//! [`blocking_each`], the same for one small step on each of many
//! items (a recovery's checks of every volume) in a few trips, and [`scoped_runs`], its
//! synchronous sibling for a command's own threads (`status` checking, reading and parsing
//! thousands of records). Imports nothing from the crate.

/// Runs blocking work (a checkpoint's fsyncs, a mount syscall, a statx, a
/// read of the mount table or of a directory, an EBUSY retry's sleep) on
/// tokio's blocking pool and waits for it, so the async workers (two on a
/// two-core node) go on with other volumes meanwhile. The caller's order of
/// effects is kept: it resumes only once the work is done. A panic in the
/// work is resumed in the caller.
pub(crate) async fn blocking<T, F>(work: F) -> T
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    start_blocking(work).wait().await
}

/// Blocking work started at once on tokio's blocking pool, its result waited for later
/// ([`Started::wait`]): for work a caller needs done only a step later, such as directories
/// made while an intent is written and an RPC is sent. A caller waits for it before it
/// returns, so that no work of its outlives it unseen.
pub(crate) fn start_blocking<T, F>(work: F) -> Started<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    Started(tokio::task::spawn_blocking(work))
}

/// Blocking work under way ([`start_blocking`]).
#[must_use = "wait for the work before returning"]
pub(crate) struct Started<T>(tokio::task::JoinHandle<T>);

impl<T> Started<T> {
    /// Waits for the work's result; a panic in the work is resumed in the caller.
    pub(crate) async fn wait(self) -> T {
        match self.0.await {
            Ok(value) => value,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Only a runtime shutting down cancels a blocking task before it starts.
            Err(e) => panic!("blocking work cancelled: {e}"),
        }
    }
}

/// The fewest items a trip of [`blocking_each`] takes (when there are that many): below it, a
/// thread's wake-up costs more than the work it carries (a statx, a mount_setattr).
const MIN_PER_TRIP: usize = 128;
/// The most trips [`blocking_each`] sends at once: enough to keep a few cores busy, few enough
/// that a recovery of 10,000 volumes does not park dozens of threads on the same locks.
const MAX_TRIPS: usize = 4;

/// How [`blocking_each`] cuts `len` items into trips: consecutive ranges covering `0..len` in
/// order, at most `max_trips` of them, each of at least `min_per_trip` items (all in one when
/// there are fewer), their sizes differing by at most one.
pub(crate) fn trips(
    len: usize,
    min_per_trip: usize,
    max_trips: usize,
) -> Vec<std::ops::Range<usize>> {
    if len == 0 {
        return Vec::new();
    }
    let count = (len / min_per_trip.max(1)).clamp(1, max_trips.max(1));
    let (base, extra) = (len / count, len % count);
    let mut start = 0;
    (0..count)
        .map(|i| {
            let end = start + base + usize::from(i < extra);
            let range = start..end;
            start = end;
            range
        })
        .collect()
}

/// Runs `work` on each item on the blocking pool, a few trips for all of them ([`trips`]) rather
/// than one per item, and answers the results in the items' order. For many small blocking
/// steps at once (recovery's mount checks and hardenings of every volume): one thread wake-up per
/// chunk, not per item. A panic in the work is resumed in the caller.
pub(crate) async fn blocking_each<T, R, F>(items: Vec<T>, work: F) -> Vec<R>
where
    T: Send + 'static,
    R: Send + 'static,
    F: Fn(T) -> R + Send + Sync + 'static,
{
    let work = std::sync::Arc::new(work);
    let mut items = items.into_iter();
    let sent = trips(items.len(), MIN_PER_TRIP, MAX_TRIPS)
        .into_iter()
        .map(|range| {
            let chunk: Vec<T> = items.by_ref().take(range.len()).collect();
            let work = work.clone();
            blocking(move || chunk.into_iter().map(|item| work(item)).collect::<Vec<R>>())
        });
    futures::future::join_all(sent)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The most threads [`scoped_runs`] starts.
const MAX_SCOPED_THREADS: usize = 4;

/// `work` of `items`, a run at a time (to keep something open across a run: a directory the
/// items' paths are relative to), answered in the items' order: on up to
/// [`MAX_SCOPED_THREADS`] scoped threads (no more than the CPUs), each a consecutive run of at
/// least `min_per_thread` items ([`trips`]); on the calling thread alone when there are fewer.
/// For a synchronous caller with thousands of small independent steps (`status`: a statx, a
/// read, a parse each). `work` answers one result per item of its run, or fewer when it sums a
/// run up (in order: the runs' answers are concatenated). A panic in the work is resumed in the
/// caller.
pub(crate) fn scoped_runs<T, R, F>(items: Vec<T>, min_per_thread: usize, work: F) -> Vec<R>
where
    T: Send,
    R: Send,
    F: Fn(Vec<T>) -> Vec<R> + Sync,
{
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runs = trips(items.len(), min_per_thread, MAX_SCOPED_THREADS.min(cpus));
    if runs.len() <= 1 {
        return work(items);
    }
    let mut items = items.into_iter();
    let work = &work;
    std::thread::scope(|scope| {
        let running: Vec<_> = runs
            .into_iter()
            .map(|range| {
                let run: Vec<T> = items.by_ref().take(range.len()).collect();
                scope.spawn(move || work(run))
            })
            .collect();
        running.into_iter().flat_map(joined).collect()
    })
}

/// What a scoped thread answered; its panic resumed in the caller.
pub(crate) fn joined<T>(thread: std::thread::ScopedJoinHandle<'_, T>) -> T {
    thread
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic on one of the scoped threads reaches the caller (after every thread is joined),
    /// with its own message.
    #[test]
    #[should_panic(expected = "item 700 refused")]
    fn a_panic_in_a_scoped_run_is_resumed_in_the_caller() {
        let items: Vec<usize> = (0..1000).collect();
        scoped_runs(items, 8, |run| {
            run.into_iter()
                .inspect(|&i| assert!(i != 700, "item {i} refused"))
                .collect()
        });
    }

    #[test]
    fn scoped_items_are_worked_once_in_order_across_threads() {
        for (len, min) in [(0, 4), (1, 4), (7, 4), (1000, 8), (10_001, 128)] {
            let items: Vec<usize> = (0..len).collect();
            let threads = std::sync::Mutex::new(std::collections::HashSet::new());
            let got = scoped_runs(items, min, |run| {
                threads.lock().unwrap().insert(std::thread::current().id());
                run.into_iter().map(|i| i * 2).collect()
            });
            assert_eq!(got, (0..len).map(|i| i * 2).collect::<Vec<_>>(), "{len}");
            let used = threads.into_inner().unwrap().len();
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            let want = trips(len, min, MAX_SCOPED_THREADS.min(cpus)).len().max(1);
            assert!(
                len == 0 || used == want,
                "{len} items: {used} threads, want {want}"
            );
        }
    }

    #[test]
    fn items_are_cut_into_few_even_trips_in_order() {
        // (items, fewest per trip, most trips, the trips' sizes)
        let cases: [(usize, usize, usize, &[usize]); 9] = [
            (0, 128, 4, &[]),
            (1, 128, 4, &[1]),
            (127, 128, 4, &[127]),
            (255, 128, 4, &[255]),
            (256, 128, 4, &[128, 128]),
            (10_000, 128, 4, &[2500, 2500, 2500, 2500]),
            (10_001, 128, 4, &[2501, 2500, 2500, 2500]),
            (7, 2, 4, &[3, 2, 2]),
            // Degenerate bounds still make one trip at least.
            (5, 0, 0, &[5]),
        ];
        for (len, min, max, sizes) in cases {
            let got = trips(len, min, max);
            let got_sizes: Vec<usize> = got.iter().map(|r| r.len()).collect();
            assert_eq!(got_sizes, sizes, "{len} items, {min} per trip, {max} trips");
            // Consecutive, from 0 to len.
            let mut at = 0;
            for r in &got {
                assert_eq!(r.start, at, "{len} items");
                at = r.end;
            }
            assert_eq!(at, len, "{len} items");
        }
    }

    #[tokio::test]
    async fn each_item_is_worked_once_and_answered_in_order() {
        for len in [0, 1, 300, 1000] {
            let items: Vec<usize> = (0..len).collect();
            let got = blocking_each(items, |i| i * 2).await;
            assert_eq!(
                got,
                (0..len).map(|i| i * 2).collect::<Vec<_>>(),
                "{len} items"
            );
        }
    }

    /// Started work runs without being waited for (the caller goes on meanwhile), and its
    /// result is answered by `wait`.
    #[tokio::test]
    async fn started_work_runs_before_it_is_waited_for() {
        let (tx, rx) = std::sync::mpsc::channel();
        let started = start_blocking(move || {
            tx.send(()).unwrap();
            7
        });
        // Not waited for yet: the work still runs (bounded, never forever).
        let ran = rx.recv_timeout(std::time::Duration::from_secs(10));
        assert!(ran.is_ok(), "the work did not run before it was waited for");
        assert_eq!(started.wait().await, 7);
    }

    #[tokio::test]
    #[should_panic(expected = "directory refused")]
    async fn a_panic_in_started_work_is_resumed_by_wait() {
        let answer: u8 = start_blocking(|| -> u8 { panic!("directory refused") })
            .wait()
            .await;
        unreachable!("answered {answer}");
    }
}
