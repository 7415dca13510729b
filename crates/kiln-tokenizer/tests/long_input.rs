//! Long, repetitive inputs (runs of spaces, digits, one huge word) encode without
//! errors and round-trip: no quadratic blow-up or regex backtracking limit in the way.

use kiln_io::gguf::GgufFile;
use kiln_tokenizer::Tokenizer;
use std::path::PathBuf;

fn gguf(name: &str) -> Tokenizer {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap()
}

#[test]
fn long_runs_round_trip() {
    let inputs = [
        " ".repeat(50_000),
        "7".repeat(50_000),
        "x".repeat(50_000),
        "\n\t ".repeat(10_000),
        "The quick brown fox, café 🙂 123.\n".repeat(2_000),
    ];
    for name in ["llama.gguf", "bpe.gguf", "llama3.gguf", "qwen2.gguf"] {
        let tok = gguf(name);
        for text in &inputs {
            let ids = tok
                .encode(text, true)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(&tok.decode(&ids).unwrap(), text, "{name}");
        }
    }
}
