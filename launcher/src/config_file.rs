//! The cluster's defaults: `config.toml` files an operator writes once (the rendezvous service's
//! endpoint, its token file, …) so that `rlaunch --nproc-per-node 4 --nnodes 2 train` joins it.
//!
//! Files, each overriding the one before: `/etc/rlaunch/config.toml`,
//! `$XDG_CONFIG_HOME/rlaunch/config.toml` (default `~/.config`), and the file `$RLAUNCH_CONFIG`
//! names. Keys are the long flag names (`rdzv-endpoint` or `rdzv_endpoint`); values are strings,
//! numbers or booleans. A flag beats its environment variable, which beats the files: a file's
//! value is used only where the command line and the environment say nothing.
//!
//! A file others could have written is not the operator's: one writable by every user or by a
//! group other than root's and the runner's (or in a directory they can write, sticky
//! directories like `/tmp` excepted), or owned by a user other than root and the one running.
//! Running as root, such a file named by `$RLAUNCH_CONFIG` is refused, and a default one (a
//! user's own `~/.config` under `sudo -E`) is skipped with a warning; otherwise it is used with
//! a warning.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// One setting a file gave, and which file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSetting {
    pub value: String,
    pub file: PathBuf,
}

/// The files to read, in order, given the environment.
pub fn config_paths(env: &dyn Fn(&str) -> Option<String>) -> Vec<(PathBuf, bool)> {
    let mut paths = vec![(PathBuf::from("/etc/rlaunch/config.toml"), false)];
    let xdg = env("XDG_CONFIG_HOME")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| Path::new(&h).join(".config")));
    if let Some(x) = xdg {
        paths.push((x.join("rlaunch/config.toml"), false));
    }
    if let Some(f) = env("RLAUNCH_CONFIG").filter(|s| !s.is_empty()) {
        // Named on purpose: it must exist.
        paths.push((PathBuf::from(f), true));
    }
    paths
}

/// Reads the files into `long flag name → setting`, later files winning. `known` says which
/// keys exist (long flag names with dashes). Warnings about files others could have written go
/// to stderr (this runs before logging is set up).
pub fn load(
    paths: &[(PathBuf, bool)],
    known: &dyn Fn(&str) -> bool,
) -> Result<BTreeMap<String, FileSetting>, UsageError> {
    // SAFETY: geteuid and getegid have no preconditions and cannot fail.
    let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
    load_as(paths, known, Runner { uid: euid, gid: egid }, &mut |w| eprintln!("rlaunch: warning: {w}"))
}

/// Who runs rlaunch: the effective user and group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Runner {
    pub uid: u32,
    pub gid: u32,
}

/// [`load`] for `runner`, each warning handed to `warn`.
pub fn load_as(
    paths: &[(PathBuf, bool)],
    known: &dyn Fn(&str) -> bool,
    runner: Runner,
    warn: &mut dyn FnMut(String),
) -> Result<BTreeMap<String, FileSetting>, UsageError> {
    let mut out = BTreeMap::new();
    for (path, required) in paths {
        let cannot_read =
            |e: std::io::Error| UsageError(format!("cannot read the config file {}: {e}", path.display()));
        let mut file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => continue,
            Err(e) => return Err(cannot_read(e)),
        };
        // The open file itself is judged (not the path again), then every directory above it.
        let mut owners = vec![(path.clone(), Owner::of(&file.metadata().map_err(cannot_read)?))];
        for dir in directories_above(path) {
            let meta = std::fs::metadata(&dir).map_err(cannot_read)?;
            owners.push((dir, Owner::of(&meta)));
        }
        if let Some(why) = owners.iter().find_map(|(p, o)| o.untrusted(runner).map(|why| (p, why))) {
            let (what, why) = why;
            let msg = format!(
                "config file {}: {} {why}, so someone else could have chosen these settings",
                path.display(),
                if what == path { "it is".to_string() } else { format!("the directory {} is", what.display()) }
            );
            match (runner.uid, required) {
                (0, true) => {
                    return Err(UsageError(format!(
                        "{msg}; refusing to use it as root (make it and its directories writable only by root)"
                    )))
                }
                (0, false) => {
                    warn(format!("{msg}; not used as root"));
                    continue;
                }
                _ => warn(msg),
            }
        }
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(cannot_read)?;
        for (key, value) in parse(&text, path, known)? {
            out.insert(key, FileSetting { value, file: path.clone() });
        }
    }
    Ok(out)
}

/// Who owns a file or directory and who may write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
    pub is_dir: bool,
}

impl Owner {
    fn of(meta: &std::fs::Metadata) -> Self {
        Owner { uid: meta.uid(), gid: meta.gid(), mode: meta.mode(), is_dir: meta.is_dir() }
    }

