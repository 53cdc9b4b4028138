//! An example policy plugin: limit = max × (1 + `params.factor`, 0.5 default).
//!
//! Test-only behaviours, driven by `params.mode`: `"panic"` panics inside compute (caught by
//! `compute_guarded`), `"garbage"` returns bytes that are not JSON, `"error"` returns an error
//! result. Misbehaviour that kills or blocks the process that loaded the plugin:
//! `"abort_panic"` panics across the C boundary (an abort), `"segfault"` writes through a null
//! pointer, `"hang"` never returns, `"hog"` allocates (and touches) memory without bound,
//! `"huge"` answers a limit of 1e308, and `"stdout"` prints to stdout before answering normally.
//! With `params.only_caller` set, the mode applies to that caller's buckets only. The
//! environment variable `EXAMPLE_PLUGIN_ABI_VERSION` (read when the version is asked) fakes
//! another ABI version.

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
    misbehave(input);
    policy_abi::compute_guarded(input, compute)
}

/// The modes that take the process down or block it, outside any panic guard.
///
/// # Safety
/// `input` is a NUL-terminated string or null.
unsafe fn misbehave(input: *const c_char) {
    if input.is_null() {
        return;
    }
    let Ok(i) = serde_json::from_slice::<PluginInput>(CStr::from_ptr(input).to_bytes()) else {
        return;
    };
    match mode(&i) {
        Some("abort_panic") => abort_panic(),
        Some("segfault") => {
            let p: *mut u64 = std::ptr::null_mut();
            std::ptr::write_volatile(p, 42);
        }
        Some("hang") => loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        },
        Some("hog") => {
            let mut kept: Vec<Vec<u8>> = Vec::new();
            loop {
                // 64 MiB at a time, every page touched so the memory is really used.
                kept.push(vec![1u8; 64 << 20]);
                std::hint::black_box(&kept);
            }
        }
        Some("stdout") => {
            println!("{{\"output\":\"{{\\\"ok\\\":{{\\\"limit_rps\\\":1}}}}\"}}");
            println!("debug print from a plugin");
        }
        _ => {}
    }
}

/// Panics in an `extern "C"` function: the panic cannot unwind across it, so the process aborts.
extern "C" fn abort_panic() {
    panic!("example plugin panics across the C boundary");
}

/// Frees what this plugin returned.
///
/// # Safety
/// `p` was returned by this plugin.
#[no_mangle]
pub unsafe extern "C" fn rlc_policy_free(p: *mut c_char) {
    policy_abi::free_string(p)
}

/// `params.mode`, unless `params.only_caller` names another caller.
fn mode(i: &PluginInput) -> Option<&str> {
    if let Some(only) = i.params.get("only_caller").and_then(|c| c.as_str()) {
        if i.caller.as_deref() != Some(only) {
            return None;
        }
    }
    i.params.get("mode").and_then(|m| m.as_str())
}

// String: what `policy_abi::compute_guarded` takes, the text sent to the host as JSON.
fn compute(i: PluginInput) -> Result<PluginOutput, String> {
    match mode(&i) {
        Some("panic") => panic!("example plugin asked to panic"),
        Some("error") => return Err("example plugin asked to fail".into()),
        Some("huge") => return Ok(PluginOutput::limit(1e308)),
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
