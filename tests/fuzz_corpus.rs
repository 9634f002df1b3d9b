//! The fuzz corpora, replayed on stable Rust: every file of
//! `fuzz/corpus/<target>/` goes through the oracle its fuzz target calls
//! (`csi_isolator_testing::props`), then a short deterministic mutation
//! run (fixed seed: byte flips, hostile-token inserts, deletes, splices of
//! corpus entries) feeds [`MUTATIONS`] more inputs per target. This is the
//! fuzz pass CI runs; `cargo +nightly fuzz run <target>` (see `fuzz/`)
//! explores further and grows the corpus.
//!
//! A failing input is printed escaped (and as hex), so it can be saved as a
//! file under `fuzz/corpus/<target>/` and replayed with
//! `cargo nextest run --test fuzz_corpus`.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use csi_isolator_testing::props::{
    check_checkpoint_record, check_container_path, check_resolve, check_resource_json,
    FUZZ_WORK_DIR,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Mutated inputs per target.
const MUTATIONS: usize = 20_000;

/// Longest mutated input, in bytes.
const MAX_LEN: usize = 8192;

/// What breaks paths and JSON: separators, dots, escapes, NUL, quotes,
/// structure, odd numbers, bytes that are not UTF-8, the layout separator
/// of `check_resolve`.
const TOKENS: &[&[u8]] = &[
    b"/",
    b"..",
    b".",
    b"../",
    b"//",
    b"\0",
    b"\\u0000",
    b"\n",
    b"\\n",
    b"\\u2028",
    b"\\u001b",
    b"\\040",
    b"%2F",
    b"%2E",
    b"~",
    b" ",
    b"\"",
    b"\\\"",
    b"\\",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"null",
    b"true",
    b"{}",
    b"[]",
    b"-0",
    b"1e400",
    b"-1",
    b"0.1",
    b"18446744073709551616",
    b"1.7976931348623157e308",
    b"4.9e-324",
    b"\"MOUNT\"",
    b"\"PATH\"",
    b"\"BLOCK\"",
    b"\"disk\"",
    b"\"id\"",
    b"\"root\"",
    b"\"role\"",
    b"\"container_path\"",
    b"\xff",
    b"\xfe",
    b"\xc3",
    b"\xe5\x8d\xb7",
];

/// One fuzz target: its corpus dir and its oracle. The oracle returns
/// whether the input got past the input checks (parsed, resolved,
/// accepted), so the test can show that the properties were exercised.
struct Target {
    name: &'static str,
    check: fn(&[u8]) -> bool,
}

fn check_json(input: &[u8]) -> bool {
    check_resource_json(input).resolved > 0
}

fn check_resolve_fixed(input: &[u8]) -> bool {
    check_resolve(FUZZ_WORK_DIR, input).is_some()
}

fn check_container(input: &[u8]) -> bool {
    check_container_path(input).is_some()
}

const RESOURCE_JSON: Target = Target {
    name: "resource_json",
    check: check_json,
};
const RESOLVE_PATH: Target = Target {
    name: "resolve_path",
    check: check_resolve_fixed,
};
const CHECKPOINT_RECORD: Target = Target {
    name: "checkpoint_record",
    check: check_checkpoint_record,
};
const CONTAINER_PATH: Target = Target {
    name: "container_path",
    check: check_container,
};

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

/// Every file of the target's corpus, sorted by name; panics if there is
/// none, so the replay cannot pass on an empty or missing corpus.
fn load_corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|err| panic!("read corpus dir {}: {err}", dir.display()));
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.unwrap_or_else(|err| panic!("list {}: {err}", dir.display()));
        let path = entry.path();
        if path.is_file() {
            let bytes = std::fs::read(&path)
                .unwrap_or_else(|err| panic!("read corpus file {}: {err}", path.display()));
            files.push((entry.file_name().to_string_lossy().into_owned(), bytes));
        }
    }
    files.sort();
    assert!(
        !files.is_empty(),
        "corpus dir {} holds no file: the replay would test nothing",
        dir.display()
    );
    files
}

