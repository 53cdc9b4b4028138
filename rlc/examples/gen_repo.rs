//! Writes a config repo of N services × 10 buckets (from config-repo-template plus generated
//! bucket files), to time `rlc validate` on a large repo:
//!
//! ```sh
//! cargo run --release -p rlc --example gen_repo -- 1000 /tmp/big-repo
//! time target/release/rlc validate /tmp/big-repo
//! ```

use std::path::{Path, PathBuf};

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let t = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_dir(&e.path(), &t)?;
        } else {
            std::fs::copy(e.path(), &t)?;
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1000);
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "big-repo".into()));
    copy_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../config-repo-template"),
        &dir,
    )?;
    for i in 0..n {
        let service = format!("svc{i:04}");
        let mut f = schema::BucketFile {
            criticality: Default::default(),
            service: service.clone(),
            buckets: Vec::new(),
        };
        for j in 0..10 {
            f.buckets.push(schema::Bucket {
                name: format!("caller{j}.proc{j}"),
                caller: Some(format!("caller{j}")),
                procedure: Some(format!("proc{j}")),
                scope: schema::Scope::Global,
                limit_rps: 100.0 + j as f64,
                mode: schema::Mode::Enforce,
                policy: schema::PolicyName::Peak,
            });
        }
        std::fs::write(
            dir.join("buckets").join(format!("{service}.yaml")),
            schema::render_bucket_file(&f),
        )?;
    }
    println!("{}: {n} services × 10 buckets", dir.display());
    Ok(())
}
