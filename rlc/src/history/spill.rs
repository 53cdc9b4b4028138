//! A pulled history kept on disk instead of in memory, read back service by service.
//!
//! While a pull streams in, each series' samples of each answer go to one temporary file as a
//! dense run of `f32` (little-endian, `NaN` = no sample) covering the grid steps from its
//! first to its last sample in that answer; an in-memory index maps each series to its runs
//! (`offset`, first grid step, length). [`SpilledHistory::service`] then reads one service's
//! series back onto their grid, merging runs by maximum as `super::Builder` merges samples
//! in memory (a retried answer writes its runs again: the same values), so a plan computed
//! service by service holds one service's series at a time, not the fleet's.
//!
//! The file lives in a directory of its own (`rlc-history-*`, in `history.prometheus.spill_dir`
//! or the system's temporary directory) that is removed when the writer or the
//! [`SpilledHistory`] is dropped: after the plan, and on an error or a panic too.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::{DiskError, History, Rejected, SeriesKey};
use policies::RateSeries;

/// Buffer between the decoders and the file.
const WRITE_BUFFER: usize = 1 << 20;

/// One run of a series: `len` grid steps from step `start`, at `offset` in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Extent {
    offset: u64,
    start: u32,
    len: u32,
}

/// The file being written and the runs written so far.
pub(crate) struct SpillWriter {
    dir: tempfile::TempDir,
    path: PathBuf,
    out: BufWriter<File>,
    offset: u64,
    /// The first write error: the pull fails with it ([`SpillWriter::finish`]).
    error: Option<std::io::Error>,
    bytes: Vec<u8>,
}

impl SpillWriter {
    /// A new spill file in a new directory under `parent`.
    pub(crate) fn create(parent: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(parent)?;
        let dir = tempfile::Builder::new()
            .prefix("rlc-history-")
            .tempdir_in(parent)?;
        let path = dir.path().join("series.f32");
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        Ok(Self {
            dir,
            path,
            out: BufWriter::with_capacity(WRITE_BUFFER, file),
            offset: 0,
            error: None,
            bytes: Vec::new(),
        })
    }

    /// The directory holding the file (removed on drop).
    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Appends `values` (grid steps `start..start + len`); `None` once a write failed.
    pub(crate) fn write(&mut self, start: usize, values: &[f32]) -> Option<Extent> {
        if self.error.is_some() {
            return None;
        }
        self.bytes.clear();
        self.bytes
            .extend(values.iter().flat_map(|v| v.to_le_bytes()));
        if let Err(e) = self.out.write_all(&self.bytes) {
            self.error = Some(e);
            return None;
        }
        let e = Extent {
            offset: self.offset,
            start: start as u32,
            len: values.len() as u32,
        };
        self.offset += self.bytes.len() as u64;
        Some(e)
    }

    /// Flushes the file and hands it over with its index.
    pub(crate) fn finish(
        self,
        grid: (i64, i64, usize),
        index: BTreeMap<SeriesKey, Vec<Extent>>,
        rejected: Vec<Rejected>,
    ) -> Result<SpilledHistory, (PathBuf, std::io::Error)> {
        let SpillWriter {
            dir,
            path,
            out,
            offset,
            error,
            ..
        } = self;
        if let Some(e) = error {
            return Err((path, e));
        }
        let file = out
            .into_inner()
            .map_err(|e| (path.clone(), e.into_error()))?;
        tracing::debug!(path = %path.display(), bytes = offset, series = index.len(), "history spilled");
        Ok(SpilledHistory {
            start: grid.0,
            step: grid.1,
            len: grid.2,
            index,
            rejected,
            file,
            path,
            bytes: offset,
            _dir: dir,
        })
    }
}

