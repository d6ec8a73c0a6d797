//! A reader of fuzz input bytes: every read succeeds (zeroes once the input
//! is used up), so any byte string decodes to some operation sequence, and
//! a short input is a short sequence.

#![allow(dead_code)] // each target uses what it needs
pub struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Bytes<'a> {
    pub fn new(data: &'a [u8]) -> Bytes<'a> {
        Bytes { data, at: 0 }
    }

    /// Whether every byte was read.
    pub fn is_empty(&self) -> bool {
        self.at >= self.data.len()
    }

    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    pub fn u64(&mut self) -> u64 {
        (self.u32() as u64) | ((self.u32() as u64) << 32)
    }

    /// A value in `0..n` (`n` > 0), from as few bytes as `n` needs.
    pub fn below(&mut self, n: u64) -> u64 {
        match n {
            0 | 1 => 0,
            2..=0x100 => self.u8() as u64 % n,
            0x101..=0x1_0000 => self.u16() as u64 % n,
            0x1_0001..=0x1_0000_0000 => self.u32() as u64 % n,
            _ => self.u64() % n,
        }
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
}
