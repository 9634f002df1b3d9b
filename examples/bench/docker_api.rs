//! docker-plugin's socket as a client sees it: one HTTP request per connection, and a fan-out of
//! N such calls over a few threads. Shared by `bench` and `engine_bench`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};

/// One request to docker-plugin's socket (one per connection, as it serves them): the HTTP
/// status and the body.
pub fn call(socket: &Path, endpoint: &str, body: &str) -> Result<(u16, String)> {
    let mut stream =
        UnixStream::connect(socket).with_context(|| format!("connect {}", socket.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    write!(
        stream,
        "POST /{endpoint} HTTP/1.1\r\nHost: plugin\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .with_context(|| format!("read the answer to {endpoint}"))?;
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{endpoint}: no status line in {answer:?}"))?;
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

pub fn call_ok(socket: &Path, endpoint: &str, body: &str) -> Result<String> {
    let (status, answer) = call(socket, endpoint, body)?;
    ensure!(status == 200, "{endpoint} {body}: {status} {answer}");
    Ok(answer)
}

/// Runs `each(i)` for `0..count`, `threads` threads at once; the first error stands.
pub fn fan_out(
    count: usize,
    threads: usize,
    each: impl Fn(usize) -> Result<()> + Sync,
) -> Result<()> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        if i >= count {
                            return Ok(());
                        }
                        each(i)?;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("a worker panicked"))
    })
}

/// The engine's mount id of the `i`-th mount (64 hex digits, as Docker's).
pub fn mount_id(i: usize) -> String {
    format!("{i:064x}")
}