/// A history whose series are on disk (`crate::history::load_spilled`): the grid, the
/// rejected series and an index in memory, one service's series read at a time.
pub struct SpilledHistory {
    /// Unix time (s) of the first grid point.
    pub start: i64,
    /// Grid step, seconds.
    pub step: i64,
    /// Grid points.
    pub len: usize,
    index: BTreeMap<SeriesKey, Vec<Extent>>,
    /// Unusable series with the reason.
    pub rejected: Vec<Rejected>,
    file: File,
    path: PathBuf,
    bytes: u64,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for SpilledHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpilledHistory")
            .field("path", &self.path)
            .field("series", &self.index.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl SpilledHistory {
    /// Series in the history.
    pub fn series_count(&self) -> usize {
        self.index.len()
    }

    /// Bytes in the spill file.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The spill file (removed with its directory on drop).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every service with at least one series.
    pub fn services(&self) -> Vec<String> {
        index_services(&self.index)
    }

    /// The history of `service` alone: its series read from the file onto the grid (no
    /// rejected series, no source error). An error names the file and the series.
    pub fn service(&self, service: &str) -> Result<History, DiskError> {
        self.read(service_entries(&self.index, service))
    }

    /// The whole history in memory (what [`crate::history::load`] gives), rejected series
    /// included.
    pub fn to_history(&self) -> Result<History, DiskError> {
        let mut h = self.read(self.index.iter())?;
        h.rejected = self.rejected.clone();
        Ok(h)
    }

    fn read<'a>(
        &self,
        entries: impl Iterator<Item = (&'a SeriesKey, &'a Vec<Extent>)>,
    ) -> Result<History, DiskError> {
        let mut series = BTreeMap::new();
        let mut bytes = Vec::new();
        for (key, extents) in entries {
            let mut s = RateSeries::empty(self.start, self.step, self.len);
            for e in extents {
                bytes.resize(e.len as usize * 4, 0);
                self.file
                    .read_exact_at(&mut bytes, e.offset)
                    .map_err(|source| DiskError::ReadSpill {
                        path: self.path.clone(),
                        key: key.clone(),
                        len: bytes.len(),
                        offset: e.offset,
                        source,
                    })?;
                let run = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                let start = e.start as usize;
                let end = (start + e.len as usize).min(self.len);
                for (v, x) in s.values[start.min(end)..end].iter_mut().zip(run) {
                    merge_max(v, x);
                }
            }
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
}

/// Puts `x` into `v` keeping the larger (`NaN` = no sample): how samples of one step merge,
/// in memory and from the spill.
pub(crate) fn merge_max(v: &mut f32, x: f32) {
    if !x.is_nan() && (v.is_nan() || *v < x) {
        *v = x;
    }
}

/// The spill side of [`super::Builder`]: the writer, the index and a scratch run.
pub(crate) struct SpillState {
    pub(crate) writer: SpillWriter,
    pub(crate) index: HashMap<SeriesKey, Vec<Extent>>,
    run: Vec<f32>,
}

impl SpillState {
    pub(crate) fn new(writer: SpillWriter) -> Self {
        Self {
            writer,
            index: HashMap::new(),
            run: Vec::new(),
        }
    }

    /// Writes the samples `(grid step, value)` of one series as one run; `false` (nothing
    /// written) when the series has `max_runs` runs already: an answer lists a series once,
    /// so a pull writes at most one run per request and attempt, and more is an answer
    /// repeating it (which would grow the index and the file without end).
    pub(crate) fn add(
        &mut self,
        key: &SeriesKey,
        samples: &[(usize, f32)],
        max_runs: usize,
    ) -> bool {
        // A series seen without a sample in the grid is a series of missing samples.
        if !self.index.contains_key(key) {
            self.index.insert(key.clone(), Vec::new());
        }
        let (Some(lo), Some(hi)) = (
            samples.iter().map(|s| s.0).min(),
            samples.iter().map(|s| s.0).max(),
        ) else {
            return true;
        };
        if self.index[key].len() >= max_runs {
            return false;
        }
        self.run.clear();
        self.run.resize(hi - lo + 1, f32::NAN);
        for &(i, x) in samples {
            merge_max(&mut self.run[i - lo], x);
        }
        if let Some(e) = self.writer.write(lo, &self.run) {
            self.index.get_mut(key).expect("inserted above").push(e);
        }
        true
    }
}

/// The services of an index of series (the spill's or the held ring's), once each, in order.
pub(crate) fn index_services<V>(index: &BTreeMap<SeriesKey, V>) -> Vec<String> {
    let mut v: Vec<String> = index.keys().map(|k| k.service.clone()).collect();
    v.dedup();
    v
}

/// The entries of `service` in an index of series: a range lookup, not a scan of the fleet.
pub(crate) fn service_entries<'a, V>(
    index: &'a BTreeMap<SeriesKey, V>,
    service: &'a str,
) -> impl Iterator<Item = (&'a SeriesKey, &'a V)> {
    let first = SeriesKey {
        service: service.to_string(),
        caller: None,
        procedure: None,
    };
    index
        .range(first..)
        .take_while(move |(k, _)| k.service == service)
}
