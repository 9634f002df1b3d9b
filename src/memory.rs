//! The process's own memory: how the allocator is set up for a long-running daemon, giving its
//! free pages back, and reading resident sizes from `/proc`.
//!
//! A node agent holding thousands of volumes runs work on many threads (tokio's workers and its
//! blocking pool, up to dozens at a recovery). glibc gives each thread that allocates while
//! another holds an arena an arena of its own, up to eight per core; what a thread frees stays
//! in its arena, between live allocations, where glibc's trimming (the top of a heap only) does
//! not reach. Measured in docs/benchmarks.md ("10,000 volumes"): capping the arenas and trimming
//! after a recovery is what keeps the daemons' resident size in proportion to their live heap.
//! Other allocators (musl) have no arenas to cap: there the calls are no-ops.

/// The arenas a process may use: two are enough for a daemon whose threads mostly wait on I/O,
/// and keep freed memory in few heaps.
pub const MAX_ARENAS: i32 = 2;

/// Allocations of this size or more get a mapping of their own, unmapped when freed. Fixed:
/// glibc's default threshold moves up (to 32 MiB at most) after the first such block is freed,
/// and from then on a daemon's transient buffers (a mount table read at tens of thousands of
/// mounts, a compaction's summary and write-back, a big answer) land in a heap, where their pages
/// stay once freed between live blocks: at 10,000 volumes that was 17 MiB of serve's resident
/// size and 40 MiB of docker-plugin's (docs/benchmarks.md).
pub const MMAP_THRESHOLD: i32 = 128 * 1024;

/// Sets the allocator up for a long-running daemon: arenas capped at [`MAX_ARENAS`], the mmap
/// threshold fixed at [`MMAP_THRESHOLD`]. Call it first thing in `main`, before any thread
/// starts (an arena made before stays). Returns whether the allocator took both.
pub fn set_up_allocator() -> bool {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallopt only changes the allocator's parameters, under its own lock.
        let arenas = unsafe { libc::mallopt(libc::M_ARENA_MAX, MAX_ARENAS) != 0 };
        // SAFETY: as above.
        let threshold = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 0 };
        arenas && threshold
    }
    #[cfg(not(target_env = "gnu"))]
    {
        false
    }
}

/// Returns the allocator's free pages to the kernel (glibc's `malloc_trim`), after a burst of
/// work that freed much (a recovery). Returns whether any memory was released.
pub fn give_back_free_heap() -> bool {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: malloc_trim takes the allocator's own locks and only releases free pages.
        unsafe { libc::malloc_trim(0) != 0 }
    }
    #[cfg(not(target_env = "gnu"))]
    {
        false
    }
}

/// How often a daemon looks whether to give free pages back ([`give_back_while_running`]): a
/// look is one read of `/proc/self/status` and a walk of the allocator's free lists
/// (`mallinfo`); a give-back, only when due, a few ms.
pub const GIVE_BACK_EVERY: std::time::Duration = std::time::Duration::from_secs(2);
/// How much more resident memory, or more free heap, since the last give-back makes the next
/// one worth its cost (a walk of the allocator's free lists under its locks: a few ms at 10,000
/// volumes).
pub const GIVE_BACK_AFTER_KIB: u64 = 4 * 1024;

/// What a look sees: the resident size and the allocator's free heap (freed blocks it keeps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    /// VmRSS, KiB.
    pub resident_kib: u64,
    /// Free bytes in the allocator's heaps (glibc's `mallinfo().fordblks`), KiB.
    pub free_kib: u64,
}

/// What the looks since the last give-back remember: the resident size it left, and the lowest
/// free heap seen since (a block freed after that lowest point was resident when freed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Since {
    resident_kib: u64,
    free_low_kib: u64,
}

impl Since {
    /// Right after a give-back that left `sizes`.
    pub fn given_back(sizes: Sizes) -> Since {
        Since {
            resident_kib: sizes.resident_kib,
            free_low_kib: sizes.free_kib,
        }
    }
}

