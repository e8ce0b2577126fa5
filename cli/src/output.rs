//! Writing the CLI's files: named after the request (and node) they come from, checked
//! against what the directory already holds before any is written, each renamed into place
//! atomically, readable by others like any downloaded file (0644).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// One file to write into the output directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputFile {
    /// A plain file name (no directory).
    pub name: String,
    /// Its content.
    pub bytes: Vec<u8>,
}

/// The local file name of a request's artifact: `<request>-<node>.<ext>` for the agent's
/// `<type>-<node>.<ext>`, so that two requests' artifacts never share a name in one
/// directory (pure). An artifact named otherwise keeps its name after `<request>-`.
pub fn artifact_file_name(request: &str, profile_type: &str, artifact: &str) -> String {
    match artifact
        .strip_prefix(profile_type)
        .and_then(|r| r.strip_prefix('-'))
    {
        Some(rest) if !rest.is_empty() => format!("{request}-{rest}"),
        _ => format!("{request}-{artifact}"),
    }
}

/// The file name without the extensions the CLI knows (`.pb.gz`, `.pb`, `.txt`), the stem
/// of the rendered files (pure).
pub fn stem(name: &str) -> &str {
    [".pb.gz", ".pb", ".txt"]
        .iter()
        .find_map(|ext| name.strip_suffix(ext))
        .unwrap_or(name)
}

/// What writing `files` into `dir` would do to each (pure but for reading what is there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// The file is new, or `--force` replaces it.
    Write,
    /// The file is there with this very content: nothing to do.
    Same,
}

/// Checks every file against `dir` before any is written.
///
/// # Errors
/// [`Error::Usage`] for a name that is not a plain file name; [`Error::WouldOverwrite`] for
/// the first file that exists with other content when `force` is false.
pub fn plan(dir: &Path, files: &[OutputFile], force: bool) -> Result<Vec<Plan>> {
    files
        .iter()
        .map(|f| {
            let path = dir.join(plain(&f.name)?);
            match std::fs::read(&path) {
                Ok(existing) if existing == f.bytes => Ok(Plan::Same),
                Ok(_) if !force => Err(Error::WouldOverwrite { path }),
                Ok(_) => Ok(Plan::Write),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Plan::Write),
                Err(e) => Err(Error::io(format!("reading {}", path.display()))(e)),
            }
        })
        .collect()
}

/// Writes `files` into `dir` (created if missing) once [`plan`] found nothing in the way;
/// returns the paths, each printed to `out` as `wrote PATH` (or `unchanged PATH`).
///
/// # Errors
/// As [`plan`]; [`Error::Io`] when a file cannot be written.
pub fn write_all(
    dir: &Path,
    files: &[OutputFile],
    force: bool,
    out: &mut dyn std::io::Write,
) -> Result<Vec<PathBuf>> {
    let plans = plan(dir, files, force)?;
    std::fs::create_dir_all(dir).map_err(Error::io(format!("creating {}", dir.display())))?;
    let mut written = Vec::with_capacity(files.len());
    for (f, plan) in files.iter().zip(plans) {
        let path = dir.join(plain(&f.name)?);
        match plan {
            Plan::Same => {
                let _ = writeln!(out, "unchanged {}", path.display());
            }
            Plan::Write => {
                write_atomic(dir, &path, &f.bytes)?;
                let _ = writeln!(out, "wrote {}", path.display());
            }
        }
        written.push(path);
    }
    Ok(written)
}

/// Names come from the status or the command line: never let one escape the directory.
fn plain(name: &str) -> Result<&std::ffi::OsStr> {
    Path::new(name)
        .file_name()
        .filter(|f| *f == std::ffi::OsStr::new(name))
        .ok_or_else(|| Error::Usage(format!("{name:?} is not a plain file name")))
}

/// Writes `bytes` to `path` in `dir`: a temporary file in `dir`, mode 0644, renamed over
/// `path`.
fn write_atomic(dir: &Path, path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(Error::io(format!(
        "creating a temporary file in {}",
        dir.display()
    )))?;
    tmp.write_all(bytes)
        .map_err(Error::io(format!("writing {}", path.display())))?;
    // tempfile creates 0600; a profile is no secret of its reader's.
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(0o644))
        .map_err(Error::io(format!("setting the mode of {}", path.display())))?;
    tmp.persist(path)
        .map_err(|e| Error::io(format!("renaming into {}", path.display()))(e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn artifact_names_carry_the_request() {
        assert_eq!(
            artifact_file_name("cpu-vfdxk", "cpu", "cpu-vm.pb.gz"),
            "cpu-vfdxk-vm.pb.gz"
        );
        assert_eq!(
            artifact_file_name("rq", "runqlat", "runqlat-node-a.txt"),
            "rq-node-a.txt"
        );
        assert_eq!(
            artifact_file_name("x", "heap", "other.pb.gz"),
            "x-other.pb.gz"
        );
        assert_eq!(stem("a-n.pb.gz"), "a-n");
        assert_eq!(stem("a-n.txt"), "a-n");
        assert_eq!(stem("a.svg"), "a.svg");
    }

    #[test]
    fn other_content_is_refused_without_force_and_nothing_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, bytes: &[u8]| OutputFile {
            name: name.into(),
            bytes: bytes.to_vec(),
        };
        let mut out = Vec::new();
        write_all(dir.path(), &[file("a.pb.gz", b"one")], false, &mut out).unwrap();
        let mode = std::fs::metadata(dir.path().join("a.pb.gz"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644);
        // The same content again: fine, and said so.
        write_all(dir.path(), &[file("a.pb.gz", b"one")], false, &mut out).unwrap();
        assert!(String::from_utf8_lossy(&out).contains("unchanged"));
        // Other content: refused before `b` is written.
        let err = write_all(
            dir.path(),
            &[file("b.svg", b"b"), file("a.pb.gz", b"two")],
            false,
            &mut out,
        )
        .unwrap_err();
        assert_eq!(err.exit_code(), 12, "{err}");
        assert!(!dir.path().join("b.svg").exists());
        assert_eq!(std::fs::read(dir.path().join("a.pb.gz")).unwrap(), b"one");
        write_all(dir.path(), &[file("a.pb.gz", b"two")], true, &mut out).unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.pb.gz")).unwrap(), b"two");
        assert!(plan(dir.path(), &[file("../x", b"")], false).is_err());
    }
}
