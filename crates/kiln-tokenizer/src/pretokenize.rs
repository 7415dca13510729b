//! Pre-tokenisation for byte-level BPE: the regexes llama.cpp picks by
//! `tokenizer.ggml.pre`, applied in turn, each splitting the pieces of the one before.

use fancy_regex::Regex;
use kiln_core::{Error, Result};

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DIGIT: &str = r"\p{N}";

/// The `tokenizer.ggml.pre` name of a tokenizer.json's pre-tokenizer: GPT-2's (the byte
/// level's own regex), or a `Split` by one of the regexes kiln knows before a byte level
/// that splits nothing more, with whether the BPE model must ignore merges for it. `None`
/// for any other.
pub(crate) fn ggml_name(pre: &serde_json::Value, ignore_merges: bool) -> Option<&'static str> {
    let byte_level = |v: &serde_json::Value, regex: bool| {
        v.get("type").and_then(|t| t.as_str()) == Some("ByteLevel")
            && v.get("add_prefix_space").and_then(|b| b.as_bool()) == Some(false)
            && v.get("use_regex").and_then(|b| b.as_bool()).unwrap_or(true) == regex
    };
    if byte_level(pre, true) {
        return (!ignore_merges).then_some("gpt-2");
    }
    let parts = pre
        .get("pretokenizers")
        .and_then(|p| p.as_array())
        .filter(|_| pre.get("type").and_then(|t| t.as_str()) == Some("Sequence"))?;
    let [split, last] = parts.as_slice() else {
        return None;
    };
    let isolated = split.get("type").and_then(|t| t.as_str()) == Some("Split")
        && split.get("behavior").and_then(|b| b.as_str()) == Some("Isolated")
        && split.get("invert").and_then(|b| b.as_bool()) == Some(false);
    if !isolated || !byte_level(last, false) {
        return None;
    }
    match split.get("pattern")?.get("Regex")?.as_str()? {
        LLAMA3 if ignore_merges => Some("llama-bpe"),
        QWEN2 if !ignore_merges => Some("qwen2"),
        _ => None,
    }
}

pub struct PreTokenizer {
    regexes: Vec<Regex>,
    /// llama-3: a word already in the vocabulary is one token, whatever the merges say.
    pub ignore_merges: bool,
}

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` name (absent: GPT-2's).
    pub fn by_name(name: Option<&str>) -> Result<PreTokenizer> {
        let (patterns, ignore_merges): (&[&str], bool) = match name.unwrap_or("gpt-2") {
            "gpt-2" | "default" | "phi-2" | "jina-es" | "jina-de" | "jina-v2-es" | "jina-v2-de"
            | "jina-v2-code" | "roberta-bpe" => (&[GPT2], false),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => (&[LLAMA3], true),
            "qwen2" | "deepseek-r1-qwen" => (&[QWEN2], false),
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone"
            | "minerva-7b" => (&[DIGIT, GPT2], false),
            other => {
                return Err(Error::unsupported(format!(
                    "GGUF tokenizer.ggml.pre '{other}' is not supported"
                )))
            }
        };
        let regexes = patterns
            .iter()
            .map(|p| Regex::new(p).map_err(|e| Error::format(format!("pre-tokenizer regex: {e}"))))
            .collect::<Result<_>>()?;
        Ok(PreTokenizer {
            regexes,
            ignore_merges,
        })
    }

    /// Splits `text` into words; text between matches is kept as words of its own.
    pub fn split<'a>(&self, text: &'a str) -> Result<Vec<&'a str>> {
        let mut words = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(words.len());
            for word in words {
                let mut last = 0;
                for m in re.find_iter(word) {
                    let m = m.map_err(|e| Error::format(format!("pre-tokenizer regex: {e}")))?;
                    if m.start() > last {
                        next.push(&word[last..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(m.as_str());
                    }
                    last = m.end();
                }
                if last < word.len() {
                    next.push(&word[last..]);
                }
            }
            words = next;
        }
        Ok(words)
    }
}

#[cfg(test)]
mod tests {
    use super::PreTokenizer;

    #[test]
    fn gpt2_splits_like_python() {
        let p = PreTokenizer::by_name(Some("gpt-2")).unwrap();
        assert_eq!(
            p.split("Hello  world's 123\n").unwrap(),
            ["Hello", " ", " world", "'s", " 123", "\n"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three() {
        let p = PreTokenizer::by_name(Some("llama-bpe")).unwrap();
        assert_eq!(p.split("12345").unwrap(), ["123", "45"]);
    }

    #[test]
    fn unknown_name_is_an_error() {
        let e = PreTokenizer::by_name(Some("nope")).err().unwrap();
        assert!(e.to_string().contains("'nope'"), "{e}");
    }
}
