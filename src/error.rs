//! The one error type of the library.
//!
//! Every variant maps onto exactly one C status (see [`Error::status`]); the
//! C ABI never invents a status of its own. Driver failures carry the call
//! that failed and the driver's own code and text.

use std::fmt;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The C ABI's status codes (`vmm_arena_status`), as plain values.
///
/// The numbers are part of the ABI: they are never changed or reused.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Ok = 0,
    InvalidArgument = 1,
    OutOfMemory = 2,
    OutOfAddressSpace = 3,
    UnknownAllocation = 4,
    Pinned = 5,
    Unsupported = 6,
    Driver = 7,
    Internal = 8,
    Asleep = 9,
    Stale = 10,
}

impl Status {
    /// The C name of the status, e.g. `"VMM_ARENA_ERR_PINNED"`.
    pub const fn name(self) -> &'static str {
        match self {
            Status::Ok => "VMM_ARENA_OK",
            Status::InvalidArgument => "VMM_ARENA_ERR_INVALID_ARGUMENT",
            Status::OutOfMemory => "VMM_ARENA_ERR_OUT_OF_MEMORY",
            Status::OutOfAddressSpace => "VMM_ARENA_ERR_OUT_OF_ADDRESS_SPACE",
            Status::UnknownAllocation => "VMM_ARENA_ERR_UNKNOWN_ALLOCATION",
            Status::Pinned => "VMM_ARENA_ERR_PINNED",
            Status::Unsupported => "VMM_ARENA_ERR_UNSUPPORTED",
            Status::Driver => "VMM_ARENA_ERR_DRIVER",
            Status::Internal => "VMM_ARENA_ERR_INTERNAL",
            Status::Asleep => "VMM_ARENA_ERR_ASLEEP",
            Status::Stale => "VMM_ARENA_ERR_STALE",
        }
    }

    /// Converts a raw C value; `None` for a value that names no status.
    pub const fn from_raw(raw: u32) -> Option<Status> {
        Some(match raw {
            0 => Status::Ok,
            1 => Status::InvalidArgument,
            2 => Status::OutOfMemory,
            3 => Status::OutOfAddressSpace,
            4 => Status::UnknownAllocation,
            5 => Status::Pinned,
            6 => Status::Unsupported,
            7 => Status::Driver,
            8 => Status::Internal,
            9 => Status::Asleep,
            10 => Status::Stale,
            _ => return None,
        })
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Every way an arena operation can fail.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A bad argument: zero or overflowing size, `max_size < size`, a bad
    /// configuration, a call from inside a move callback.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The physical capacity (or the driver's memory) cannot cover the request.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// Capacity suffices but no address range can be made free for the request.
    #[error("out of address space: {0}")]
    OutOfAddressSpace(String),
    /// The id was never issued by this arena, or was freed.
    #[error("unknown allocation: id {0:#x}")]
    UnknownAllocation(u64),
    /// The request would have to move this pinned allocation.
    #[error("allocation {0:#x} is pinned and cannot move")]
    Pinned(u64),
    /// The backend cannot run here.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A driver call failed.
    #[error("driver call {call} failed with {code} ({name}): {message}")]
    Driver {
        /// The driver function that failed, e.g. `"cuMemMap"` or `"mmap"`.
        call: &'static str,
        /// Its numeric code (CUresult or errno).
        code: i64,
        /// The code's symbolic name, e.g. `"CUDA_ERROR_INVALID_VALUE"` or `"EINVAL"`.
        name: String,
        /// A human-readable explanation.
        message: String,
    },
    /// The allocation is asleep (`Arena::sleep`) and the call needs its memory.
    #[error("allocation {0:#x} is asleep")]
    Asleep(u64),
    /// A bug inside the library (a caught panic, a poisoned lock).
    #[error("internal error: {0}")]
    Internal(String),
    /// A prepared two-phase operation whose allocation another call changed
    /// (resized, freed, put to sleep) since the prepare: its commit or abort
    /// no longer describes the arena, and did nothing.
    #[error("stale prepared operation: {0}")]
    Stale(String),
}

impl Error {
    /// The C status this error maps onto.
    pub fn status(&self) -> Status {
        match self {
            Error::InvalidArgument(_) => Status::InvalidArgument,
            Error::OutOfMemory(_) => Status::OutOfMemory,
            Error::OutOfAddressSpace(_) => Status::OutOfAddressSpace,
            Error::UnknownAllocation(_) => Status::UnknownAllocation,
            Error::Pinned(_) => Status::Pinned,
            Error::Unsupported(_) => Status::Unsupported,
            Error::Driver { .. } => Status::Driver,
            Error::Internal(_) => Status::Internal,
            Error::Asleep(_) => Status::Asleep,
            Error::Stale(_) => Status::Stale,
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_values_are_the_abi_values() {
        for raw in 0..=10u32 {
            let s = Status::from_raw(raw).unwrap();
            assert_eq!(s as u32, raw);
            assert!(s.name().starts_with("VMM_ARENA_"));
        }
        assert_eq!(Status::from_raw(9).map(Status::name), Some("VMM_ARENA_ERR_ASLEEP"));
        assert_eq!(Status::from_raw(10).map(Status::name), Some("VMM_ARENA_ERR_STALE"));
        assert_eq!(Status::from_raw(11), None);
    }

    #[test]
    fn errors_map_one_to_one() {
        let errs = [
            Error::InvalidArgument(String::new()),
            Error::OutOfMemory(String::new()),
            Error::OutOfAddressSpace(String::new()),
            Error::UnknownAllocation(1),
            Error::Pinned(1),
            Error::Unsupported(String::new()),
            Error::Driver { call: "x", code: 1, name: "E".into(), message: String::new() },
            Error::Internal(String::new()),
            Error::Asleep(1),
            Error::Stale(String::new()),
        ];
        let mut seen = std::collections::HashSet::new();
        assert_eq!(errs.len(), 10, "one error per status but Ok");
        for e in &errs {
            assert_ne!(e.status(), Status::Ok);
            assert!(seen.insert(e.status()), "{e:?} reuses a status");
        }
    }
}
