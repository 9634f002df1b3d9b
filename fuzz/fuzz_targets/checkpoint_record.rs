//! Fuzz target: the bytes as a container checkpoint (`state.json`), or, when they are not one, as
//! its paths field by field; checked by `isolator::checkpoint_paths::check_record`. The oracle is
//! `csi_isolator_testing::props::check_checkpoint_record`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    csi_isolator_testing::props::check_checkpoint_record(data);
});
