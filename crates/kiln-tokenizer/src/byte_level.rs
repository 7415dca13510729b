//! GPT-2's byte-level alphabet: every byte maps to a printable character, so that BPE
//! vocabularies are strings while covering arbitrary bytes.

use std::collections::HashMap;
use std::sync::OnceLock;

struct Tables {
    to_char: [char; 256],
    to_byte: HashMap<char, u8>,
}

fn tables() -> &'static Tables {
    static T: OnceLock<Tables> = OnceLock::new();
    T.get_or_init(|| {
        // Printable Latin-1 bytes stand for themselves; the rest are shifted to U+0100 on,
        // in byte order (GPT-2's `bytes_to_unicode`).
        let mut to_char = ['\0'; 256];
        let mut next = 256u32;
        for b in 0..=255u8 {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            to_char[b as usize] = if printable {
                b as char
            } else {
                let c = char::from_u32(next).unwrap_or('\0');
                next += 1;
                c
            };
        }
        let to_byte = to_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        Tables { to_char, to_byte }
    })
}

/// Bytes → the GPT-2 alphabet string.
pub fn encode(bytes: &[u8]) -> String {
    let t = tables();
    bytes.iter().map(|&b| t.to_char[b as usize]).collect()
}

/// GPT-2 alphabet string → bytes; characters outside the alphabet pass through as UTF-8.
pub fn decode_into(text: &str, out: &mut Vec<u8>) {
    let t = tables();
    for c in text.chars() {
        match t.to_byte.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trips_every_byte() {
        let all: Vec<u8> = (0..=255).collect();
        let s = super::encode(&all);
        assert_eq!(s.chars().count(), 256);
        assert_eq!(super::encode(b" "), "\u{120}");
        let mut back = Vec::new();
        super::decode_into(&s, &mut back);
        assert_eq!(back, all);
    }
}
