//! Any bytes: the GGUF reader returns a file or an error, never panics, and what it
//! returns is safe to use (every tensor's data lies inside the input).
#![no_main]

use kiln_io::gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) {
        for t in &file.tensors {
            assert_eq!(file.tensor_data(t).len() as u64, t.size_bytes);
            let _ = t.shape();
        }
        for (_, v) in &file.metadata {
            let _ = v.to_string();
        }
    }
});
