//! `rlc-plugin-host`: the process that runs one policy plugin for `rlc` (see
//! `policies::host`). The `rlc` binary does the same when started with `__plugin-host`; this
//! small binary is for deployments and tests that want a host without the whole of `rlc`.

fn main() {
    std::process::exit(policies::host::main(std::env::args_os().skip(1)));
}
