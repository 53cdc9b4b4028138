//! Real git repositories for tests: a bare "remote", served over `git://` by a real
//! `git daemon` (so server-side hooks such as `pre-receive` run, which libgit2's local
//! transport would skip), seeded from given files, plus helpers to act as a human from a
//! second clone with the `git` command line.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context, Result};

/// The name and e-mail the "human" helpers commit as.
pub const HUMAN_NAME: &str = "Hannah Human";
/// The e-mail the "human" helpers commit as.
pub const HUMAN_EMAIL: &str = "hannah@example.com";

/// A bare remote in a temp dir, served by `git daemon` on loopback, seeded with files.
pub struct GitRemote {
    dir: tempfile::TempDir,
    daemon: Child,
    port: u16,
    /// The base branch the remote was seeded on.
    pub branch: String,
}

/// Runs `git` in `dir` and returns stdout; fails with stderr on a non-zero exit.
pub fn git(dir: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .current_dir(dir)
        .args(args)
        // Tests must not depend on the machine's git identity or config.
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_AUTHOR_NAME", HUMAN_NAME)
        .env("GIT_AUTHOR_EMAIL", HUMAN_EMAIL)
        .env("GIT_COMMITTER_NAME", HUMAN_NAME)
        .env("GIT_COMMITTER_EMAIL", HUMAN_EMAIL)
        .output()
        .with_context(|| format!("running git {args:?} (is git installed?)"))?;
    if !out.status.success() {
        bail!(
            "git {:?} in {} failed: {}",
            args,
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn write_files(root: &Path, files: &[(&str, &str)]) -> Result<()> {
    for (rel, text) in files {
        let p = root.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

impl GitRemote {
    /// Creates `remote.git` (bare), pushes one commit with `files` on `branch`, and serves
    /// it with `git daemon --enable=receive-pack` on 127.0.0.1.
    pub fn new(branch: &str, files: &[(&str, &str)]) -> Result<GitRemote> {
        let dir = tempfile::tempdir()?;
        let bare = dir.path().join("remote.git");
        std::fs::create_dir_all(&bare)?;
        git(&bare, &["init", "--bare", "--quiet", "-b", branch])?;
        let seed = dir.path().join("seed");
        git(dir.path(), &["init", "--quiet", "-b", branch, "seed"])?;
        write_files(&seed, files)?;
        git(&seed, &["add", "-A"])?;
        git(&seed, &["commit", "--quiet", "-m", "seed"])?;
        git(&seed, &["push", "--quiet", bare.to_str().unwrap(), branch])?;
        std::fs::remove_dir_all(&seed)?;

        // git daemon needs a fixed port: take a free one from the OS, then hand it over.
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        // Its own process group: `git daemon` forks a `git-daemon` child per listen address,
        // and stopping the group stops them all.
        let mut daemon = crate::process::spawn_in_group(
            Command::new("git")
                .args([
                    "daemon",
                    "--reuseaddr",
                    "--verbose",
                    "--export-all",
                    "--enable=receive-pack",
                    "--listen=127.0.0.1",
                    &format!("--port={port}"),
                    &format!("--base-path={}", dir.path().display()),
                    &dir.path().display().to_string(),
                ])
                .env("GIT_CONFIG_NOSYSTEM", "1")
                .env("GIT_CONFIG_GLOBAL", "/dev/null")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                // `--verbose` logs one line per request: `upload_packs` counts the fetches.
                .stderr(std::fs::File::create(dir.path().join("daemon.log"))?),
        )
        .context("starting git daemon (Debian package git provides it)")?;
        // Wait until it accepts connections (bounded: it starts in milliseconds).
        let mut up = false;
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                up = true;
                break;
            }
            if let Some(st) = daemon.try_wait()? {
                bail!("git daemon exited early: {st}");
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        if !up {
            crate::process::stop_group(&mut daemon, crate::process::STOP_GRACE);
            bail!("git daemon did not listen on 127.0.0.1:{port}");
        }
        Ok(GitRemote {
            dir,
            daemon,
            port,
            branch: branch.to_string(),
        })
    }

    /// `git://127.0.0.1:PORT/remote.git`: what the code under test clones and pushes to.
    pub fn url(&self) -> String {
        format!("git://127.0.0.1:{}/remote.git", self.port)
    }

    /// The pid of the `git daemon` process, which leads the daemon's process group.
    pub fn daemon_pid(&self) -> u32 {
        self.daemon.id()
    }

    /// Fetches and clones served so far (`git-upload-pack` requests in the daemon's verbose
    /// log): how many times the code under test went to the remote for its refs and objects.
    pub fn upload_packs(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join("daemon.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("Request upload-pack"))
            .count()
    }

    /// The bare repository's directory.
    pub fn bare_path(&self) -> PathBuf {
        self.dir.path().join("remote.git")
    }

    /// A fresh path inside the fixture's temp dir (not created), e.g. for RLC's working copy.
    pub fn scratch(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Installs a `pre-receive` hook that prints `message` and exits 1.
    pub fn reject_pushes(&self, message: &str) -> Result<()> {
        let hook = self.bare_path().join("hooks/pre-receive");
        std::fs::create_dir_all(hook.parent().unwrap())?;
        std::fs::write(&hook, format!("#!/bin/sh\necho '{message}' >&2\nexit 1\n"))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755))?;
        Ok(())
    }

    /// Installs a `pre-receive` hook that, for the next `times` pushes, first pushes another
    /// commit to the base branch itself (from a clone, as a concurrent pusher would), so that
    /// the server then answers the original push with "failed to update ref". The racing
    /// commits write `race/<n>.txt`; the hook does nothing for its own nested push.
    pub fn race_pushes(&self, times: u32) -> Result<()> {
        let bare = self.bare_path();
        std::fs::write(bare.join("races-left"), format!("{times}\n"))?;
        let hook = bare.join("hooks/pre-receive");
        std::fs::create_dir_all(hook.parent().unwrap())?;
        let script = format!(
            r#"#!/bin/sh
cat >/dev/null
repo="$PWD"
[ -e "$repo/racing" ] && exit 0
left=$(cat "$repo/races-left")
[ "$left" -gt 0 ] || exit 0
echo $((left - 1)) > "$repo/races-left"
touch "$repo/racing"
(
  unset GIT_QUARANTINE_PATH GIT_OBJECT_DIRECTORY GIT_ALTERNATE_OBJECT_DIRECTORIES GIT_DIR
  export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null
  export GIT_AUTHOR_NAME='{HUMAN_NAME}' GIT_AUTHOR_EMAIL='{HUMAN_EMAIL}'
  export GIT_COMMITTER_NAME='{HUMAN_NAME}' GIT_COMMITTER_EMAIL='{HUMAN_EMAIL}'
  tmp=$(mktemp -d)
  git clone -q --branch '{branch}' "$repo" "$tmp/c" &&
    cd "$tmp/c" && mkdir -p race && echo "$left" > "race/$left.txt" &&
    git add -A && git commit -q -m "racer $left" &&
    git push -q origin 'HEAD:refs/heads/{branch}'
  rc=$?
  rm -rf "$tmp"
  exit $rc
) >&2
rc=$?
rm -f "$repo/racing"
exit $rc
"#,
            branch = self.branch
        );
        std::fs::write(&hook, script)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755))?;
        Ok(())
    }

    /// The commit `branch` points at in the remote, if the branch exists.
    pub fn head(&self, branch: &str) -> Option<String> {
        git(
            &self.bare_path(),
            &[
                "rev-parse",
                "--verify",
                "--quiet",
                &format!("refs/heads/{branch}"),
            ],
        )
        .ok()
        .map(|s| s.trim().to_string())
    }

    /// Number of commits on `branch` in the remote.
    pub fn commit_count(&self, branch: &str) -> Result<usize> {
        let out = git(
            &self.bare_path(),
            &["rev-list", "--count", &format!("refs/heads/{branch}")],
        )?;
        Ok(out.trim().parse()?)
    }

    /// The content of `path` at the tip of `branch` in the remote.
    pub fn read(&self, branch: &str, path: &str) -> Result<String> {
        git(
            &self.bare_path(),
            &["show", &format!("refs/heads/{branch}:{path}")],
        )
    }

    /// Every file at the tip of `branch` in the remote with its blob id, by path.
    pub fn tree(&self, branch: &str) -> Result<std::collections::BTreeMap<String, String>> {
        let out = git(
            &self.bare_path(),
            &[
                "ls-tree",
                "-r",
                "--full-tree",
                &format!("refs/heads/{branch}"),
            ],
        )?;
        // `<mode> <type> <id>\t<path>`
        out.lines()
            .map(|l| {
                let (meta, path) = l
                    .split_once('\t')
                    .ok_or_else(|| anyhow::anyhow!("ls-tree line `{l}`"))?;
                let id = meta
                    .split(' ')
                    .nth(2)
                    .ok_or_else(|| anyhow::anyhow!("ls-tree line `{l}`"))?;
                Ok((path.to_string(), id.to_string()))
            })
            .collect()
    }

    /// `git log --format=%an|%ae|%s` of `branch` in the remote, newest first.
    pub fn log(&self, branch: &str) -> Result<Vec<String>> {
        let out = git(
            &self.bare_path(),
            &[
                "log",
                "--format=%an|%ae|%s",
                &format!("refs/heads/{branch}"),
            ],
        )?;
        Ok(out.lines().map(str::to_string).collect())
    }

    /// Commits `files` as the human on `branch` from a fresh second clone and pushes them.
    /// Creates the branch from the base branch when it does not exist yet. Returns the new
    /// commit id.
    pub fn human_commit(
        &self,
        branch: &str,
        files: &[(&str, &str)],
        message: &str,
    ) -> Result<String> {
        let clone = tempfile::tempdir()?;
        let work = clone.path().join("human");
        git(
            clone.path(),
            &[
                "clone",
                "--quiet",
                self.bare_path().to_str().unwrap(),
                "human",
            ],
        )?;
        if self.head(branch).is_some() {
            git(&work, &["checkout", "--quiet", branch])?;
        } else {
            git(&work, &["checkout", "--quiet", "-b", branch])?;
        }
        write_files(&work, files)?;
        git(&work, &["add", "-A"])?;
        git(&work, &["commit", "--quiet", "-m", message])?;
        git(
            &work,
            &[
                "push",
                "--quiet",
                "origin",
                &format!("HEAD:refs/heads/{branch}"),
            ],
        )?;
        Ok(git(&work, &["rev-parse", "HEAD"])?.trim().to_string())
    }

    /// Merges `branch` into the base branch as the human (a merge commit), as a person
    /// merging a pull request would.
    pub fn human_merge(&self, branch: &str) -> Result<String> {
        let clone = tempfile::tempdir()?;
        let work = clone.path().join("human");
        git(
            clone.path(),
            &[
                "clone",
                "--quiet",
                self.bare_path().to_str().unwrap(),
                "human",
            ],
        )?;
        git(&work, &["checkout", "--quiet", &self.branch])?;
        git(
            &work,
            &[
                "merge",
                "--quiet",
                "--no-ff",
                "-m",
                "merge",
                &format!("origin/{branch}"),
            ],
        )?;
        git(&work, &["push", "--quiet", "origin", &self.branch])?;
        Ok(git(&work, &["rev-parse", "HEAD"])?.trim().to_string())
    }
}

impl Drop for GitRemote {
    fn drop(&mut self) {
        crate::process::stop_group(&mut self.daemon, crate::process::STOP_GRACE);
    }
}

/// A minimal valid config repo: a peak default policy and one bucket file per `(service,
/// bucket, limit)`.
pub fn minimal_repo_files(buckets: &[(&str, &str, f64)]) -> Vec<(String, String)> {
    let mut files = vec![(
        "rlc/policies.yaml".to_string(),
        "default:\n  policy: peak\n  headroom: 0.25\n".to_string(),
    )];
    let mut by_service: std::collections::BTreeMap<&str, String> = Default::default();
    for (svc, name, limit) in buckets {
        let e = by_service.entry(svc).or_default();
        e.push_str(&format!(
            "  - name: {name}\n    caller: {name}\n    scope: global\n    limit_rps: {limit}\n    mode: enforce\n    policy: peak\n"
        ));
    }
    for (svc, body) in by_service {
        files.push((
            format!("buckets/{svc}.yaml"),
            format!("service: {svc}\nbuckets:\n{body}"),
        ));
    }
    files
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::group_members;
    use std::time::{Duration, Instant};

    /// `(ppid, state)` of `pid` from `/proc/PID/stat`.
    fn ppid_state(pid: u32) -> Option<(u32, String)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (_, rest) = stat.rsplit_once(')')?;
        let f: Vec<&str> = rest.split_whitespace().collect();
        Some((f.get(1)?.parse().ok()?, f.first()?.to_string()))
    }

    /// Running processes whose parent is `pid`.
    fn children(pid: u32) -> Vec<u32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|c| matches!(ppid_state(*c), Some((p, st)) if p == pid && st != "Z"))
            .collect()
    }

    fn running(pid: u32) -> bool {
        matches!(ppid_state(pid), Some((_, st)) if st != "Z" && st != "X")
    }

    #[test]
    fn dropping_a_git_remote_stops_the_daemon_and_its_children() {
        let remote = GitRemote::new("main", &[("README", "hi\n")]).unwrap();
        let leader = remote.daemon_pid();
        // `git daemon` execs or forks `git-daemon`; wait until that child exists.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut kids = children(leader);
        while kids.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            kids = children(leader);
        }
        assert!(!kids.is_empty(), "git daemon {leader} has no child process");
        let group = group_members(leader);
        assert!(
            group.contains(&leader) && kids.iter().all(|k| group.contains(k)),
            "the daemon and its children share one process group led by {leader}: group {group:?}, children {kids:?}"
        );
        drop(remote);
        let left: Vec<u32> = kids.into_iter().filter(|k| running(*k)).collect();
        assert!(
            left.is_empty(),
            "git daemon children still running: {left:?}"
        );
        assert!(
            group_members(leader).is_empty(),
            "process group {leader} still has members: {:?}",
            group_members(leader)
        );
    }
}
