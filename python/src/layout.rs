//! The block-in-chunk KV layout for Python (`vmm_arena::layout`): the
//! layout arithmetic (`ChunkLayout`), one allocation's block table
//! (`BlockTable`), and the DLPack view of the arena's whole reserved range
//! (`ArenaRange`) over which `vmm_arena.layout` builds the per-layer
//! strided tensors paged kernels take.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use vmm_arena::layout::{BlockTable as RBlockTable, ChunkLayout as RChunkLayout, KvGeometry};
use vmm_arena::{Id, MoveEvent};

use crate::dlpack::{capsule, ViewCtx, Viewed};
use crate::{dl_device_of, id_of, py_err, to_py, u32_arg, u64_arg, Arena, Shared};

/// Where each layer's keys and values lie inside a chunk: layer-major, so
/// that one chunk is one block of a paged-attention block table.
///
/// `ChunkLayout(layers, kv_heads, head_dim, dtype_bytes, chunk_bytes,
/// block_tokens=0)`: `block_tokens` tokens a chunk (0: as many as fit).
/// Inside a chunk: layer 0's keys (`block_tokens x kv_heads x head_dim`
/// elements), layer 0's values, layer 1's keys, ...; the rest is unused.
/// `InvalidArgument` for a zero in the geometry, a chunk that holds no
/// token, or more `block_tokens` than fit.
#[pyclass(module = "vmm_arena._vmm_arena", frozen, eq, hash)]
#[derive(PartialEq, Eq, Hash)]
pub(crate) struct ChunkLayout {
    inner: RChunkLayout,
}

#[pymethods]
impl ChunkLayout {
    #[new]
    #[pyo3(signature = (layers, kv_heads, head_dim, dtype_bytes, chunk_bytes, block_tokens=None))]
    fn new(
        layers: &Bound<'_, PyAny>,
        kv_heads: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        dtype_bytes: &Bound<'_, PyAny>,
        chunk_bytes: &Bound<'_, PyAny>,
        block_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<ChunkLayout> {
        let geometry = KvGeometry {
            layers: u32_arg(layers, "layers")?,
            kv_heads: u32_arg(kv_heads, "kv_heads")?,
            head_dim: u32_arg(head_dim, "head_dim")?,
            dtype_bytes: u32_arg(dtype_bytes, "dtype_bytes")?,
        };
        let chunk = u64_arg(chunk_bytes, "chunk_bytes")?;
        let tokens = match block_tokens {
            Some(t) if !t.is_none() => u64_arg(t, "block_tokens")?,
            _ => 0,
        };
        let inner = RChunkLayout::with_block_tokens(geometry, chunk, tokens).map_err(to_py)?;
        Ok(ChunkLayout { inner })
    }

    /// Transformer layers holding a KV cache.
    #[getter]
    fn layers(&self) -> u32 {
        self.inner.geometry().layers
    }
    /// Key/value heads.
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.inner.geometry().kv_heads
    }
    /// Elements per head.
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.geometry().head_dim
    }
    /// Bytes per element.
    #[getter]
    fn dtype_bytes(&self) -> u32 {
        self.inner.geometry().dtype_bytes
    }
    /// The chunk size: the block stride in bytes.
    #[getter]
    fn chunk_bytes(&self) -> u64 {
        self.inner.chunk_bytes()
    }
    /// Tokens per chunk: the kernels' block size.
    #[getter]
    fn block_tokens(&self) -> u64 {
        self.inner.block_tokens()
    }
    /// Bytes of one token's key (or value) in one layer.
    #[getter]
    fn row_bytes(&self) -> u64 {
        self.inner.geometry().row_bytes()
    }
    /// Bytes of one token's keys and values across all layers.
    #[getter]
    fn token_bytes(&self) -> u64 {
        self.inner.geometry().token_bytes()
    }
    /// Bytes of one layer's keys (or values) in a chunk.
    #[getter]
    fn slab_bytes(&self) -> u64 {
        self.inner.slab_bytes()
    }
    /// Bytes of a chunk that hold keys and values.
    #[getter]
    fn used_bytes(&self) -> u64 {
        self.inner.used_bytes()
    }
    /// Bytes at the end of each chunk that hold nothing.
    #[getter]
    fn unused_bytes(&self) -> u64 {
        self.inner.unused_bytes()
    }
    /// Offset inside a chunk of `layer`'s keys.
    fn k_offset(&self, layer: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.inner.k_offset(u32_arg(layer, "layer")?).map_err(to_py)
    }
    /// Offset inside a chunk of `layer`'s values (right after its keys).
    fn v_offset(&self, layer: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.inner.v_offset(u32_arg(layer, "layer")?).map_err(to_py)
    }
    /// Chunks (blocks) that hold `tokens` tokens.
    fn blocks_for_tokens(&self, tokens: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.inner.blocks_for_tokens(u64_arg(tokens, "tokens")?))
    }
    /// Allocation size for `tokens` tokens: whole chunks.
    fn bytes_for_tokens(&self, tokens: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.inner.bytes_for_tokens(u64_arg(tokens, "tokens")?).map_err(to_py)
    }
    /// Offset from the start of an allocation of the key (`value=False`) or
    /// value row of `token` in `layer`.
    #[pyo3(signature = (layer, value, token))]
    fn token_offset(&self, layer: &Bound<'_, PyAny>, value: bool, token: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.inner.token_offset(u32_arg(layer, "layer")?, value, u64_arg(token, "token")?).map_err(to_py)
    }
    fn __repr__(&self) -> String {
        let g = self.inner.geometry();
        format!(
            "ChunkLayout(layers={}, kv_heads={}, head_dim={}, dtype_bytes={}, chunk_bytes={}, block_tokens={})",
            g.layers,
            g.kv_heads,
            g.head_dim,
            g.dtype_bytes,
            self.inner.chunk_bytes(),
            self.inner.block_tokens()
        )
    }
}

