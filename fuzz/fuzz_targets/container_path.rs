//! Fuzz target: the bytes as a `disk.volume.container_path`, checked
//! lexically by `isolator::targets::target_of`; the oracle is
//! `csi_isolator_testing::props::check_container_path`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    csi_isolator_testing::props::check_container_path(data);
});