/// Runs the oracle; on a panic, names the input before passing it on.
fn run_one(target: &Target, what: &str, input: &[u8]) -> bool {
    match catch_unwind(AssertUnwindSafe(|| (target.check)(input))) {
        Ok(passed) => passed,
        Err(panic) => {
            eprintln!(
                "{}: property violated by {what}\n  input (escaped): {}\n  input (hex): {}",
                target.name,
                input.escape_ascii(),
                hex(input)
            );
            resume_unwind(panic)
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn replay(target: &Target) {
    let corpus = load_corpus(target.name);
    let mut passed = 0;
    for (name, bytes) in &corpus {
        if run_one(target, &format!("corpus file {name}"), bytes) {
            passed += 1;
        }
    }
    eprintln!(
        "{}: replayed {} corpus files, {passed} got past the input checks",
        target.name,
        corpus.len()
    );
    assert!(
        passed > 0 && passed < corpus.len(),
        "{}: {passed} of {} corpus files got past the input checks; the corpus must hold \
         both accepted and refused inputs",
        target.name,
        corpus.len()
    );
}

/// One mutated input: a corpus entry with one to four edits. Half the
/// time the entry is a hand-written seed (`seed-*`): those are well-formed,
/// so their mutants get past the parser more often than those of the
/// fuzzer's finds, which sit at the edges of the input checks.
fn mutate(rng: &mut StdRng, corpus: &[(String, Vec<u8>)], seeds: &[usize]) -> Vec<u8> {
    let base = if !seeds.is_empty() && rng.random_bool(0.5) {
        seeds[rng.random_range(0..seeds.len())]
    } else {
        rng.random_range(0..corpus.len())
    };
    let mut data = corpus[base].1.clone();
    for _ in 0..rng.random_range(1..=4) {
        let len = data.len();
        match rng.random_range(0..7) {
            // Flip one bit.
            0 if len > 0 => {
                let i = rng.random_range(0..len);
                data[i] ^= 1 << rng.random_range(0..8);
            }
            // Overwrite one byte with a random one.
            1 if len > 0 => {
                let i = rng.random_range(0..len);
                data[i] = rng.random();
            }
            // Insert a hostile token.
            2 | 3 => {
                let token = TOKENS[rng.random_range(0..TOKENS.len())];
                let at = rng.random_range(0..=len);
                data.splice(at..at, token.iter().copied());
            }
            // Delete a range.
            4 if len > 0 => {
                let start = rng.random_range(0..len);
                let end = rng.random_range(start..=len.min(start + 32));
                data.drain(start..end);
            }
            // Splice in a slice of another corpus entry.
            5 => {
                let other = &corpus[rng.random_range(0..corpus.len())].1;
                if !other.is_empty() {
                    let start = rng.random_range(0..other.len());
                    let end = rng.random_range(start..=other.len());
                    let at = rng.random_range(0..=len);
                    data.splice(at..at, other[start..end].iter().copied());
                }
            }
            // Repeat a range (long ids, deep nesting).
            _ if len > 0 => {
                let start = rng.random_range(0..len);
                let end = rng.random_range(start..=len.min(start + 16));
                let chunk = data[start..end].to_vec();
                for _ in 0..rng.random_range(1..=8) {
                    data.splice(end..end, chunk.iter().copied());
                }
            }
            _ => data.push(rng.random()),
        }
    }
    data.truncate(MAX_LEN);
    data
}

fn mutation_run(target: &Target, seed: u64) {
    let corpus = load_corpus(target.name);
    let seeds: Vec<usize> = (0..corpus.len())
        .filter(|&i| corpus[i].0.starts_with("seed-"))
        .collect();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut passed = 0;
    for case in 0..MUTATIONS {
        let input = mutate(&mut rng, &corpus, &seeds);
        let what = format!("mutated case {case} (seed {seed})");
        if run_one(target, &what, &input) {
            passed += 1;
        }
    }
    eprintln!(
        "{}: ran {MUTATIONS} mutated cases from {} corpus files, {passed} got past the input checks",
        target.name,
        corpus.len()
    );
    assert!(
        passed > 0,
        "{}: no mutated input got past the input checks: the run exercised only refusals",
        target.name
    );
}

#[test]
fn resource_json_corpus_replays() {
    replay(&RESOURCE_JSON);
}

#[test]
fn resource_json_mutations() {
    mutation_run(&RESOURCE_JSON, 0x7e50_0001);
}

#[test]
fn resolve_path_corpus_replays() {
    replay(&RESOLVE_PATH);
}

#[test]
fn resolve_path_mutations() {
    mutation_run(&RESOLVE_PATH, 0x7e50_0002);
}

#[test]
fn container_path_corpus_replays() {
    replay(&CONTAINER_PATH);
}

#[test]
fn container_path_mutations() {
    mutation_run(&CONTAINER_PATH, 0x7e50_0003);
}

#[test]
fn checkpoint_record_corpus_replays() {
    replay(&CHECKPOINT_RECORD);
}

#[test]
fn checkpoint_record_mutations() {
    mutation_run(&CHECKPOINT_RECORD, 0x7e50_0004);
}