/// One allocation's block table: its chunk numbers, in order, counted from
/// the arena's base (chunk `n` starts at `base + n * chunk_bytes`).
///
/// `BlockTable(arena, allocation)` reads it now; `InvalidArgument` for an
/// allocation that does not hold whole chunks of its own (a small one in a
/// slab: allocate with `ChunkLayout.bytes_for_tokens` or growable). Keep
/// it right with `refresh(arena)` after a resize and with `on_move`, which
/// takes the move callback's arguments (`arena.set_move_callback(t.on_move)`
/// for one table). Each returns `(start, stop)`: the entries that changed
/// or were added; entries past `len(table)` were removed. On error the
/// table is unchanged.
#[pyclass(module = "vmm_arena._vmm_arena", frozen)]
pub(crate) struct BlockTable {
    inner: Mutex<RBlockTable>,
}

impl BlockTable {
    fn with<T>(&self, f: impl FnOnce(&mut RBlockTable) -> vmm_arena::Result<T>) -> PyResult<T> {
        let mut t = self.inner.lock().map_err(|_| py_err("InternalError", "block table lock poisoned"))?;
        f(&mut t).map_err(to_py)
    }
}

fn span(r: std::ops::Range<usize>) -> (usize, usize) {
    (r.start, r.end)
}

#[pymethods]
impl BlockTable {
    #[new]
    fn new(py: Python<'_>, arena: PyRef<'_, Arena>, allocation: &Bound<'_, PyAny>) -> PyResult<BlockTable> {
        let id = id_of(allocation, &arena.shared)?;
        let shared = arena.shared.clone();
        let t = py.allow_threads(|| RBlockTable::new(&shared.arena, id)).map_err(to_py)?;
        Ok(BlockTable { inner: Mutex::new(t) })
    }