    /// Why someone other than root and `runner` could have written it, if they could.
    pub fn untrusted(&self, runner: Runner) -> Option<String> {
        const OTHERS_WRITE: u32 = 0o002;
        const GROUP_WRITE: u32 = 0o020;
        const STICKY: u32 = 0o1000;
        // In a sticky directory (`/tmp`) others may add entries but not replace ours; the entry
        // itself is judged on its own.
        let sticky_dir = self.is_dir && self.mode & STICKY != 0;
        if self.mode & OTHERS_WRITE != 0 && !sticky_dir {
            return Some(format!("writable by every user (mode {:o})", self.mode & 0o7777));
        }
        if self.mode & GROUP_WRITE != 0 && self.gid != 0 && self.gid != runner.gid && !sticky_dir {
            return Some(format!("writable by group {} (mode {:o})", self.gid, self.mode & 0o7777));
        }
        if self.uid != 0 && self.uid != runner.uid {
            return Some(format!("owned by another user (uid {})", self.uid));
        }
        None
    }
}

/// Every directory above `path`, nearest first, by the absolute path as given and again by the
/// path with its symbolic links resolved (a link's target is a different directory).
fn directories_above(path: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let real = std::fs::canonicalize(path).ok();
    for p in [Some(absolute), real].into_iter().flatten() {
        for dir in p.ancestors().skip(1) {
            if !dir.as_os_str().is_empty() && !out.iter().any(|d| d == dir) {
                out.push(dir.to_path_buf());
            }
        }
    }
    out
}

/// One file's settings.
pub fn parse(text: &str, path: &Path, known: &dyn Fn(&str) -> bool) -> Result<Vec<(String, String)>, UsageError> {
    let table: toml::Table = toml::from_str(text)
        .map_err(|e| UsageError(format!("config file {} is not valid TOML: {e}", path.display())))?;
    let mut out = Vec::new();
    for (key, value) in table {
        let name = key.replace('_', "-");
        if !known(&name) {
            return Err(UsageError(format!(
                "config file {}: unknown setting `{key}` (settings are rlaunch's long flag names, e.g. rdzv-endpoint)",
                path.display()
            )));
        }
        let value = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(UsageError(format!(
                    "config file {}: `{key}` must be a string, number or boolean, not {}",
                    path.display(),
                    other.type_str()
                )))
            }
        };
        out.push((name, value));
    }
    Ok(out)
}

