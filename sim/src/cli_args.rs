//! What the `multi_tenant` and `stress` command lines share: byte sizes in
//! binary units and the arena's host backends.

use clap::ValueEnum;
use vmm_arena::Backend;

/// Parses `123`, `64MiB`, `40GiB`, `1.5G`, `512k` (binary units: `k`, `m`,
/// `g`, `t`, each also as `KiB` or `KB`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        "t" | "tib" | "tb" => 1 << 40,
        _ => return Err(format!("bad size {s:?}")),
    };
    let v: f64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    Ok((v * mult as f64) as u64)
}

/// The arena's backends a run can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    Host,
    HostSparse,
}

impl From<BackendArg> for Backend {
    fn from(b: BackendArg) -> Backend {
        match b {
            BackendArg::Host => Backend::Host,
            BackendArg::HostSparse => Backend::HostSparse,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_binary_units() {
        assert_eq!(parse_bytes("123").unwrap(), 123);
        assert_eq!(parse_bytes("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("512kb").unwrap(), 512 << 10);
        assert_eq!(parse_bytes(" 2 TiB ").unwrap(), 2 << 40);
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("MiB").is_err());
    }
}
