//! The history `rlc serve` holds, on disk: one ring of `f32` per series in one file, an index
//! in memory, so that the daemon's memory does not grow with the fleet's history.
//!
//! The file holds one slot per series, `cap` cells of 4 bytes (little-endian `f32`, `NaN` =
//! no sample) each, `cap` a little more than the lookback (the slack covers the increments
//! between two full pulls). Grid point `a` (counted in steps from the full pull's first point,
//! the ring's origin) of a series lives in cell `a mod cap` of its slot: an increment writes
//! its points (and `NaN` for a series it did not see) over the cells of points that left the
//! lookback, in place, and the held history moves on without a copy. A view
//! ([`RingHistory`]) is a grid (first point, length) and the index of its series (slot, last
//! sample); views share the file, and the plan reads one service's series at a time
//! ([`RingHistory::service`]), so that computing a plan holds one service's series.
//!
//! Every view of a ring stays readable while the increments since its first point are
//! within the slack (an older view's cells are overwritten by newer points: reading it then
//! fails, naming why). An increment is checked whole before anything is written
//! ([`RingHistory::apply`]); the cells it overwrites inside the held view (the overlap) are
//! read first and written back if a write fails, so a failed increment leaves the held view as
//! it was. A slot freed by a series that left the lookback is not reused (an older view may
//! still read it): the next full pull, a new file, compacts them.
//!
//! The file lives in a directory of its own (`rlc-held-*`, in `history.prometheus.spill_dir`
//! or the system's temporary directory), removed when the last view of the ring is dropped.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use super::incremental::{barred, union};
use super::spill::{index_services, service_entries};
use super::{DiskError, History, RateSeries, Rejected, SeriesKey, SpilledHistory, Unrestored};

/// "No sample" for [`Slot::last`].
const NONE: i64 = i64::MIN;

/// One file of slots.
pub struct Ring {
    _dir: tempfile::TempDir,
    path: PathBuf,
    /// Where new rings (full pulls replacing this one) are created.
    parent: PathBuf,
    file: File,
    /// Unix time of grid point 0.
    origin: i64,
    step: i64,
    /// Cells per slot.
    cap: usize,
    state: RwLock<State>,
}

/// What increments change (under the write lock; readers take the read lock).
struct State {
    /// Slots allocated.
    slots: u32,
    /// One past the highest grid point written: a view starting before `written_end - cap`
    /// has lost its oldest points.
    written_end: i64,
    /// Set when a failed increment could not be undone: nothing is read from the ring.
    broken: Option<Arc<Unrestored>>,
}

/// A series in a view: its slot, and its last grid point with a sample ([`NONE`] for none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    slot: u32,
    last: i64,
}

/// A history held in a [`Ring`]: the grid, the series' slots, the rejected series.
#[derive(Clone)]
pub struct RingHistory {
    ring: Arc<Ring>,
    /// Unix time (s) of the first grid point.
    pub start: i64,
    /// Grid step, seconds.
    pub step: i64,
    /// Grid points.
    pub len: usize,
    index: Arc<BTreeMap<SeriesKey, Slot>>,
    /// Unusable series with the reason.
    pub rejected: Vec<Rejected>,
}

impl std::fmt::Debug for RingHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingHistory")
            .field("path", &self.ring.path)
            .field("start", &self.start)
            .field("len", &self.len)
            .field("series", &self.index.len())
            .finish()
    }
}

fn le_bytes(values: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
}

