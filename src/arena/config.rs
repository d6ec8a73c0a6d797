//! Checks of an [`ArenaConfig`] that need no backend.
//!
//! [`Arena::new`](super::Arena::new) runs them before it loads the backend,
//! so that an invalid configuration is `InvalidArgument` on every machine,
//! not `Unsupported` where the backend (libcuda) is missing. Every backend's
//! granularity is a multiple of 4096 and the default chunk is at least
//! [`DEFAULT_CHUNK_BYTES`], so nothing rejected here would be accepted by a
//! backend; the backend-specific checks stay in `Arena::with_driver`.

use super::{ArenaConfig, DEFAULT_CHUNK_BYTES};
use crate::error::{Error, Result};

/// The smallest granularity of any backend (4 KiB host pages; CUDA's is
/// 2 MiB, arm64 hosts may have 64 KiB pages).
const MIN_GRANULARITY: u64 = 4096;

/// Rejects what no backend could accept.
pub(crate) fn check(config: &ArenaConfig) -> Result<()> {
    let c = config.chunk_bytes;
    if c != 0 && c % MIN_GRANULARITY != 0 {
        return Err(Error::invalid(format!(
            "chunk_bytes {c} is not a multiple of {MIN_GRANULARITY}, the smallest page size of any backend"
        )));
    }
    // The chunk will be at least this large (0: 2 MiB or more).
    let chunk_at_least = if c == 0 { DEFAULT_CHUNK_BYTES } else { c };
    if config.capacity_bytes != 0 && config.capacity_bytes < chunk_at_least {
        return Err(Error::invalid(format!(
            "capacity_bytes {} is below one chunk of at least {chunk_at_least} bytes",
            config.capacity_bytes
        )));
    }
    if config.reserve_bytes.checked_add(chunk_at_least - 1).is_none() {
        return Err(Error::invalid("reserve_bytes overflows when rounded up to the chunk size"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut ArenaConfig)) -> Result<()> {
        let mut c = ArenaConfig::default();
        f(&mut c);
        check(&c)
    }

    #[test]
    fn rejects_only_what_no_backend_accepts() {
        assert!(with(|_| {}).is_ok());
        assert!(with(|c| c.chunk_bytes = 4096).is_ok());
        assert!(with(|c| (c.chunk_bytes, c.capacity_bytes) = (64 << 10, 64 << 10)).is_ok());
        assert!(with(|c| c.reserve_bytes = u64::MAX - (2 << 20)).is_ok());
        for bad in [1, 4097, (3 << 20) + 5] {
            assert!(matches!(with(|c| c.chunk_bytes = bad), Err(Error::InvalidArgument(_))), "{bad}");
        }
        assert!(matches!(with(|c| c.capacity_bytes = 1 << 20), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            with(|c| (c.chunk_bytes, c.capacity_bytes) = (64 << 10, 4096)),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(with(|c| c.reserve_bytes = u64::MAX), Err(Error::InvalidArgument(_))));
    }
}
