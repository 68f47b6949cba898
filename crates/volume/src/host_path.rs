//! The hostPath plugin (`pkg/volume/hostpath`): containers bind-mount the
//! node's path itself; set-up only checks (or creates) it by its `type`
//! (`checkTypeInternal`): `DirectoryOrCreate` makes a 0755 directory,
//! `FileOrCreate` an empty 0644 file, `Directory`, `File`, `Socket`,
//! `CharDevice`, `BlockDevice` must be one (symlinks followed), with the
//! kubelet's messages (`hostPath type check failed: /x is not a
//! directory`); unset checks nothing. Tear-down leaves the path.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use async_trait::async_trait;

use super::plugin::{Attributes, PluginError, SetUpArgs, Spec, TearDownArgs, VolumePlugin};

pub const PLUGIN_NAME: &str = "kubernetes.io/host-path";

#[derive(Debug)]
pub struct HostPathPlugin;

fn source(spec: &Spec) -> Option<(PathBuf, String)> {
    if let Some(h) = spec.inline().and_then(|v| v.host_path.as_ref()) {
        return Some((PathBuf::from(&h.path), h.type_.clone().unwrap_or_default()));
    }
    let h = spec
        .persistent_volume()?
        .spec
        .as_ref()?
        .host_path
        .as_ref()?;
    Some((PathBuf::from(&h.path), h.type_.clone().unwrap_or_default()))
}

/// The type check (`checkTypeInternal`).
pub fn check_type(path: &Path, kind: &str) -> Result<(), PluginError> {
    let fail = |what: &str| {
        Err(PluginError::Failed(format!(
            "hostPath type check failed: {} is not {what}",
            path.display()
        )))
    };
    let meta = std::fs::metadata(path).ok();
    let t = meta.as_ref().map(|m| m.file_type());
    match kind {
        "" => Ok(()),
        "DirectoryOrCreate" if meta.is_none() => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(path)
            .map_err(PluginError::io("create", path)),
        "DirectoryOrCreate" | "Directory" => match t {
            Some(t) if t.is_dir() => Ok(()),
            _ => fail("a directory"),
        },
        "FileOrCreate" if meta.is_none() => std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(path)
            .map(drop)
            .map_err(PluginError::io("create", path)),
        "FileOrCreate" | "File" => match t {
            Some(t) if t.is_file() => Ok(()),
            _ => fail("a file"),
        },
        "Socket" => match t {
            Some(t) if t.is_socket() => Ok(()),
            _ => fail("a socket file"),
        },
        "CharDevice" => match t {
            Some(t) if t.is_char_device() => Ok(()),
            _ => fail("a character device"),
        },
        "BlockDevice" => match t {
            Some(t) if t.is_block_device() => Ok(()),
            _ => fail("a block device"),
        },
        other => Err(PluginError::Failed(format!(
            "{other} is an invalid volume type"
        ))),
    }
}

#[async_trait]
impl VolumePlugin for HostPathPlugin {
    fn name(&self) -> &'static str {
        PLUGIN_NAME
    }

    fn can_support(&self, spec: &Spec) -> bool {
        source(spec).is_some()
    }

    fn attributes(&self, spec: &Spec) -> Attributes {
        Attributes {
            read_only: spec.read_only,
            managed: false,
        }
    }

    fn host_path(&self, spec: &Spec, dir: &Path) -> PathBuf {
        source(spec)
            .map(|(p, _)| p)
            .unwrap_or_else(|| dir.to_path_buf())
    }

    async fn set_up(&self, args: SetUpArgs<'_>) -> Result<(), PluginError> {
        let (path, kind) = source(args.spec).ok_or_else(|| {
            PluginError::Failed(format!("volume {:?} is no hostPath", args.spec.name))
        })?;
        check_type(&path, &kind)
    }

    async fn tear_down(&self, _: TearDownArgs<'_>) -> Result<(), PluginError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_checks_as_the_kubelet() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("d");
        let file = root.path().join("f");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(&file, "x").unwrap();
        let sock = root.path().join("s");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let missing = root.path().join("missing");
        let cases: [(&Path, &str, Option<&str>); 14] = [
            (&dir, "", None),
            (&missing, "", None),
            (&dir, "Directory", None),
            (&file, "Directory", Some("is not a directory")),
            (&missing, "Directory", Some("is not a directory")),
            (&file, "File", None),
            (&dir, "File", Some("is not a file")),
            (&dir, "FileOrCreate", Some("is not a file")),
            (&file, "DirectoryOrCreate", Some("is not a directory")),
            (&sock, "Socket", None),
            (&file, "Socket", Some("is not a socket file")),
            (Path::new("/dev/null"), "CharDevice", None),
            (&file, "BlockDevice", Some("is not a block device")),
            (&dir, "Pipe", Some("Pipe is an invalid volume type")),
        ];
        for (path, kind, err) in cases {
            let got = check_type(path, kind).err().map(|e| e.to_string());
            match (got, err) {
                (None, None) => {}
                (Some(g), Some(w)) => {
                    assert!(g.contains(w), "{kind} {}: {g}", path.display());
                    if w.starts_with("is not") {
                        assert_eq!(
                            g,
                            format!("hostPath type check failed: {} {w}", path.display())
                        );
                    }
                }
                (g, w) => panic!("{kind} {}: got {g:?}, want {w:?}", path.display()),
            }
        }
        // The *OrCreate types create what is missing.
        let new_dir = root.path().join("new/dir");
        check_type(&new_dir, "DirectoryOrCreate").unwrap();
        assert!(new_dir.is_dir());
        let new_file = root.path().join("new/file");
        check_type(&new_file, "FileOrCreate").unwrap();
        assert!(new_file.is_file());
    }
}