/// One look's decision (pure): `Ok(())` to give back now; else the memory of the looks so far.
/// Due with no give-back yet, when the resident size grew by `threshold_kib` since the last one,
/// or when the free heap rose by `threshold_kib` over its lowest point since (memory freed since,
/// resident until given back: a burst's buffers, a compaction's summary, a mount table read).
pub fn give_back_due(since: Option<Since>, now: Sizes, threshold_kib: u64) -> Result<(), Since> {
    let Some(since) = since else {
        return Ok(());
    };
    let free_low_kib = since.free_low_kib.min(now.free_kib);
    if now.resident_kib >= since.resident_kib.saturating_add(threshold_kib)
        || now.free_kib >= free_low_kib.saturating_add(threshold_kib)
    {
        return Ok(());
    }
    Err(Since {
        free_low_kib,
        ..since
    })
}

/// The resident size and the free heap now (`None`: not known: no `/proc`, or an allocator
/// other than glibc's).
pub fn sizes() -> Option<Sizes> {
    Some(Sizes {
        resident_kib: resident_kib()?,
        free_kib: free_heap_kib()?,
    })
}

/// The free bytes the allocator keeps in its heaps, KiB (glibc's `mallinfo`: the older call, so
/// that the daemons still load with a C library older than 2.33, where `mallinfo2` came; its
/// counters are `int`s, read as unsigned: right below 4 GiB of free heap).
pub fn free_heap_kib() -> Option<u64> {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallinfo takes the allocator's own locks, walks its free lists and returns a
        // plain struct.
        #[allow(deprecated)]
        let info = unsafe { libc::mallinfo() };
        Some(u64::from(info.fordblks as u32) / 1024)
    }
    #[cfg(not(target_env = "gnu"))]
    {
        None
    }
}

/// One look of [`give_back_while_running`]: gives the free heap back when [`give_back_due`],
/// and answers what the next look compares with (`None`: the sizes are not known).
pub fn give_back_if_due(since: Option<Since>) -> Option<Since> {
    let now = sizes()?;
    match give_back_due(since, now, GIVE_BACK_AFTER_KIB) {
        Ok(()) => {
            give_back_free_heap();
            sizes().map(Since::given_back)
        }
        Err(since) => Some(since),
    }
}

/// For `serve` and `docker-plugin`, for as long as they run: every [`GIVE_BACK_EVERY`], the
/// free heap is given back to the kernel when [`give_back_due`]. What a burst of work frees (the
/// calls of thousands of containers, a journal's compaction, a mount table read) otherwise stays
/// resident between live blocks: at 10,000 volumes, 17 MiB of serve's 82 (docs/benchmarks.md).
/// Each look runs on tokio's blocking pool.
pub async fn give_back_while_running() {
    // Another allocator (musl) has nothing to give back this way: no looks.
    if free_heap_kib().is_none() {
        return;
    }
    let mut since = None;
    loop {
        tokio::time::sleep(GIVE_BACK_EVERY).await;
        since = tokio::task::spawn_blocking(move || give_back_if_due(since))
            .await
            .unwrap_or(since);
    }
}

/// A `VmRSS:`-style field (name with its colon) of `/proc/<pid>/status` (`pid` may be `self`),
/// in KiB; `None` when the process or the field is not there.
pub fn status_kib(pid: &str, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    field_kib(&text, field)
}

/// This process's resident size (VmRSS), KiB.
pub fn resident_kib() -> Option<u64> {
    status_kib("self", "VmRSS:")
}

