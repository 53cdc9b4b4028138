//! The C ABI between `rlc` and policy plugins, with helpers for plugin authors.
//!
//! A plugin is a `cdylib` exporting four symbols:
//!
//! | symbol | signature | |
//! |---|---|---|
//! | [`SYM_ABI_VERSION`] | `extern "C" fn() -> u32` | must return [`ABI_VERSION`]; checked before anything else |
//! | [`SYM_DESCRIBE`] | `extern "C" fn() -> *mut c_char` | JSON [`Description`] |
//! | [`SYM_COMPUTE`] | `extern "C" fn(*const c_char) -> *mut c_char` | JSON [`PluginInput`] in, JSON [`PluginResult`] out |
//! | [`SYM_FREE`] | `extern "C" fn(*mut c_char)` | frees a string the plugin returned |
//!
//! Strings are NUL-terminated UTF-8. Everything the plugin returns is freed by its own
//! `free`. A panic must never cross the boundary: build the exported functions with
//! [`describe_guarded`] and [`compute_guarded`], which catch it and return an error result.
//!
//! ```ignore
//! use std::ffi::c_char;
//! #[no_mangle] pub extern "C" fn rlc_policy_abi_version() -> u32 { policy_abi::ABI_VERSION }
//! #[no_mangle] pub extern "C" fn rlc_policy_describe() -> *mut c_char {
//!     policy_abi::describe_guarded(|| policy_abi::Description { name: "mine".into(), description: "…".into() })
//! }
//! #[no_mangle] pub unsafe extern "C" fn rlc_policy_compute(input: *const c_char) -> *mut c_char {
//!     policy_abi::compute_guarded(input, |i| Ok(policy_abi::PluginOutput::limit(i.max().unwrap_or(1.0) * 2.0)))
//! }
//! #[no_mangle] pub unsafe extern "C" fn rlc_policy_free(p: *mut c_char) { policy_abi::free_string(p) }
//! ```

use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use serde::{Deserialize, Serialize};

/// The ABI version this crate speaks. Bumped on any incompatible change.
pub const ABI_VERSION: u32 = 1;
/// `extern "C" fn() -> u32`.
pub const SYM_ABI_VERSION: &[u8] = b"rlc_policy_abi_version";
/// `extern "C" fn() -> *mut c_char`.
pub const SYM_DESCRIBE: &[u8] = b"rlc_policy_describe";
/// `extern "C" fn(*const c_char) -> *mut c_char`.
pub const SYM_COMPUTE: &[u8] = b"rlc_policy_compute";
/// `extern "C" fn(*mut c_char)`.
pub const SYM_FREE: &[u8] = b"rlc_policy_free";

/// What a plugin says about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Description {
    /// Short name.
    pub name: String,
    /// One line for humans.
    pub description: String,
}

/// One bucket's history and parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PluginInput {
    /// Callee service.
    pub service: String,
    /// Caller, if the bucket is per caller.
    pub caller: Option<String>,
    /// Procedure, if the bucket is per procedure.
    pub procedure: Option<String>,
    /// Unix time (s) of `values[0]`.
    pub start: i64,
    /// Seconds between values.
    pub step: i64,
    /// Per-step rate; `null` = missing sample (never zero).
    pub values: Vec<Option<f32>>,
    /// Headroom from the policy spec.
    pub headroom: Option<f64>,
    /// Planned capacity share, if any.
    pub capacity_share_rps: Option<f64>,
    /// Free-form `params` from the policy spec.
    pub params: serde_json::Value,
}

impl PluginInput {
    /// Maximum of the present values.
    pub fn max(&self) -> Option<f64> {
        self.values
            .iter()
            .flatten()
            .map(|&v| f64::from(v))
            .reduce(f64::max)
    }
}

/// A plugin's answer for one bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PluginOutput {
    /// Proposed limit (before rails).
    pub limit_rps: f64,
    /// Ask for shadow mode.
    #[serde(default)]
    pub shadow: bool,
    /// Confidence in [0, 1].
    #[serde(default)]
    pub confidence: Option<f64>,
    /// Evidence shown to service owners.
    #[serde(default)]
    pub evidence: serde_json::Value,
}

