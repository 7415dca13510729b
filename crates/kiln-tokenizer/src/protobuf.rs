//! A minimal, bounds-checked protobuf wire-format reader: enough for SentencePiece's
//! `ModelProto` without a protobuf dependency.

use kiln_core::{Error, Result};

/// One field's value, by wire type.
pub enum Field<'a> {
    Varint(u64),
    /// A 64-bit value; nothing SentencePiece reads uses one.
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32(u32),
}

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn err(&self, what: &str) -> Error {
        Error::format(format!("protobuf: {what} at byte {}", self.pos))
    }

    fn varint(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let &b = self
                .buf
                .get(self.pos)
                .ok_or_else(|| self.err("truncated varint"))?;
            self.pos += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint longer than 10 bytes"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err(&format!("field of {n} bytes runs past the end")))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// The next (field number, value), or `None` at the end of the buffer.
    pub fn next_field(&mut self) -> Result<Option<(u64, Field<'a>)>> {
        if self.pos >= self.buf.len() {
            return Ok(None);
        }
        let key = self.varint()?;
        let (number, wire) = (key >> 3, key & 7);
        if number == 0 {
            return Err(self.err("field number 0"));
        }
        let field = match wire {
            0 => Field::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Field::Fixed64
            }
            2 => {
                let len = usize::try_from(self.varint()?)
                    .map_err(|_| self.err("length does not fit in memory"))?;
                Field::Bytes(self.take(len)?)
            }
            5 => {
                let b = self.take(4)?;
                Field::Fixed32(u32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
            }
            w => return Err(self.err(&format!("unsupported wire type {w}"))),
        };
        Ok(Some((number, field)))
    }
}

#[cfg(test)]
mod tests {
    use super::{Field, Reader};

    #[test]
    fn reads_fields_and_rejects_truncation() {
        // field 1 varint 150; field 2 bytes "hi"; field 3 fixed32 1.0f
        let buf = [
            0x08, 0x96, 0x01, 0x12, 2, b'h', b'i', 0x1d, 0, 0, 0x80, 0x3f,
        ];
        let mut r = Reader::new(&buf);
        assert!(matches!(
            r.next_field().unwrap(),
            Some((1, Field::Varint(150)))
        ));
        assert!(matches!(
            r.next_field().unwrap(),
            Some((2, Field::Bytes(b"hi")))
        ));
        assert!(
            matches!(r.next_field().unwrap(), Some((3, Field::Fixed32(v))) if f32::from_bits(v) == 1.0)
        );
        assert!(r.next_field().unwrap().is_none());
        let mut r = Reader::new(&buf[..5]);
        r.next_field().unwrap();
        assert!(r.next_field().is_err());
    }
}
