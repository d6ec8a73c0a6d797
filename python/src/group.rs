//! `Group`: one arena per device and allocations made on all of them at
//! once (`vmm_arena::Group`; the C ABI's `vmm_arena_group_*`), for tensor
//! parallelism. A group allocation has one group id and one address per
//! member; its operations are all or nothing across the members.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use vmm_arena::{ArenaConfig, Error, Group as RGroup, GroupConfig, GroupId};

use crate::{opt_positive, opt_u64, py_err, stats_to_dict, to_py, u64_arg};

/// One arena per device (`devices`: CUDA ordinals, or any distinct labels
/// on the host backends), configured alike by keyword arguments.
#[pyclass(module = "vmm_arena._vmm_arena", subclass, frozen)]
pub(crate) struct Group {
    group: Arc<RGroup>,
}

fn group_id(v: &Bound<'_, PyAny>) -> PyResult<GroupId> {
    let raw = u64_arg(v, "id")?;
    GroupId::from_raw(raw).ok_or_else(|| py_err("UnknownAllocation", "group id 0 is never issued"))
}

fn group_err(e: vmm_arena::GroupError) -> PyErr {
    to_py(Error::from(e))
}

#[pymethods]
impl Group {
    #[new]
    #[pyo3(signature = (devices, *, backend="host", capacity_bytes=None, reserve_bytes=None, chunk_bytes=None, retain_bytes=None, peer_access=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        devices: Vec<Bound<'_, PyAny>>,
        backend: &str,
        capacity_bytes: Option<&Bound<'_, PyAny>>,
        reserve_bytes: Option<&Bound<'_, PyAny>>,
        chunk_bytes: Option<&Bound<'_, PyAny>>,
        retain_bytes: Option<&Bound<'_, PyAny>>,
        peer_access: bool,
    ) -> PyResult<Group> {
        let backend = crate::backend_arg(backend)?;
        let devices = devices
            .iter()
            .map(|d| {
                let n = u64_arg(d, "device")?;
                i32::try_from(n)
                    .map_err(|_| py_err("InvalidArgument", format!("device = {n} is out of range (0 .. 2**31)")))
            })
            .collect::<PyResult<Vec<i32>>>()?;
        let arena = ArenaConfig {
            backend,
            capacity_bytes: opt_positive(capacity_bytes, "capacity_bytes", 0)?,
            reserve_bytes: opt_positive(reserve_bytes, "reserve_bytes", 0)?,
            chunk_bytes: opt_positive(chunk_bytes, "chunk_bytes", 0)?,
            retain_bytes: opt_u64(retain_bytes, "retain_bytes", u64::MAX)?,
            ..ArenaConfig::default()
        };
        let config = GroupConfig { arena, devices, peer_access };
        let group = py.allow_threads(|| RGroup::new(config)).map_err(group_err)?;
        Ok(Group { group: Arc::new(group) })
    }

    /// The members' devices, in member order.
    #[getter]
    fn devices(&self) -> Vec<i32> {
        self.group.devices().to_vec()
    }

    fn __len__(&self) -> usize {
        self.group.len()
    }

    /// `size` bytes on every member: (group id, [address per member]).
    fn alloc(&self, py: Python<'_>, size: &Bound<'_, PyAny>) -> PyResult<(u64, Vec<u64>)> {
        let size = u64_arg(size, "size")?;
        let (id, ptrs) = py.allow_threads(|| self.group.alloc(size)).map_err(group_err)?;
        Ok((id.get(), ptrs))
    }

    /// A growable allocation on every member (`size` backed inside a
    /// reservation of `max_size`): (group id, [address per member]).
    fn alloc_growable(
        &self,
        py: Python<'_>,
        size: &Bound<'_, PyAny>,
        max_size: &Bound<'_, PyAny>,
    ) -> PyResult<(u64, Vec<u64>)> {
        let size = u64_arg(size, "size")?;
        let max_size = u64_arg(max_size, "max_size")?;
        let (id, ptrs) = py.allow_threads(|| self.group.alloc_growable(size, max_size)).map_err(group_err)?;
        Ok((id.get(), ptrs))
    }

    /// Resizes the allocation on every member, all or nothing; returns the
    /// addresses (per member) after it.
    fn resize(&self, py: Python<'_>, id: &Bound<'_, PyAny>, new_size: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let id = group_id(id)?;
        let new_size = u64_arg(new_size, "new_size")?;
        py.allow_threads(|| self.group.resize(id, new_size)).map_err(group_err)
    }

    /// Frees the allocation on every member.
    fn free(&self, py: Python<'_>, id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = group_id(id)?;
        py.allow_threads(|| self.group.free(id)).map_err(group_err)
    }

    /// Each member's view of the allocation: [{ptr, size, reserved_bytes,
    /// mapped_bytes, pinned, growable, tag, asleep}].
    fn query<'py>(&self, py: Python<'py>, id: &Bound<'_, PyAny>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let id = group_id(id)?;
        let infos = py.allow_threads(|| self.group.query(id)).map_err(group_err)?;
        infos
            .iter()
            .map(|i| {
                let d = PyDict::new(py);
                d.set_item("ptr", i.ptr)?;
                d.set_item("size", i.size)?;
                d.set_item("reserved_bytes", i.reserved_bytes)?;
                d.set_item("mapped_bytes", i.mapped_bytes)?;
                d.set_item("pinned", i.pinned)?;
                d.set_item("growable", i.growable)?;
                d.set_item("tag", i.tag)?;
                d.set_item("asleep", i.asleep)?;
                Ok(d)
            })
            .collect()
    }

    /// The allocation's id in each member arena.
    fn member_ids(&self, py: Python<'_>, id: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let id = group_id(id)?;
        let ids = py.allow_threads(|| self.group.member_ids(id)).map_err(group_err)?;
        Ok(ids.iter().map(|i| i.get()).collect())
    }

    /// Live group allocations.
    #[getter]
    fn live_allocations(&self) -> usize {
        self.group.live_allocations()
    }

    /// Each member's stats, as dicts (`vmm_arena.Group.stats()` types them).
    fn stats_dicts<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let all = py.allow_threads(|| self.group.stats()).map_err(group_err)?;
        all.iter().map(|s| stats_to_dict(py, s)).collect()
    }

    /// The members' snapshots as one JSON document.
    fn snapshot_json(&self, py: Python<'_>) -> PyResult<String> {
        py.allow_threads(|| self.group.snapshot_json()).map_err(group_err)
    }

    fn __repr__(&self) -> String {
        format!("<vmm_arena group over devices {:?}>", self.group.devices())
    }
}