impl PluginOutput {
    /// A bare limit.
    pub fn limit(limit_rps: f64) -> Self {
        Self {
            limit_rps,
            shadow: false,
            confidence: None,
            evidence: serde_json::Value::Null,
        }
    }
}

/// What `compute` returns: `{"ok": {…}}` or `{"error": "…"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PluginResult {
    /// A limit.
    Ok(PluginOutput),
    /// A failure for this bucket.
    Error(String),
}

/// Moves `s` to the C side (free it with [`free_string`]). Interior NULs are replaced.
pub fn into_c_string(s: String) -> *mut c_char {
    CString::new(s.replace('\0', " "))
        .expect("no NUL left")
        .into_raw()
}

/// Frees a string made by [`into_c_string`].
///
/// # Safety
/// `p` must come from [`into_c_string`] in the same library, or be null.
pub unsafe fn free_string(p: *mut c_char) {
    if !p.is_null() {
        drop(CString::from_raw(p));
    }
}

/// Runs `f` with panics caught, returning its description as a C string (or an error JSON).
pub fn describe_guarded(f: impl FnOnce() -> Description) -> *mut c_char {
    let out = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(d) => serde_json::to_string(&d).unwrap_or_default(),
        Err(p) => serde_json::json!({"error": panic_message(&p)}).to_string(),
    };
    into_c_string(out)
}

/// Parses the input, runs `f` with panics caught and returns the JSON [`PluginResult`].
///
/// # Safety
/// `input` must be a valid NUL-terminated string or null.
pub unsafe fn compute_guarded(
    input: *const c_char,
    // String: the error crosses to the host as the text of `{"error": "…"}`, and a generic
    // error type would break the plugins whose closures never name one (`|i| Ok(…)`).
    f: impl FnOnce(PluginInput) -> Result<PluginOutput, String>,
) -> *mut c_char {
    let r = catch_unwind(AssertUnwindSafe(|| {
        if input.is_null() {
            return PluginResult::Error("null input".into());
        }
        let text = match CStr::from_ptr(input).to_str() {
            Ok(t) => t,
            Err(e) => return PluginResult::Error(format!("input is not UTF-8: {e}")),
        };
        match serde_json::from_str::<PluginInput>(text) {
            Ok(i) => match f(i) {
                Ok(o) => PluginResult::Ok(o),
                Err(e) => PluginResult::Error(e),
            },
            Err(e) => PluginResult::Error(format!("bad input JSON: {e}")),
        }
    }));
    let r = r
        .unwrap_or_else(|p| PluginResult::Error(format!("plugin panicked: {}", panic_message(&p))));
    into_c_string(serde_json::to_string(&r).unwrap_or_else(|e| {
        format!(
            "{{\"error\":\"cannot serialise result: {}\"}}",
            e.to_string().replace('"', "'")
        )
    }))
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarded_catches_panics_and_bad_input() {
        let call = |input: &str, f: fn(PluginInput) -> Result<PluginOutput, String>| {
            let c = CString::new(input).unwrap();
            let p = unsafe { compute_guarded(c.as_ptr(), f) };
            let s = unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string();
            unsafe { free_string(p) };
            serde_json::from_str::<PluginResult>(&s).unwrap()
        };
        let ok = r#"{"service":"s","caller":null,"procedure":"p","start":0,"step":60,"values":[1.0,null,3.0],"headroom":null,"capacity_share_rps":null,"params":null}"#;
        assert_eq!(
            call(ok, |i| Ok(PluginOutput::limit(i.max().unwrap()))),
            PluginResult::Ok(PluginOutput::limit(3.0))
        );
        assert!(
            matches!(call(ok, |_| panic!("boom")), PluginResult::Error(e) if e.contains("boom"))
        );
        assert!(
            matches!(call("{", |_| unreachable!()), PluginResult::Error(e) if e.contains("bad input"))
        );
    }
}
