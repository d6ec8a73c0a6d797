//! The boundary every exported function runs in: the panic boundary, this
//! thread's last error, the checks of the caller's arguments (NULL pointers,
//! `struct_size`, ids), the C move callback's wrapper, and the reading of a
//! caller's config.

use std::cell::RefCell;
use std::ffi::{c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arena::driver::fault::FaultDriver;
use arena::driver::host::HostDriver;
use arena::{Arena, ArenaConfig, Backend, Error, Id, MoveEvent};

use super::*;

thread_local! {
    /// This thread's last error; `None` reads as "".
    pub(crate) static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
    /// Handles whose move callback is running on this thread.
    pub(crate) static IN_CALLBACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

pub(crate) fn set_last_error(msg: String) {
    let msg = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; the status
    // still tells the caller what happened.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = Some(msg));
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(no message)"
    }
}

/// Runs one exported function's body: its error becomes the status and the
/// thread's last error; a panic becomes `VMM_ARENA_ERR_INTERNAL` and poisons
/// `arena` (when not NULL).
///
/// `arena` must be NULL or a live handle: every caller passes its own
/// `arena` argument, which its `# Safety` contract requires to be so.
pub(crate) fn boundary(
    func: &'static str,
    arena: *const vmm_arena,
    body: impl FnOnce() -> Result<(), Error>,
) -> vmm_arena_status {
    boundary_with(
        func,
        || {
            // SAFETY: `arena` is NULL or a live handle (see above); the flag
            // is atomic, so other threads may use the handle meanwhile.
            if let Some(h) = unsafe { arena.as_ref() } {
                h.poisoned.store(true, Ordering::SeqCst);
            }
        },
        "arena",
        body,
    )
}

/// [`boundary`] for any handle: `poison` marks it when a panic is caught;
/// `what` names it in the message.
pub(crate) fn boundary_with(
    func: &'static str,
    poison: impl FnOnce(),
    what: &str,
    body: impl FnOnce() -> Result<(), Error>,
) -> vmm_arena_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => VMM_ARENA_OK,
        Ok(Err(e)) => {
            set_last_error(format!("{func}: {e}"));
            e.status().into()
        }
        Err(payload) => {
            poison();
            set_last_error(format!(
                "{func}: internal error: a panic was caught ({}); the {what} is poisoned",
                panic_message(&*payload)
            ));
            VMM_ARENA_ERR_INTERNAL
        }
    }
}

/// The panic boundary of the functions that return a value instead of a
/// status (and have no arena to poison): `fallback` if `f` panics.
pub(crate) fn guarded<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// The handle behind `arena`, or INVALID_ARGUMENT for NULL.
///
/// # Safety
/// `arena` is NULL or a handle from `vmm_arena_create` not yet destroyed,
/// and it outlives `'a`.
pub(crate) unsafe fn handle<'a>(arena: *const vmm_arena) -> Result<&'a vmm_arena, Error> {
    // SAFETY: non-NULL means a live handle, per this function's contract.
    unsafe { arena.as_ref() }.ok_or_else(|| invalid("arena is NULL"))
}

impl vmm_arena {
    /// The arena, unless a caught panic poisoned it.
    pub(crate) fn live(&self) -> Result<&Arena, Error> {
        if self.poisoned.load(Ordering::SeqCst) {
            return Err(Error::Internal(
                "the arena is poisoned by an earlier panic; only vmm_arena_destroy works".into(),
            ));
        }
        Ok(&self.arena)
    }
}

/// A required out-parameter: not NULL and aligned for `T`.
pub(crate) fn required<T>(p: *mut T, name: &str) -> Result<NonNull<T>, Error> {
    let p = NonNull::new(p).ok_or_else(|| invalid(format!("{name} is NULL")))?;
    if !p.as_ptr().is_aligned() {
        return Err(invalid(format!("{name} is not aligned")));
    }
    Ok(p)
}

/// An optional out-parameter ("may be NULL"): `None` for NULL.
pub(crate) fn optional<T>(p: *mut T, name: &str) -> Result<Option<NonNull<T>>, Error> {
    if p.is_null() {
        Ok(None)
    } else {
        required(p, name).map(Some)
    }
}

/// Writes an out-parameter.
///
/// # Safety
/// `p` points to memory the caller lets us write a `T` to.
pub(crate) unsafe fn put<T>(p: NonNull<T>, value: T) {
    // SAFETY: per this function's contract; `write` does not read or drop
    // what was there, which may be uninitialised.
    unsafe { p.as_ptr().write(value) }
}

/// The id for a raw value. 0 is never issued; it maps to an id whose low
/// half is 0, which names no slot (see `vmm_arena::Id`), so the arena still
/// applies its checks in the contract's order and answers UNKNOWN_ALLOCATION.
pub(crate) fn id_arg(raw: vmm_arena_id) -> Id {
    Id::from_raw(raw).or(Id::from_raw(1 << 32)).expect("1 << 32 is not 0")
}

/// Reports an unknown id as the caller spelled it.
pub(crate) fn with_raw_id(raw: vmm_arena_id) -> impl FnOnce(Error) -> Error {
    move |e| match e {
        Error::UnknownAllocation(_) => Error::UnknownAllocation(raw),
        e => e,
    }
}

pub(crate) fn in_callback_of(h: *const vmm_arena) -> bool {
    IN_CALLBACK.try_with(|v| v.borrow().contains(&(h as usize))).unwrap_or(false)
}

