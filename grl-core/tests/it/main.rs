//! The decide path allocates nothing (ARCHITECTURE.md invariant), counted with a global
//! allocator wrapper in this test binary, on the deciding thread only (the test harness's
//! other threads may allocate meanwhile).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use grl_core::{Limiter, Table};
use schema::{Bucket, Mode, PolicyName, Scope};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    // Const-initialised and without a destructor: reading it never allocates.
    static COUNTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTED.try_with(|c| c.get()).unwrap_or(false) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn bucket(name: &str, caller: Option<&str>, procedure: Option<&str>, mode: Mode) -> Bucket {
    Bucket {
        name: name.into(),
        caller: caller.map(str::to_string),
        procedure: procedure.map(str::to_string),
        scope: Scope::Global,
        limit_rps: 100.0,
        mode,
        policy: PolicyName::Peak,
    }
}

#[test]
fn decide_allocates_nothing() {
    let l = Limiter::new("payments", Duration::from_secs(3));
    l.install(
        Table::compile(
            "payments",
            "v1",
            &[
                bucket(
                    "gw.charge",
                    Some("api-gateway"),
                    Some("charge"),
                    Mode::Enforce,
                ),
                bucket("refund", None, Some("refund"), Mode::Shadow),
                bucket("batch", Some("batch"), None, Mode::Enforce),
            ],
        )
        .unwrap(),
    );
    let t = l.table();
    for i in 0..t.buckets().len() {
        t.set_ratio(i, 0.4); // non-zero: the clock, the draw and the drop counters all run
    }
    l.directives_received(u64::MAX / 2);
    let keys = [
        ("api-gateway", "charge"),
        ("web", "refund"),
        ("batch", "anything"),
        ("nobody", "nothing"),
    ];
    // Warm-up: the first decision on a thread claims its counter shard and table cache entry.
    for (c, p) in keys {
        l.decide(c, p);
    }
    let before = ALLOCS.load(Ordering::Relaxed);
    COUNTED.with(|c| c.set(true));
    let mut dropped = 0u32;
    for i in 0..100_000 {
        let (c, p) = keys[i % keys.len()];
        if !l.decide(c, p).admitted() {
            dropped += 1;
        }
    }
    COUNTED.with(|c| c.set(false));
    let after = ALLOCS.load(Ordering::Relaxed);
    assert!(dropped > 0, "the enforce buckets drop at ratio 0.4");
    assert_eq!(after - before, 0, "allocations in 100,000 decisions");
}

/// Every decision is counted once, whatever the threads: more threads than shards, threads
/// that exit and hand their shard on while others count, a reader snapshotting meanwhile.
#[test]
fn every_decision_is_counted_once_across_threads_that_come_and_go() {
    use std::sync::Arc;
    let l = Arc::new(Limiter::new("payments", Duration::from_secs(3)));
    l.install(
        Table::compile(
            "payments",
            "v1",
            &[bucket("gw", Some("gw"), None, Mode::Shadow)],
        )
        .unwrap(),
    );
    let per_thread = 20_000u64;
    let (waves, threads) = (8u64, 12u64);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (l, stop) = (l.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut last = 0;
            while !stop.load(Ordering::Relaxed) {
                let now = l.table().counts(0).offered;
                assert!(now >= last, "counts went back: {last} -> {now}");
                last = now;
            }
        })
    };
    for _ in 0..waves {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..per_thread {
                        l.decide("gw", "charge");
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    assert_eq!(l.table().counts(0).offered, waves * threads * per_thread);
}
