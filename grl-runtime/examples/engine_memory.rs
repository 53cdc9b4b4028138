//! Memory per bucket of the controller's engine, counted by a global allocator (live bytes,
//! not RSS): the engine after `Engine::new` (its input dropped), after 20 zones reported one
//! bucket in ten each (every bucket reported by two zones on average), and after a tick; then
//! with delta sessions (protocol 4): after 30 rounds of 5% delta reports answered with delta
//! directives (the directive log at its bound), and the aggregator's side: one zone's
//! `delta::Upstream` holding what its controller acknowledged (per bucket of the zone).
//!
//! `cargo run --release -p grl-runtime --example engine_memory`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use grl_control::delta::{DeltaOptions, Upstream};
use grl_control::engine::Engine;
use grl_wire::{BucketCountsMsg, ReportSession, ZoneBucketMsg, ZoneReport, PROTO_DELTA};

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
        calls_ms: None,
        session: None,
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
        // Delta sessions: every zone's full report once more, with a session, then 30 rounds
        // of deltas carrying 5% of its buckets, each answered.
        let mut held: Vec<Option<(u64, u64)>> = vec![None; ZONES];
        for round in 1..=31u64 {
            for (z, h) in held.iter_mut().enumerate() {
                let mut r = report(n, z);
                if round > 1 {
                    let k = r.buckets.len() / 20;
                    let from = (round as usize * 7919) % (r.buckets.len() - k);
                    r.buckets = r.buckets.drain(from..from + k).collect();
                    for b in &mut r.buckets {
                        b.offered_rps += round as f64;
                    }
                }
                r.session = Some(ReportSession {
                    id: z as u64,
                    seq: round,
                    base: (round > 1).then(|| round - 1),
                    directives: *h,
                });
                let d = e.answer(&r, 0, 0);
                let s = d.session.expect("session");
                assert!(!s.resync);
                *h = Some((s.epoch, s.version));
            }
            e.record_reports(0);
        }
        let delta = live() - before;
        // The aggregator's side: what one zone's upstream holds after a full report is
        // acknowledged.
        let full = report(n, 3);
        let zone_buckets = full.buckets.len();
        let before_up = live();
        let mut up = Upstream::default();
        up.proto = PROTO_DELTA;
        let p = up.prepare(&full, 0, DeltaOptions::default(), false);
        let mut reply = e.answer(&p.report, 0, 0);
        reply.services = Vec::new();
        up.answered(p, &reply);
        drop(reply);
        let upstream = live() - before_up;
        let per = |b: isize| b as f64 / n as f64;
        println!(
            "{n} buckets × {ZONES} zones: engine {:.0} B/bucket after new, {:.0} B/bucket with 2 zone reports per bucket, {:.0} B/bucket after a tick (report ring included); total {:.1} MB; {:.0} B/bucket after 30 delta rounds (directive log included); aggregator upstream {:.0} B per zone bucket ({zone_buckets} buckets)",
            per(empty),
            per(reported),
            per(ticked),
            ticked as f64 / 1e6,
            per(delta),
            upstream as f64 / zone_buckets as f64,
        );
        drop(up);
        drop(e);
    }
}
