//! How often a peer sends, and how long its last message counts: the aggregator's clients
//! (from the interval each report covers) and the controller's zones (from the gaps between
//! their forwards) follow one rule, so that a peer sending less often than the receiver ticks
//! is still counted between its messages.

/// The longest period an estimate follows (a longer one counts as this).
pub const MAX_PERIOD_MS: u64 = 60_000;

/// A peer's period after a message covering `sample_ms`, `prev` the estimate before it. A
/// message can come early (a client's urgent report, or the first regular one after it; an
/// aggregator forwarding as soon as all its clients reported, or resending a full report at
/// once after a resync), so the estimate falls at most by half per message.
pub fn estimate(prev: Option<u64>, sample_ms: u64) -> u64 {
    let s = sample_ms.min(MAX_PERIOD_MS);
    match prev {
        Some(p) => s.max(p / 2),
        None => s,
    }
}

/// How long a peer's last message counts (ms): three of its periods, and at least `floor_ms`
/// (three of the receiver's ticks).
pub fn horizon_ms(floor_ms: u64, period_ms: u64) -> u64 {
    floor_ms.max(period_ms.saturating_mul(3))
}