/// The value of `field` in the text of a `/proc/<pid>/status` file, in KiB.
fn field_kib(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_field_is_read_in_kib_and_only_by_its_whole_name() {
        let text = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nRssAnon:\t 512 kB\n";
        assert_eq!(field_kib(text, "VmRSS:"), Some(1024));
        assert_eq!(field_kib(text, "VmHWM:"), Some(2048));
        assert_eq!(field_kib(text, "Rss:"), None);
        assert_eq!(field_kib("VmRSS:\tlots kB\n", "VmRSS:"), None);
    }

    /// Big transient blocks freed between live small ones go back to the kernel: with the
    /// threshold fixed each has its own mapping. (glibc's moving threshold would have put all
    /// but the first in the heap, pinned there by the small blocks.)
    #[cfg(target_env = "gnu")]
    #[test]
    fn big_blocks_freed_between_live_ones_leave_the_resident_size() {
        assert!(set_up_allocator());
        // What glibc's default does first: one big block mapped and freed, which would raise a
        // moving threshold above the blocks below.
        drop(std::hint::black_box(vec![1u8; 1 << 20]));
        let before = resident_kib().unwrap();
        let mut pinned = Vec::new();
        let mut big = Vec::new();
        for _ in 0..64 {
            big.push(std::hint::black_box(vec![1u8; 512 << 10]));
            pinned.push(std::hint::black_box(Box::new([1u8; 64])));
        }
        let grown = resident_kib().unwrap();
        assert!(grown >= before + 24 * 1024, "{before} -> {grown} KiB");
        drop(big);
        let after = resident_kib().unwrap();
        assert!(
            after < before + 8 * 1024,
            "32 MiB freed, resident {before} -> {grown} -> {after} KiB"
        );
        drop(pinned);
    }

    #[test]
    fn this_process_has_a_resident_size() {
        let kib = resident_kib().expect("/proc/self/status has VmRSS");
        assert!(kib > 0);
        assert_eq!(status_kib("0", "VmRSS:"), None, "no process 0 in /proc");
    }

    #[cfg(target_env = "gnu")]
    #[test]
    fn glibc_takes_the_arena_cap_and_the_threshold() {
        assert!(
            set_up_allocator(),
            "mallopt(M_ARENA_MAX or M_MMAP_THRESHOLD) refused"
        );
    }

    #[test]
    fn free_pages_are_given_back_first_then_after_growth_or_frees() {
        let t = 4096;
        let at = |resident_kib, free_kib| Sizes {
            resident_kib,
            free_kib,
        };
        assert_eq!(give_back_due(None, at(10_000, 500), t), Ok(()));
        let since = Since::given_back(at(10_000, 500));
        // Nothing changed, or not enough.
        let since = give_back_due(Some(since), at(14_095, 4_595), t).unwrap_err();
        // Grew: due.
        assert_eq!(give_back_due(Some(since), at(14_096, 500), t), Ok(()));
        // The free heap dropped to 100 (blocks reused) and rose again by 4 MiB: freed since.
        let since = give_back_due(Some(since), at(10_000, 100), t).unwrap_err();
        assert_eq!(give_back_due(Some(since), at(10_000, 4_196), t), Ok(()));
        let since = give_back_due(Some(since), at(10_000, 4_195), t).unwrap_err();
        // Shrunk (the allocator gave back on its own): not due.
        assert!(give_back_due(Some(since), at(9_000, 0), t).is_err());
        assert_eq!(
            give_back_due(
                Some(Since::given_back(at(u64::MAX, u64::MAX))),
                at(u64::MAX, u64::MAX),
                t
            ),
            Ok(())
        );
    }

    /// A daemon's look after a burst gives the freed pages back, though the resident size did
    /// not grow since the last look (the burst came and went between two looks); a look with
    /// nothing freed since does nothing.
    #[cfg(target_env = "gnu")]
    #[test]
    fn a_look_after_a_burst_gives_the_freed_pages_back() {
        let mut blocks: Vec<Vec<u8>> = (0..4096).map(|_| vec![1u8; 16 * 1024]).collect();
        let pin = vec![1u8; 64];
        // The last look was at the top of the burst.
        let since = give_back_if_due(None).expect("sizes");
        let top = resident_kib().unwrap();
        blocks.drain(..4095);
        let since = give_back_if_due(Some(since)).expect("sizes");
        let after = resident_kib().unwrap();
        assert!(
            after + 32 * 1024 < top,
            "resident {top} -> {after} KiB: the ~64 MiB freed was not given back"
        );
        assert_eq!(give_back_if_due(Some(since)), Some(since));
        drop((blocks, pin));
    }

    #[cfg(target_env = "gnu")]
    #[test]
    fn freed_memory_is_given_back_to_the_kernel() {
        // Many small blocks, freed but for the last (which pins the heap's top, so glibc's own
        // trim at free does not reach what lies below it): only malloc_trim returns those pages.
        let mut blocks: Vec<Vec<u8>> = (0..4096).map(|_| vec![1u8; 16 * 1024]).collect();
        let pin = vec![1u8; 64];
        let before = resident_kib().unwrap();
        blocks.drain(..4095);
        let released = give_back_free_heap();
        let after = resident_kib().unwrap();
        assert!(
            released,
            "malloc_trim released nothing ({before} -> {after} KiB)"
        );
        assert!(
            after + 32 * 1024 < before,
            "resident {before} -> {after} KiB: the ~64 MiB freed was not given back"
        );
        drop((blocks, pin));
    }
}
