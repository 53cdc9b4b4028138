//! The controller's math, shared by the real controller and the simulator so that both run the
//! same formula.

use schema::Scope;

/// Drop-by-ratio: `(offered − limit) / offered` when the offered rate exceeds the limit, else 0.
pub fn drop_ratio(offered_rps: f64, limit_rps: f64) -> f64 {
    if offered_rps.is_finite() && offered_rps > limit_rps && offered_rps > 0.0 {
        ((offered_rps - limit_rps) / offered_rps).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// The key a bucket's limit is counted under for a client in `region`/`zone`:
/// `global`, `region:<region>` or `zone:<zone>`.
pub fn scope_key(scope: Scope, region: &str, zone: &str) -> String {
    match scope {
        Scope::Global => "global".to_string(),
        Scope::Region => format!("region:{region}"),
        Scope::Zone => format!("zone:{zone}"),
    }
}

/// What a client knows about one bucket from its last directive.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Directive {
    /// The ratio the controller computed.
    pub ratio: f64,
    /// The fleet's offered rate (for the bucket's scope key) the ratio was computed from.
    pub fleet_offered_rps: f64,
    /// The effective limit (after overrides).
    pub limit_rps: f64,
    /// This client's own offered rate in the interval the ratio was computed from.
    pub local_offered_rps: f64,
    /// A fixed ratio set by an override: never adjusted locally.
    pub fixed: bool,
}

/// The ratio a client applies when its own offered rate has moved to `local_now_rps` since
/// the directive was computed. The controller sees a jump one loop later; the client sees its
/// own share at once. Two estimates of the fleet's load, the larger ratio wins:
///
/// - its own jump alone (the others' rate unchanged): a lower bound on the fleet's load, so it
///   never drops a request the fleet-wide formula would not drop;
/// - when its rate is far above its share of the last known allowance ([`FAR_ABOVE_SHARE`] ×
///   [`allowance_share`]), the others are assumed to have jumped alike (a fleet-wide step, as a
///   client of the published design estimates its share): the client then admits only its
///   share of the allowance. A lone instance bursting that far above its share is dropped to
///   its share until the controller's answer to its urgent report (one loop) sets the
///   fleet-wide ratio again; a burst below it (an uneven instance under quota) never is.
pub fn adjusted_ratio(d: &Directive, local_now_rps: f64) -> f64 {
    if !jumped(d, local_now_rps) || d.limit_rps <= 0.0 {
        return d.ratio;
    }
    let fleet = d.fleet_offered_rps + (local_now_rps - d.local_offered_rps);
    let mut r = d.ratio.max(drop_ratio(fleet, d.limit_rps));
    if far_above_share(d, local_now_rps) {
        if let Some(a) = allowance_share(d) {
            r = r.max(drop_ratio(local_now_rps, a));
        }
    }
    r
}

/// This client's share of the allowance when the directive was computed: the limit in the
/// proportion of its own offered rate to the fleet's (`None` when either was zero).
pub fn allowance_share(d: &Directive) -> Option<f64> {
    (d.fleet_offered_rps > 0.0 && d.local_offered_rps > 0.0 && d.limit_rps > 0.0)
        .then(|| d.limit_rps * d.local_offered_rps.min(d.fleet_offered_rps) / d.fleet_offered_rps)
}

/// Whether `local_now_rps` is more than [`FAR_ABOVE_SHARE`] times this client's allowance share
/// (and a clear jump over its own rate).
pub fn far_above_share(d: &Directive, local_now_rps: f64) -> bool {
    jumped(d, local_now_rps)
        && allowance_share(d).is_some_and(|a| local_now_rps > FAR_ABOVE_SHARE * a)
}

/// Whether a client's own rate `local_now_rps` is a clear jump over what the directive was
/// computed from. Only a clear jump counts: sub-tick rates are noisy and a false alarm drops
/// real traffic; a fixed (override) ratio never moves.
pub fn jumped(d: &Directive, local_now_rps: f64) -> bool {
    !d.fixed && local_now_rps > d.local_offered_rps * JUMP
}

/// How much a client's own rate must grow before it adjusts on its own.
pub const JUMP: f64 = 1.5;

/// How far above its share of the allowance a client's own rate must be before the client
/// takes the jump for the fleet's: 6×. An instance of an uneven fleet bursting while the fleet
/// is under quota stays below it (a 8× burst of an instance whose fleet runs at half the limit
/// is 4× its share); a fleet-wide 15× step from 73% of the limit is 12× each client's share.
pub const FAR_ABOVE_SHARE: f64 = 6.0;

/// Jain's fairness index of `xs`: 1 when all equal, 1/n when one takes everything.
pub fn jain_index(xs: &[f64]) -> f64 {
    let n = xs.len() as f64;
    let s: f64 = xs.iter().sum();
    let s2: f64 = xs.iter().map(|x| x * x).sum();
    if n == 0.0 || s2 == 0.0 {
        1.0
    } else {
        s * s / (n * s2)
    }
}
