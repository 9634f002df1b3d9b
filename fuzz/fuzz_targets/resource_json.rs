//! Fuzz target: arbitrary bytes as Mesos resource JSON (one resource or a
//! list); the oracle is `csi_isolator_testing::props::check_resource_json`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    csi_isolator_testing::props::check_resource_json(data);
});
