//! Memory per bucket of the controller's engine, counted by a global allocator (live bytes,
//! not RSS): the engine after `Engine::new` (its input dropped), after 20 zones reported one
//! bucket in ten each (every bucket reported by two zones on average), and after a tick.
//!
//! `cargo run --release -p grl-runtime --example engine_memory`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use grl_runtime::engine::Engine;
use grl_runtime::proto::{BucketCountsMsg, ZoneBucketMsg, ZoneReport};

#[path = "../benches/fixture/mod.rs"]
mod fixture;

struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        System.realloc(p, l, new)
    }
}

#[global_allocator]
static A: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

const PER_SERVICE: usize = 1000;
const ZONES: usize = 20;

fn report(n: usize, z: usize) -> ZoneReport {
    ZoneReport {
        aggregator_id: format!("agg-{z}"),
        region: format!("r{}", z / 5),
        zone: format!("z{z}"),
        calls: Vec::new(),
        buckets: (z % 10..n)
            .step_by(10)
            .map(|i| ZoneBucketMsg {
                service: format!("service-{:04}", i / PER_SERVICE),
                bucket: format!("caller-{:04}.proc", i % PER_SERVICE),
                offered_rps: 50.0,
                admitted_rps: 50.0,
                counts: BucketCountsMsg {
                    offered: 50,
                    admitted: 50,
                    ..Default::default()
                },
                ..Default::default()
            })
            .collect(),
    }
}

fn main() {
    for n in [100_000usize, 1_000_000] {
        let before = live();
        let mut e = Engine::new(fixture::fleet_config(n, PER_SERVICE), u64::MAX);
        let empty = live() - before;
        for z in 0..ZONES {
            let r = report(n, z);
            e.ingest(&r, 0);
        }
        e.recompute(0, 0);
        let reported = live() - before;
        e.record_reports(0);
        let ticked = live() - before;
        let per = |b: isize| b as f64 / n as f64;
        println!(
            "{n} buckets × {ZONES} zones: engine {:.0} B/bucket after new, {:.0} B/bucket with 2 zone reports per bucket, {:.0} B/bucket after a tick (report ring included); total {:.1} MB",
            per(empty),
            per(reported),
            per(ticked),
            ticked as f64 / 1e6
        );
        drop(e);
    }
}