fn from_le(bytes: &[u8], out: &mut [f32]) {
    for (v, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// The last point of `values` (starting at grid point `a0`) with a sample.
fn last_sample(a0: i64, values: &[f32]) -> i64 {
    values
        .iter()
        .rposition(|v| !v.is_nan())
        .map_or(NONE, |i| a0 + i as i64)
}

impl Ring {
    fn create(parent: &Path, origin: i64, step: i64, cap: usize) -> std::io::Result<Ring> {
        std::fs::create_dir_all(parent)?;
        let dir = tempfile::Builder::new()
            .prefix("rlc-held-")
            .tempdir_in(parent)?;
        let path = dir.path().join("series.f32");
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        Ok(Ring {
            _dir: dir,
            path,
            parent: parent.to_path_buf(),
            file,
            origin,
            step,
            cap,
            state: RwLock::new(State {
                slots: 0,
                written_end: 0,
                broken: None,
            }),
        })
    }

    /// The grid point of time `t` (a point of the grid).
    fn point(&self, t: i64) -> i64 {
        (t - self.origin).div_euclid(self.step)
    }

    /// Byte offset of cell `pos` of `slot`.
    fn offset(&self, slot: u32, pos: usize) -> u64 {
        (slot as u64 * self.cap as u64 + pos as u64) * 4
    }

    /// The cells of points `a0..a0 + n` as at most two runs `(cell, index in the points, n)`.
    fn runs(&self, a0: i64, n: usize) -> [(usize, usize, usize); 2] {
        let p = a0.rem_euclid(self.cap as i64) as usize;
        let first = n.min(self.cap - p);
        [(p, 0, first), (0, first, n - first)]
    }

    /// Writes `values` as points `a0..` of `slot` (at most `cap` of them).
    fn write(&self, slot: u32, a0: i64, values: &[f32], buf: &mut Vec<u8>) -> std::io::Result<()> {
        for (pos, i, n) in self.runs(a0, values.len()) {
            if n > 0 {
                le_bytes(&values[i..i + n], buf);
                self.file.write_all_at(buf, self.offset(slot, pos))?;
            }
        }
        Ok(())
    }

    /// Reads points `a0..a0 + out.len()` of `slot`.
    fn read(&self, slot: u32, a0: i64, out: &mut [f32], buf: &mut Vec<u8>) -> std::io::Result<()> {
        for (pos, i, n) in self.runs(a0, out.len()) {
            if n > 0 {
                buf.resize(n * 4, 0);
                self.file.read_exact_at(buf, self.offset(slot, pos))?;
                from_le(buf, &mut out[i..i + n]);
            }
        }
        Ok(())
    }

    /// Writes a whole slot: `values` as points `a0..`, `NaN` in every other cell.
    fn write_slot(
        &self,
        slot: u32,
        a0: i64,
        values: &[f32],
        cells: &mut Vec<f32>,
        buf: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        cells.clear();
        cells.resize(self.cap, f32::NAN);
        for (pos, i, n) in self.runs(a0, values.len()) {
            cells[pos..pos + n].copy_from_slice(&values[i..i + n]);
        }
        le_bytes(cells, buf);
        self.file.write_all_at(buf, self.offset(slot, 0))
    }

    fn write_error(&self, source: std::io::Error) -> DiskError {
        DiskError::Write {
            path: self.path.clone(),
            source,
        }
    }

    fn read_error(&self, source: std::io::Error) -> DiskError {
        DiskError::Read {
            path: self.path.clone(),
            source,
        }
    }
}

/// Writes the series of a new ring one at a time.
struct Filler {
    ring: Ring,
    start: i64,
    len: usize,
    index: BTreeMap<SeriesKey, Slot>,
    cells: Vec<f32>,
    buf: Vec<u8>,
}

impl Filler {
    fn new(parent: &Path, grid: (i64, i64, usize), cap: usize) -> Result<Filler, DiskError> {
        let (start, step, len) = grid;
        let cap = cap.max(len);
        let ring = Ring::create(parent, start, step, cap).map_err(|source| DiskError::Create {
            parent: parent.to_path_buf(),
            source,
        })?;
        Ok(Filler {
            ring,
            start,
            len,
            index: BTreeMap::new(),
            cells: Vec::new(),
            buf: Vec::new(),
        })
    }

    fn add(&mut self, key: &SeriesKey, values: &[f32]) -> Result<(), DiskError> {
        let slot = self.index.len() as u32;
        self.ring
            .write_slot(slot, 0, values, &mut self.cells, &mut self.buf)
            .map_err(|e| self.ring.write_error(e))?;
        self.index.insert(
            key.clone(),
            Slot {
                slot,
                last: last_sample(0, values),
            },
        );
        Ok(())
    }

    fn finish(self, rejected: Vec<Rejected>) -> RingHistory {
        {
            let mut st = self.ring.state.write().unwrap();
            st.slots = self.index.len() as u32;
            st.written_end = self.len as i64;
        }
        RingHistory {
            start: self.start,
            step: self.ring.step,
            len: self.len,
            ring: Arc::new(self.ring),
            index: Arc::new(self.index),
            rejected,
        }
    }
}

/// Cells per slot for a lookback of `len` points at `step` seconds, increments taken for
/// `every` seconds (`history.full_pull_every`) after a full pull: the lookback, the points
/// those increments add and their overlap, at most twice the lookback.
pub fn capacity(len: usize, step: i64, every: i64) -> usize {
    let step = step.max(1);
    let extra = (every.max(0) + super::incremental::OVERLAP_SECS) / step + 2;
    len + (extra.max(0) as usize).min(len)
}

impl RingHistory {
    /// A ring under `parent` holding `h` (a whole lookback in memory), `cap` cells per slot.
    pub fn from_history(h: &History, parent: &Path, cap: usize) -> Result<RingHistory, DiskError> {
        if let Some(e) = &h.source_error {
            return Err(DiskError::Unavailable(e.clone()));
        }
        let mut f = Filler::new(parent, (h.start, h.step, h.len), cap)?;
        for (k, s) in &h.series {
            f.add(k, &s.values)?;
        }
        Ok(f.finish(h.rejected.clone()))
    }

    /// A ring under `parent` holding a spilled pull, read one service at a time.
    pub fn from_spilled(
        s: &SpilledHistory,
        parent: &Path,
        cap: usize,
    ) -> Result<RingHistory, DiskError> {
        let mut f = Filler::new(parent, (s.start, s.step, s.len), cap)?;
        for service in s.services() {
            let h = s.service(&service)?;
            for (k, series) in &h.series {
                f.add(k, &series.values)?;
            }
        }
        Ok(f.finish(s.rejected.clone()))
    }

    /// Unix time just after the last grid point.
    pub fn end(&self) -> i64 {
        self.start + self.len as i64 * self.step
    }

    /// Series in the history.
    pub fn series_count(&self) -> usize {
        self.index.len()
    }

    /// The file (removed with its directory when the last view is dropped).
    pub fn path(&self) -> &Path {
        &self.ring.path
    }

    /// Bytes of the file.
    pub fn bytes(&self) -> u64 {
        let slots = self.ring.state.read().unwrap().slots;
        slots as u64 * self.ring.cap as u64 * 4
    }

    /// Every service with at least one series.
    pub fn services(&self) -> Vec<String> {
        index_services(&self.index)
    }

    /// The history of `service` alone, read from the file (no rejected series). An error
    /// when the ring could not be read, or when increments since moved past this view.
    pub fn service(&self, service: &str) -> Result<History, DiskError> {
        self.read(service_entries(&self.index, service))
    }

    /// The whole history in memory, rejected series included.
    pub fn to_history(&self) -> Result<History, DiskError> {
        let mut h = self.read(self.index.iter())?;
        h.rejected = self.rejected.clone();
        Ok(h)
    }

    fn read<'a>(
        &self,
        entries: impl Iterator<Item = (&'a SeriesKey, &'a Slot)>,
    ) -> Result<History, DiskError> {
        let ring = &self.ring;
        let st = ring.state.read().unwrap();
        if let Some(e) = &st.broken {
            return Err(DiskError::Broken(e.clone()));
        }
        let a0 = ring.point(self.start);
        if st.written_end > a0 + ring.cap as i64 {
            return Err(DiskError::MovedOn {
                path: ring.path.clone(),
            });
        }
        let mut series = BTreeMap::new();
        let mut buf = Vec::new();
        for (key, slot) in entries {
            let mut s = RateSeries::empty(self.start, self.step, self.len);
            ring.read(slot.slot, a0, &mut s.values, &mut buf)
                .map_err(|source| DiskError::ReadSeries {
                    key: key.clone(),
                    path: ring.path.clone(),
                    source,
                })?;
            series.insert(key.clone(), s);
        }
        Ok(History {
            start: self.start,
            step: self.step,
            len: self.len,
            series,
            rejected: Vec::new(),
            source_error: None,
        })
    }

    /// The history a full pull of the lookback `grid` would give, from this one and `tail`
    /// (the points of `grid` from some point on, pulled now), as [`super::incremental::merge`]
    /// gives it in memory: the tail's points written over the ring's oldest cells in place.
    /// `None` when they do not fit together (another step or origin, a gap, a lookback
    /// starting before this one, an increment beyond the ring's slack): pull the whole
    /// lookback. A tail that is the whole lookback makes a new ring. An error when a write
    /// failed: this view is then as it was (or, if it could not be restored, the ring refuses
    /// reads and the next pull must be a full one).
    pub fn apply(
        &self,
        tail: History,
        grid: (i64, i64, usize),
    ) -> Option<Result<RingHistory, DiskError>> {
        let (start, step, len) = grid;
        if tail.source_error.is_none()
            && tail.start == start
            && tail.len == len
            && tail.step == step
        {
            return Some(RingHistory::from_history(
                &tail,
                &self.ring.parent,
                self.ring.cap,
            ));
        }
        let ring = &self.ring;
        if tail.source_error.is_some()
            || self.step != step
            || tail.step != step
            || ring.step != step
            || tail.end() != start + len as i64 * step
            || tail.start < start
            || (tail.start - start) % step != 0
            || (start - ring.origin).rem_euclid(step) != 0
            || self.end() < tail.start
            || self.start > start
            || len != self.len
        {
            return None;
        }
        let (new_start, k, end) = (
            ring.point(start),
            ring.point(tail.start),
            ring.point(tail.end()),
        );
        let (held_start, held_end) = (ring.point(self.start), ring.point(self.end()));
        // This view's cells outside the overlap must not be written: the increment fits the
        // slack (else a full pull).
        if end - held_start > ring.cap as i64 {
            return None;
        }
        Some(self.write_increment(tail, (new_start, k, end, held_end)))
    }

    fn write_increment(
        &self,
        tail: History,
        (new_start, k, end, held_end): (i64, i64, i64, i64),
    ) -> Result<RingHistory, DiskError> {
        let ring = &self.ring;
        let rejected = union(&self.rejected, tail.rejected);
        let barred: HashSet<SeriesKey> = barred(&rejected);
        let mut tail_series = tail.series;
        let mut st = ring.state.write().unwrap();
        if let Some(e) = &st.broken {
            return Err(DiskError::Broken(e.clone()));
        }
        let mut w = Increment {
            ring,
            new_start,
            k,
            overlap: (held_end - k).max(0) as usize,
            nan: vec![f32::NAN; (end - k) as usize],
            index: BTreeMap::new(),
            saved: Vec::new(),
            cells: Vec::new(),
            buf: Vec::new(),
            scan: Vec::new(),
        };
        st.written_end = st.written_end.max(end);
        // New series first (new slots at the end of the file: the write most likely to fail,
        // for want of space, before anything of this view was touched).
        w.write_fresh(&mut st, &mut tail_series, |key| {
            !self.index.contains_key(key) && !barred.contains(key)
        })?;
        let held = self.index.iter().filter(|(key, _)| !barred.contains(*key));
        if let Err(failure) = w.write_held(held, &mut tail_series) {
            return Err(w.undo(&mut st, failure));
        }
        drop(st);
        Ok(RingHistory {
            ring: ring.clone(),
            start: ring.origin + new_start * ring.step,
            step: ring.step,
            len: self.len,
            index: Arc::new(w.index),
            rejected,
        })
    }

    /// Whether the ring refuses reads (an increment failed and could not be undone).
    pub fn broken(&self) -> bool {
        self.ring.state.read().unwrap().broken.is_some()
    }

    /// Breaks the ring as a write failure that could not be undone would (tests).
    #[doc(hidden)]
    pub fn break_for_test(&self, why: &str) {
        let why = Unrestored::Injected(std::io::Error::other(why.to_string()));
        self.ring.state.write().unwrap().broken = Some(Arc::new(why));
    }
}

/// An increment being written into a ring, under its write lock: the tail's points from
/// grid point `k` on, over the view's oldest cells.
struct Increment<'a> {
    ring: &'a Ring,
    /// The grid point of the new view's first point.
    new_start: i64,
    /// The grid point of the tail's first point.
    k: i64,
    /// Points of the held view the tail overwrites (from `k` to the held view's end).
    overlap: usize,
    /// The tail's points of a series it did not see.
    nan: Vec<f32>,
    /// The new view's series.
    index: BTreeMap<SeriesKey, Slot>,
    /// The overlap of each held series written so far, as it was: put back if a write fails.
    saved: Vec<(u32, Vec<f32>)>,
    cells: Vec<f32>,
    buf: Vec<u8>,
    scan: Vec<f32>,
}

