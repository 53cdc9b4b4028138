//! An example policy plugin: limit = max × (1 + `params.factor`, 0.5 default).
//!
//! Test-only behaviours, driven by `params.mode`: `"panic"` panics inside compute, `"garbage"`
//! returns bytes that are not JSON, `"error"` returns an error result. The environment variable
//! `EXAMPLE_PLUGIN_ABI_VERSION` (read when the version is asked) fakes another ABI version.

use std::ffi::{c_char, CStr};

use policy_abi::{Description, PluginInput, PluginOutput};

/// The ABI version (or the faked one, for tests).
#[no_mangle]
pub extern "C" fn rlc_policy_abi_version() -> u32 {
    std::env::var("EXAMPLE_PLUGIN_ABI_VERSION")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(policy_abi::ABI_VERSION)
}

/// JSON description.
#[no_mangle]
pub extern "C" fn rlc_policy_describe() -> *mut c_char {
    policy_abi::describe_guarded(|| Description {
        name: "example".into(),
        description: "max × (1 + params.factor)".into(),
    })
}

/// JSON in, JSON out.
///
/// # Safety
/// `input` is a NUL-terminated string from the host.
#[no_mangle]
pub unsafe extern "C" fn rlc_policy_compute(input: *const c_char) -> *mut c_char {
    if !input.is_null()
        && CStr::from_ptr(input)
            .to_string_lossy()
            .contains("\"mode\":\"garbage\"")
    {
        return policy_abi::into_c_string("{this is not json".into());
    }
    policy_abi::compute_guarded(input, compute)
}

/// Frees what this plugin returned.
///
/// # Safety
/// `p` was returned by this plugin.
#[no_mangle]
pub unsafe extern "C" fn rlc_policy_free(p: *mut c_char) {
    policy_abi::free_string(p)
}

fn compute(i: PluginInput) -> Result<PluginOutput, String> {
    match i.params.get("mode").and_then(|m| m.as_str()) {
        Some("panic") => panic!("example plugin asked to panic"),
        Some("error") => return Err("example plugin asked to fail".into()),
        _ => {}
    }
    let factor = i
        .params
        .get("factor")
        .and_then(|f| f.as_f64())
        .unwrap_or(0.5);
    let max = i.max().ok_or("no samples")?;
    Ok(PluginOutput {
        limit_rps: max * (1.0 + factor),
        shadow: false,
        confidence: Some(1.0),
        evidence: serde_json::json!({"max_rps": max, "factor": factor}),
    })
}