/// The C move callback, wrapped for the arena.
pub(crate) struct CMoveCallback {
    pub(crate) f: unsafe extern "C" fn(*mut c_void, vmm_arena_id, u64, u64, u64),
    pub(crate) user: *mut c_void,
    /// The handle the callback belongs to (compared only, never dereferenced).
    pub(crate) owner: usize,
}

// SAFETY: the arena may call its callback from any thread that calls into
// it. The C caller installs `f` and `user` under the header's documented
// rule that they may be used from every thread that calls the arena; the
// pointer itself is only passed back to `f`, never dereferenced here.
unsafe impl Send for CMoveCallback {}

impl CMoveCallback {
    pub(crate) fn call(&self, e: &MoveEvent) {
        let _ = IN_CALLBACK.try_with(|v| v.borrow_mut().push(self.owner));
        // SAFETY: `f` is the function the caller installed with
        // vmm_arena_set_move_callback, called with the `user` it gave and
        // plain integers; the header's contract for vmm_arena_move_fn says it
        // neither unwinds nor calls back into the arena in ways that fail
        // other than by status.
        unsafe { (self.f)(self.user, e.id.get(), e.old_ptr, e.new_ptr, e.size) };
        let _ = IN_CALLBACK.try_with(|v| {
            let mut v = v.borrow_mut();
            if let Some(i) = v.iter().rposition(|&o| o == self.owner) {
                v.remove(i);
            }
        });
    }
}

/// Reads a caller's config: `struct_size` first, and the rest only when it
/// is this version's size.
///
/// # Safety
/// `config` is NULL or points to at least `struct_size` readable bytes
/// that start with a `uint32_t struct_size`.
pub(crate) unsafe fn read_config(config: *const vmm_arena_config) -> Result<vmm_arena_config, Error> {
    if config.is_null() {
        return Err(invalid("config is NULL"));
    }
    if !config.is_aligned() {
        return Err(invalid("config is not aligned"));
    }
    // SAFETY: non-NULL and aligned; every caller's struct starts with its
    // uint32_t struct_size, and nothing past it is read here.
    let size = unsafe { config.cast::<u32>().read() };
    if size as usize != std::mem::size_of::<vmm_arena_config>() {
        return Err(invalid(format!(
            "config->struct_size is {size}, expected sizeof(vmm_arena_config) = {}",
            std::mem::size_of::<vmm_arena_config>()
        )));
    }
    // SAFETY: the caller says the struct is struct_size bytes, which is
    // exactly the size of the struct read; every bit pattern is valid for
    // its integer fields.
    Ok(unsafe { config.read() })
}

pub(crate) fn arena_config(c: &vmm_arena_config) -> Result<ArenaConfig, Error> {
    let backend = match c.backend {
        b if b == vmm_arena_backend::VMM_ARENA_BACKEND_HOST as u32 => Backend::Host,
        b if b == vmm_arena_backend::VMM_ARENA_BACKEND_CUDA as u32 => Backend::Cuda,
        b => return Err(invalid(format!("config->backend {b} is not a vmm_arena_backend"))),
    };
    if c.flags & !KNOWN_FLAGS != 0 {
        return Err(invalid(format!("config->flags has unknown bits {:#x}", c.flags & !KNOWN_FLAGS)));
    }
    Ok(ArenaConfig {
        backend,
        device: c.device,
        capacity_bytes: c.capacity_bytes,
        reserve_bytes: c.reserve_bytes,
        chunk_bytes: c.chunk_bytes,
        retain_bytes: c.retain_bytes,
        no_implicit_moves: c.flags & VMM_ARENA_FLAG_NO_IMPLICIT_MOVES != 0,
        exportable: c.flags & VMM_ARENA_FLAG_EXPORTABLE != 0,
        background: c.flags & VMM_ARENA_FLAG_BACKGROUND != 0,
        deterministic_placement: c.flags & VMM_ARENA_FLAG_DETERMINISTIC_PLACEMENT != 0,
    })
}

pub(crate) fn default_config() -> vmm_arena_config {
    vmm_arena_config {
        struct_size: std::mem::size_of::<vmm_arena_config>() as u32,
        backend: vmm_arena_backend::VMM_ARENA_BACKEND_CUDA as u32,
        device: 0,
        flags: 0,
        capacity_bytes: 0,
        reserve_bytes: 0,
        chunk_bytes: 0,
        retain_bytes: u64::MAX,
    }
}

/// Boxes an arena into a new handle and writes it to `out`.
///
/// # Safety
/// `out` is writable (checked by `required`).
pub(crate) unsafe fn publish(
    arena: Arena,
    fault: Option<Arc<FaultDriver<HostDriver>>>,
    out: NonNull<*mut vmm_arena>,
) -> Result<(), Error> {
    // SAFETY: per this function's contract.
    unsafe { publish_shared(Arc::new(arena), fault, out) }
}

/// Boxes a shared arena (a group member's, or a new one) into a new handle
/// and writes it to `out`.
///
/// # Safety
/// `out` is writable (checked by `required`).
pub(crate) unsafe fn publish_shared(
    arena: Arc<Arena>,
    fault: Option<Arc<FaultDriver<HostDriver>>>,
    out: NonNull<*mut vmm_arena>,
) -> Result<(), Error> {
    let h = Box::into_raw(Box::new(vmm_arena { arena, poisoned: AtomicBool::new(false), fault }));
    // SAFETY: per this function's contract.
    unsafe { put(out, h) };
    Ok(())
}
