//! Training text: a file, or every regular file of a directory (sorted by name; a link to
//! a file already read counts once), tokenized a document at a time, each document
//! starting with BOS where the tokenizer adds one. Held-out text is a file of its own
//! (taken out of the directory when it is in it) or the end of the token stream.

use kiln_core::{Error, Result};
use kiln_io::file::{self, FileKind};
use kiln_tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// All the text one run reads, at most: tokenizing holds tens of bytes per byte.
const MAX_TEXT_BYTES: u64 = 256 << 20;

/// Where held-out text comes from.
#[derive(Clone, Debug)]
pub enum HeldOut {
    File(PathBuf),
    /// This fraction of the tokens, from the end of the stream.
    Fraction(f64),
}

#[derive(Clone)]
pub struct TextData {
    pub train: Vec<u32>,
    pub held_out: Vec<u32>,
    /// The training files, as given, for the log.
    pub files: Vec<String>,
}

impl TextData {
    /// FNV-1a over both streams: a resumed run refuses other data than its own.
    pub fn fingerprint(&self) -> String {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let ids = self.train.iter().chain([&u32::MAX]).chain(&self.held_out);
        for id in ids {
            for b in id.to_le_bytes() {
                h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
            }
        }
        format!("{h:016x}")
    }
}

/// The regular files of `path` (itself, or a directory's entries) sorted by name, each
/// file once: of several names for one file (links), the one that is not a link.
fn text_files(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path.display(), e))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut entries: Vec<(bool, PathBuf)> = Vec::new();
    for e in std::fs::read_dir(path).map_err(|e| Error::io(path.display(), e))? {
        let p = e.map_err(|e| Error::io(path.display(), e))?.path();
        // Subdirectories, FIFOs and devices are passed over.
        if std::fs::metadata(&p).is_ok_and(|m| m.is_file()) {
            let link = std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink());
            entries.push((link, p));
        }
    }
    entries.sort();
    let mut seen = std::collections::HashSet::new();
    let mut files: Vec<PathBuf> = entries
        .into_iter()
        .filter(|(_, p)| std::fs::canonicalize(p).is_ok_and(|real| seen.insert(real)))
        .map(|(_, p)| p)
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::format(format!(
            "{}: the directory holds no regular files to train on",
            path.display()
        )));
    }
    Ok(files)
}

/// The ids of one document: BOS (when the tokenizer adds one), then its text.
fn document(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    if tokenizer.add_bos() {
        ids.extend(tokenizer.bos_id());
    }
    ids.extend(tokenizer.encode(text, false)?);
    Ok(ids)
}

fn read_text(path: &Path, budget: &mut u64) -> Result<String> {
    let bytes = file::read(path, FileKind::TEXT)?;
    *budget = budget.checked_sub(bytes.len() as u64).ok_or_else(|| {
        Error::format(format!(
            "{}: the training text passes {} MiB in all; give less",
            path.display(),
            MAX_TEXT_BYTES >> 20
        ))
    })?;
    // Text has no NUL bytes: a file with one is a binary (a model, an archive) that
    // would be trained on as noise.
    if let Some(at) = bytes.iter().position(|&b| b == 0) {
        return Err(Error::format(format!(
            "{}: not text (a NUL byte at offset {at}); train on text files",
            path.display()
        )));
    }
    if let Err(e) = std::str::from_utf8(&bytes) {
        tracing::warn!(
            "{}: not UTF-8 from byte {} on; such bytes are read as U+FFFD",
            path.display(),
            e.valid_up_to()
        );
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Read and tokenize the training text at `path` and the held-out text.
pub fn load(path: &Path, held_out: &HeldOut, tokenizer: &Tokenizer) -> Result<TextData> {
    let mut files = text_files(path)?;
    let mut budget = MAX_TEXT_BYTES;
    let held_file = match held_out {
        HeldOut::File(f) => {
            let real = std::fs::canonicalize(f).map_err(|e| Error::io(f.display(), e))?;
            files.retain(|p| std::fs::canonicalize(p).map_or(true, |r| r != real));
            Some(document(tokenizer, &read_text(f, &mut budget)?)?)
        }
        HeldOut::Fraction(_) => None,
    };
    if files.is_empty() {
        return Err(Error::format(format!(
            "{}: nothing is left to train on once the held-out file is taken out",
            path.display()
        )));
    }
    let mut train = Vec::new();
    for f in &files {
        train.extend(document(tokenizer, &read_text(f, &mut budget)?)?);
    }
    let held = match (held_file, held_out) {
        (Some(h), _) => h,
        (None, HeldOut::Fraction(frac)) => {
            let n = ((train.len() as f64) * frac).round() as usize;
            train.split_off(train.len() - n.min(train.len()))
        }
        (None, HeldOut::File(_)) => unreachable!("read above"),
    };
    Ok(TextData {
        train,
        held_out: held,
        files: files.iter().map(|p| p.display().to_string()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::TextData;

    /// The value a replay outside kiln computes from its own tokenization
    /// (scripts/train/loss_parity.py checks its token stream against kiln's with it).
    #[test]
    fn the_fingerprint_is_fnv1a_over_little_endian_ids() {
        let d = TextData {
            train: vec![1, 2, 3],
            held_out: vec![4],
            files: Vec::new(),
        };
        assert_eq!(d.fingerprint(), "e445b178a8670195");
    }
}
