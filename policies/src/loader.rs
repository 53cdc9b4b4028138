//! Loads policy plugins (cdylibs speaking [`policy_abi`]) from one configured directory, in the
//! calling process. Only the plugin host process ([`crate::host`]) uses it: `rlc` itself runs
//! plugins out of process through [`crate::isolated`]. All `unsafe` of plugin loading lives here.
//!
//! Rules: the name must be a plain file stem (`plugin:../x` is rejected) and the resolved file
//! must lie inside the directory (symlinks included); the ABI version is checked before any
//! other symbol is used; a loaded library is never unloaded (kept in a static registry);
//! anything that goes wrong is a [`PolicyError::Plugin`] for the buckets using that plugin.

use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use policy_abi::{Description, ABI_VERSION};

use crate::PolicyError;

type VersionFn = unsafe extern "C" fn() -> u32;
type DescribeFn = unsafe extern "C" fn() -> *mut c_char;
type ComputeFn = unsafe extern "C" fn(*const c_char) -> *mut c_char;
type FreeFn = unsafe extern "C" fn(*mut c_char);

/// A loaded plugin. Lives for the whole process: its library is never unloaded.
pub struct PluginPolicy {
    name: String,
    path: PathBuf,
    description: Description,
    compute: ComputeFn,
    free: FreeFn,
    _lib: &'static libloading::Library,
}

impl std::fmt::Debug for PluginPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginPolicy")
            .field("name", &self.name)
            .field("path", &self.path)
            .field("description", &self.description)
            .finish()
    }
}

type Registry = Mutex<HashMap<PathBuf, Result<&'static PluginPolicy, PolicyError>>>;

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// A plugin error naming the plugin.
pub(crate) fn err(name: &str, message: impl Into<String>) -> PolicyError {
    PolicyError::Plugin {
        name: name.to_string(),
        message: message.into(),
    }
}

/// The file a plugin name resolves to inside `dir`: `lib<name>.so` (with `-` as `_`, as cargo
/// names cdylibs), or `<name>.so`; `.dylib`/`.dll` on other systems.
pub fn resolve(dir: &Path, name: &str) -> Result<PathBuf, PolicyError> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(err(
            name,
            "a plugin name is letters, digits, - and _ only (no paths)",
        ));
    }
    let dir = dir
        .canonicalize()
        .map_err(|e| err(name, format!("plugin directory {}: {e}", dir.display())))?;
    let candidates = [
        libloading::library_filename(name.replace('-', "_")),
        libloading::library_filename(name),
        format!("{name}{}", std::env::consts::DLL_SUFFIX).into(),
    ];
    for c in candidates {
        let p = dir.join(&c);
        if let Ok(real) = p.canonicalize() {
            if !real.starts_with(&dir) {
                return Err(err(
                    name,
                    format!("{} resolves outside the plugin directory", p.display()),
                ));
            }
            return Ok(real);
        }
    }
    Err(err(name, format!("no library for it in {}", dir.display())))
}

/// Loads (once per process) the plugin `name` from `dir`. A failure is remembered too, so a
/// broken plugin is not retried on every bucket.
pub fn load(dir: &Path, name: &str) -> Result<&'static PluginPolicy, PolicyError> {
    let path = resolve(dir, name)?;
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    let entry = reg
        .entry(path.clone())
        .or_insert_with(|| load_uncached(&path, name));
    entry.clone()
}

fn load_uncached(path: &Path, name: &str) -> Result<&'static PluginPolicy, PolicyError> {
    // SAFETY: loading runs the library's initialisers; plugins come only from the configured
    // directory, which the operator controls.
    let lib = unsafe { libloading::Library::new(path) }
        .map_err(|e| err(name, format!("cannot load {}: {e}", path.display())))?;
    // Never unloaded: code or data of the plugin may outlive any handle we could track.
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    // SAFETY: symbol types follow the policy_abi contract; the version is checked first.
    unsafe {
        let version: libloading::Symbol<VersionFn> =
            lib.get(policy_abi::SYM_ABI_VERSION).map_err(|e| {
                err(
                    name,
                    format!("not a policy plugin (no abi version symbol): {e}"),
                )
            })?;
        let v = version();
        if v != ABI_VERSION {
            return Err(err(
                name,
                format!("ABI version {v}, rlc speaks {ABI_VERSION}"),
            ));
        }
        let describe: libloading::Symbol<DescribeFn> = lib
            .get(policy_abi::SYM_DESCRIBE)
            .map_err(|e| err(name, e.to_string()))?;
        let compute: libloading::Symbol<ComputeFn> = lib
            .get(policy_abi::SYM_COMPUTE)
            .map_err(|e| err(name, e.to_string()))?;
        let free: libloading::Symbol<FreeFn> = lib
            .get(policy_abi::SYM_FREE)
            .map_err(|e| err(name, e.to_string()))?;
        let (compute, free) = (*compute, *free);
        let text =
            take_string(describe(), free).ok_or_else(|| err(name, "describe returned null"))?;
        let description: Description = serde_json::from_str(&text)
            .map_err(|e| err(name, format!("describe returned invalid JSON: {e}")))?;
        Ok(Box::leak(Box::new(PluginPolicy {
            name: name.to_string(),
            path: path.to_path_buf(),
            description,
            compute,
            free,
            _lib: lib,
        })))
    }
}

/// Copies a plugin string and hands it back to the plugin's `free`.
unsafe fn take_string(p: *mut c_char, free: FreeFn) -> Option<String> {
    if p.is_null() {
        return None;
    }
    let s = CStr::from_ptr(p).to_string_lossy().into_owned();
    free(p);
    Some(s)
}

impl PluginPolicy {
    /// What the plugin says about itself.
    pub fn description(&self) -> &Description {
        &self.description
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl PluginPolicy {
    /// Calls the plugin's `compute` with a JSON [`policy_abi::PluginInput`] and returns its
    /// answer as it came (JSON text, not yet checked). Only the plugin host process calls this:
    /// a plugin that segfaults, aborts or hangs takes the calling process with it.
    pub fn call(&self, input_json: &str) -> Result<String, PolicyError> {
        let c = CString::new(input_json).map_err(|e| err(&self.name, e.to_string()))?;
        // SAFETY: the ABI contract; the plugin catches its own panics (policy_abi helpers).
        unsafe { take_string((self.compute)(c.as_ptr()), self.free) }
            .ok_or_else(|| err(&self.name, "compute returned null"))
    }
}
