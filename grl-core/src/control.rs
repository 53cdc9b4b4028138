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
/// own share at once. It assumes only its own load changed (the others' rate is unknown), which
/// is a lower bound on the fleet's load: the adjustment can shorten the lag after a fleet-wide
/// step but never drops a request the fleet-wide formula would not drop.
pub fn adjusted_ratio(d: &Directive, local_now_rps: f64) -> f64 {
    if !jumped(d, local_now_rps) || d.limit_rps <= 0.0 {
        return d.ratio;
    }
    let fleet = d.fleet_offered_rps + (local_now_rps - d.local_offered_rps);
    d.ratio.max(drop_ratio(fleet, d.limit_rps))
}

/// Whether a client's own rate `local_now_rps` is a clear jump over what the directive was
/// computed from. Only a clear jump counts: sub-tick rates are noisy and a false alarm drops
/// real traffic; a fixed (override) ratio never moves.
pub fn jumped(d: &Directive, local_now_rps: f64) -> bool {
    !d.fixed && local_now_rps > d.local_offered_rps * JUMP
}

/// How much a client's own rate must grow before it adjusts on its own.
pub const JUMP: f64 = 1.5;

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
