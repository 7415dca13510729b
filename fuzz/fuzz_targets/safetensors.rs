//! Any bytes: the safetensors reader returns tensors or an error, never panics.
#![no_main]

use kiln_io::safetensors::SafetensorsModel;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(model) = SafetensorsModel::from_bytes("fuzz.safetensors", data.to_vec()) {
        for t in &model.tensors {
            assert_eq!(model.tensor_data(t).len(), t.size_bytes());
            let _ = t.shape();
        }
    }
});