    /// The id of the allocation it describes.
    #[getter]
    fn id(&self) -> PyResult<u64> {
        self.with(|t| Ok(t.id().get()))
    }
    /// The arena's base address.
    #[getter]
    fn base(&self) -> PyResult<u64> {
        self.with(|t| Ok(t.base()))
    }
    /// The arena's chunk size: the block stride.
    #[getter]
    fn chunk_bytes(&self) -> PyResult<u64> {
        self.with(|t| Ok(t.chunk_bytes()))
    }
    /// Its entries: chunk numbers from the arena's base, in order (each
    /// fits an int32).
    #[getter]
    fn blocks(&self) -> PyResult<Vec<u32>> {
        self.with(|t| Ok(t.blocks().to_vec()))
    }
    fn __len__(&self) -> PyResult<usize> {
        self.with(|t| Ok(t.len()))
    }
    /// Applies a move reported by the arena's move callback (same
    /// arguments; no arena call, so it may run inside the callback).
    fn on_move(
        &self,
        id: &Bound<'_, PyAny>,
        old_ptr: &Bound<'_, PyAny>,
        new_ptr: &Bound<'_, PyAny>,
        size: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize)> {
        let id = Id::from_raw(u64_arg(id, "id")?).ok_or_else(|| py_err("UnknownAllocation", "id 0 is never issued"))?;
        let event = MoveEvent {
            id,
            old_ptr: u64_arg(old_ptr, "old_ptr")?,
            new_ptr: u64_arg(new_ptr, "new_ptr")?,
            size: u64_arg(size, "size")?,
        };
        self.with(|t| t.on_move(&event)).map(span)
    }
    /// Sets the allocation's address and size (e.g. a resize's result).
    fn update(&self, ptr: &Bound<'_, PyAny>, size: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
        let (ptr, size) = (u64_arg(ptr, "ptr")?, u64_arg(size, "size")?);
        self.with(|t| t.update(ptr, size)).map(span)
    }
    /// Reads the allocation's address and size from `arena` and applies
    /// them: the call to make after a resize (not inside the move callback).
    fn refresh(&self, py: Python<'_>, arena: PyRef<'_, Arena>) -> PyResult<(usize, usize)> {
        let (id, base, chunk) = self.with(|t| Ok((t.id(), t.base(), t.chunk_bytes())))?;
        if arena.shared.arena.va_range().0 != base || arena.shared.arena.chunk_bytes() != chunk {
            return Err(py_err("InvalidArgument", "the block table belongs to another arena"));
        }
        // The arena is asked without the table's lock held: a move callback
        // running on another thread (arena locked) may be waiting for it.
        let shared = arena.shared.clone();
        let info = py.allow_threads(|| shared.arena.query(id)).map_err(to_py)?;
        if info.reserved_bytes < chunk || info.reserved_bytes % chunk != 0 {
            return Err(py_err(
                "InvalidArgument",
                format!("allocation {:#x} shares a chunk in a slab: a block table needs whole chunks", id.get()),
            ));
        }
        self.with(|t| t.update(info.ptr, info.size)).map(span)
    }
    fn __repr__(&self) -> String {
        match self.inner.lock() {
            Ok(t) => format!("<vmm_arena block table of {:#x}: {:?}>", t.id().get(), t.blocks()),
            Err(_) => "<vmm_arena block table (poisoned)>".into(),
        }
    }
}

/// The arena's whole reserved range, viewable through DLPack as one 1-D
/// uint8 array from the arena's base: what per-layer views indexed by block
/// tables are cut from. It pins nothing (allocations still move: rebuild
/// their block tables, not the view); only the chunks of live allocations
/// are memory, so read it only through block tables. The arena refuses
/// `close()` (Pinned) while a view of its range is alive.
#[pyclass(module = "vmm_arena._vmm_arena", frozen)]
pub(crate) struct ArenaRange {
    shared: Arc<Shared>,
}

impl ArenaRange {
    pub(crate) fn of(arena: &Arena) -> PyResult<ArenaRange> {
        arena.shared.open()?;
        Ok(ArenaRange { shared: arena.shared.clone() })
    }
}

#[pymethods]
impl ArenaRange {
    /// The arena's base address (chunk 0).
    #[getter]
    fn base(&self) -> u64 {
        self.shared.arena.va_range().0
    }
    /// Bytes of the reserved range.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.shared.arena.va_range().1
    }
    /// DLPack views of the range alive now (of this arena, from any
    /// `ArenaRange`).
    #[getter]
    fn views(&self) -> usize {
        self.shared.range_views.load(Ordering::Acquire)
    }

    /// A DLPack capsule viewing the range as uint8[nbytes], no copy.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<PyObject>,
        max_version: Option<PyObject>,
        dl_device: Option<PyObject>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (stream, dl_device);
        if copy == Some(true) {
            return Err(pyo3::exceptions::PyBufferError::new_err("the arena's range is viewed, never copied"));
        }
        self.shared.open()?;
        let (base, bytes) = self.shared.arena.va_range();
        let len = i64::try_from(bytes).map_err(|_| py_err("InvalidArgument", "the range is too large for DLPack"))?;
        let versioned =
            max_version.as_ref().and_then(|v| v.extract::<(u32, u32)>(py).ok()).is_some_and(|(major, _)| major >= 1);
        // Counted from here; the context's release brings it down once.
        self.shared.range_views.fetch_add(1, Ordering::AcqRel);
        let ctx = ViewCtx { shape: [len], shared: self.shared.clone(), viewed: Viewed::Range };
        capsule(py, base, dl_device_of(&self.shared), ctx, versioned)
    }

    /// (device type, device id), as `Buffer.__dlpack_device__`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        let d = dl_device_of(&self.shared);
        (d.device_type, d.device_id)
    }
}

/// The layout classes, for the module.
pub(crate) fn add_classes(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ChunkLayout>()?;
    m.add_class::<BlockTable>()?;
    m.add_class::<ArenaRange>()?;
    Ok(())
}
