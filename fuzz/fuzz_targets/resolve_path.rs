//! Fuzz target: a disk resource built field by field from the bytes, resolved
//! to its host mount point under a fixed work dir; the oracle is
//! `csi_isolator_testing::props::check_resolve` (it documents the layout).

#![no_main]

use csi_isolator_testing::props::{check_resolve, FUZZ_WORK_DIR};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check_resolve(FUZZ_WORK_DIR, data);
});