impl Increment<'_> {
    /// Writes the series of `tail` that are `fresh` (not held, not barred) into new slots
    /// and indexes them; a series without a sample in the tail takes none.
    fn write_fresh(
        &mut self,
        st: &mut State,
        tail: &mut BTreeMap<SeriesKey, RateSeries>,
        fresh: impl Fn(&SeriesKey) -> bool,
    ) -> Result<(), DiskError> {
        let ring = self.ring;
        let mut slots = st.slots;
        let fresh: Vec<SeriesKey> = tail.keys().filter(|key| fresh(key)).cloned().collect();
        for key in fresh {
            let s = tail.remove(&key).expect("listed above");
            let last = last_sample(self.k, &s.values);
            if last == NONE {
                continue;
            }
            if let Err(e) =
                ring.write_slot(slots, self.k, &s.values, &mut self.cells, &mut self.buf)
            {
                st.slots = slots + 1;
                return Err(ring.write_error(e));
            }
            self.index.insert(key, Slot { slot: slots, last });
            slots += 1;
        }
        st.slots = slots;
        Ok(())
    }

    /// Writes the `held` series: the overlap kept aside, then the tail's points (`NaN` for a
    /// series the increment did not see) over the overlap and the cells of points that left.
    /// Indexes those with a sample in the new lookback.
    fn write_held<'k>(
        &mut self,
        held: impl Iterator<Item = (&'k SeriesKey, &'k Slot)>,
        tail: &mut BTreeMap<SeriesKey, RateSeries>,
    ) -> Result<(), DiskError> {
        let ring = self.ring;
        for (key, slot) in held {
            let values = tail.remove(key).map(|s| s.values);
            let values = values.as_deref().unwrap_or(&self.nan);
            let mut old = vec![f32::NAN; self.overlap];
            ring.read(slot.slot, self.k, &mut old, &mut self.buf)
                .map_err(|e| ring.read_error(e))?;
            self.saved.push((slot.slot, old));
            ring.write(slot.slot, self.k, values, &mut self.buf)
                .map_err(|e| ring.write_error(e))?;
            let mut last = last_sample(self.k, values);
            if last == NONE {
                last = self.last_before_tail(slot)?;
            }
            // A full pull lists a series only if it has a sample in the lookback.
            if last != NONE && last >= self.new_start {
                self.index.insert(
                    key.clone(),
                    Slot {
                        slot: slot.slot,
                        last,
                    },
                );
            }
        }
        Ok(())
    }

    /// The last grid point with a sample of a held series the tail has no sample of.
    fn last_before_tail(&mut self, slot: &Slot) -> Result<i64, DiskError> {
        if slot.last < self.k {
            return Ok(slot.last);
        }
        // Its last sample was in the overlap, which the increment no longer has: the one
        // before, from the file.
        let ring = self.ring;
        self.scan.clear();
        self.scan
            .resize((self.k - self.new_start).max(0) as usize, f32::NAN);
        ring.read(slot.slot, self.new_start, &mut self.scan, &mut self.buf)
            .map_err(|e| ring.read_error(e))?;
        Ok(last_sample(self.new_start, &self.scan))
    }

    /// After a write of the held series failed: puts their saved overlap back. A ring that
    /// cannot be restored is broken: it refuses reads until a full pull replaces it.
    fn undo(&mut self, st: &mut State, failure: DiskError) -> DiskError {
        for (slot, old) in &self.saved {
            if let Err(undo) = self.ring.write(*slot, self.k, old, &mut self.buf) {
                let broken = Arc::new(Unrestored::Undo { failure, undo });
                st.broken = Some(broken.clone());
                return DiskError::Broken(broken);
            }
        }
        failure
    }
}

#[cfg(test)]
mod tests;