/// A command line (or config file) that parses but makes no sense: reported like a clap
/// error, exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(k: &str) -> bool {
        ["rdzv-endpoint", "max-restarts", "standalone"].contains(&k)
    }

    #[test]
    fn reads_flag_names_in_either_spelling_and_plain_values() {
        let got =
            parse("rdzv_endpoint = \"svc:29400\"\nmax-restarts = 3\nstandalone = false\n", Path::new("f"), &known)
                .unwrap();
        assert_eq!(
            got,
            [
                ("max-restarts".to_string(), "3".to_string()),
                ("rdzv-endpoint".to_string(), "svc:29400".to_string()),
                ("standalone".to_string(), "false".to_string())
            ]
        );
    }

    #[test]
    fn refuses_unknown_keys_tables_and_bad_toml_naming_the_file() {
        let e = parse("rdzv_endpont = \"x\"", Path::new("/etc/rlaunch/config.toml"), &known).unwrap_err();
        assert!(e.0.contains("unknown setting `rdzv_endpont`") && e.0.contains("/etc/rlaunch/config.toml"), "{e}");
        assert!(parse("max-restarts = [1]", Path::new("f"), &known).unwrap_err().0.contains("must be a string"));
        assert!(parse("= nope", Path::new("f"), &known).unwrap_err().0.contains("not valid TOML"));
    }

    /// A fresh directory only the test's user can write, removed on drop.
    struct Scratch(PathBuf);
    impl Scratch {
        fn new(name: &str) -> Self {
            use std::os::unix::fs::PermissionsExt;
            let dir = std::env::temp_dir().join(format!("rlaunch-config-{name}-{}", std::process::id()));
            std::fs::remove_dir_all(&dir).ok();
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
            Scratch(dir)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            std::fs::remove_dir_all(&self.0).ok();
        }
    }

    fn chmod(p: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    const ROOT: Runner = Runner { uid: 0, gid: 0 };

    fn me() -> u32 {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() }
    }

    #[test]
    fn refuses_a_world_writable_config_file_as_root_and_warns_otherwise() {
        let dir = Scratch::new("world-writable");
        let file = dir.0.join("config.toml");
        std::fs::write(&file, "rdzv-endpoint = \"evil:1\"\n").unwrap();
        chmod(&file, 0o666);
        let paths = [(file.clone(), true)];
        let mut warnings = Vec::new();
        let e = load_as(&paths, &known, ROOT, &mut |w| warnings.push(w)).unwrap_err();
        assert!(e.0.contains(&file.display().to_string()) && e.0.contains("writable by every user"), "{e}");
        assert!(e.0.contains("refusing to use it as root"), "{e}");
        // A default file (not named by RLAUNCH_CONFIG) is skipped as root, with a warning.
        let got = load_as(&[(file.clone(), false)], &known, ROOT, &mut |w| warnings.push(w)).unwrap();
        assert!(got.is_empty(), "{got:?}");
        assert!(warnings.len() == 1 && warnings[0].contains("not used as root"), "{warnings:?}");
        warnings.clear();

        // Run by a plain user: used, with a warning naming the file. The file belongs to the
        // test's user, so that is the plain user (a made-up one where the test runs as root).
        let plain = Runner { uid: if me() == 0 { 4242 } else { me() }, gid: 4242 };
        let got = load_as(&paths, &known, plain, &mut |w| warnings.push(w)).unwrap();
        assert_eq!(got["rdzv-endpoint"].value, "evil:1");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains(&file.display().to_string()) && warnings[0].contains("mode 666"), "{warnings:?}");

        // Writable only by its owner: used without a word, as root too (where the owner is root).
        chmod(&file, 0o644);
        warnings.clear();
        assert!(load_as(&paths, &known, Runner { uid: me(), gid: 0 }, &mut |w| warnings.push(w)).is_ok());
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[test]
    fn refuses_a_config_file_in_a_directory_others_can_write_naming_both() {
        let dir = Scratch::new("open-dir");
        let sub = dir.0.join("rlaunch");
        std::fs::create_dir(&sub).unwrap();
        let file = sub.join("config.toml");
        std::fs::write(&file, "max-restarts = 3\n").unwrap();
        chmod(&file, 0o644);
        chmod(&sub, 0o777);
        let e = load_as(&[(file.clone(), true)], &known, ROOT, &mut |_| {}).unwrap_err();
        assert!(e.0.contains(&file.display().to_string()) && e.0.contains(&sub.display().to_string()), "{e}");
        // Sticky (like /tmp): others cannot replace the file, so it is fine.
        chmod(&sub, 0o1777);
        let mut warnings = Vec::new();
        let got =
            load_as(&[(file.clone(), true)], &known, Runner { uid: me(), gid: 0 }, &mut |w| warnings.push(w)).unwrap();
        assert_eq!(got["max-restarts"].value, "3");
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[test]
    fn a_file_owned_by_another_plain_user_is_untrusted_but_root_and_ones_own_are_not() {
        let file = |uid: u32, mode: u32| Owner { uid, gid: 0, mode: 0o100000 | mode, is_dir: false };
        let user = |uid: u32| Runner { uid, gid: 100 };
        assert!(file(1001, 0o644).untrusted(ROOT).unwrap().contains("owned by another user (uid 1001)"));
        assert!(file(1001, 0o644).untrusted(user(1002)).is_some());
        assert_eq!(file(1001, 0o644).untrusted(user(1001)), None);
        assert_eq!(file(0, 0o644).untrusted(user(1001)), None);
        assert!(file(0, 0o646).untrusted(user(1001)).unwrap().contains("mode 646"));
        let dir = |mode: u32| Owner { uid: 0, gid: 0, mode: 0o040000 | mode, is_dir: true };
        assert!(dir(0o777).untrusted(ROOT).is_some());
        assert_eq!(dir(0o1777).untrusted(ROOT), None);
        assert_eq!(dir(0o775).untrusted(ROOT), None, "root's group");
        // Group-writable by another group (root:users 0664): its members could have written it.
        let grouped = |gid: u32, mode: u32| Owner { uid: 0, gid, mode: 0o100000 | mode, is_dir: false };
        assert!(grouped(100, 0o664).untrusted(ROOT).unwrap().contains("writable by group 100 (mode 664)"));
        assert_eq!(grouped(100, 0o664).untrusted(user(1001)), None, "the runner's own group");
        assert_eq!(grouped(100, 0o644).untrusted(ROOT), None);
    }

    #[test]
    fn later_files_win_and_a_named_file_must_exist() {
        let dir = std::env::temp_dir().join(format!("rlaunch-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.toml"), dir.join("b.toml"));
        std::fs::write(&a, "rdzv-endpoint = \"a:1\"\nmax-restarts = 1\n").unwrap();
        std::fs::write(&b, "rdzv-endpoint = \"b:2\"\n").unwrap();
        let got = load(&[(a.clone(), false), (dir.join("missing.toml"), false), (b.clone(), false)], &known).unwrap();
        assert_eq!(got["rdzv-endpoint"], FileSetting { value: "b:2".into(), file: b });
        assert_eq!(got["max-restarts"].file, a);
        assert!(load(&[(dir.join("missing.toml"), true)], &known).is_err());
        let env = |k: &str| match k {
            "HOME" => Some("/home/u".to_string()),
            "RLAUNCH_CONFIG" => Some("/x.toml".to_string()),
            _ => None,
        };
        let paths: Vec<PathBuf> = config_paths(&env).into_iter().map(|(p, _)| p).collect();
        assert_eq!(
            paths,
            [PathBuf::from("/etc/rlaunch/config.toml"), "/home/u/.config/rlaunch/config.toml".into(), "/x.toml".into()]
        );
        std::fs::remove_dir_all(dir).ok();
    }
}
