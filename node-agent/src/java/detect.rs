//! Whether a process runs a HotSpot JVM, and whether it may be signalled to start its
//! attach listener.
//!
//! SIGQUIT kills a process that does not catch it. HotSpot catches it (to print thread
//! dumps and start its attach listener) only once its signal dispatcher runs, and never
//! under `-Xrs` / `-XX:+ReduceSignalUsage`; other programs use it for their own ends (a
//! graceful stop in nginx, php-fpm, gunicorn). So the agent signals a process only when
//! all of these hold, each read from the kernel or the JVM's own binary rather than from
//! a name the workload chose:
//! * it maps a `libjvm.so` that is HotSpot's: the file exports `JVM_handle_linux_signal`
//!   (a file merely called `libjvm.so` does not);
//! * the kernel says it catches SIGQUIT (`SigCgt` of `/proc/<pid>/status`) and neither
//!   ignores nor blocks it process-wide;
//! * one of its threads is HotSpot's signal dispatcher (`Signal Dispatch`, the name the
//!   JVM gives the thread that serves SIGQUIT once it is started);
//! * its command line and launcher variables do not turn the attach mechanism off
//!   (`-XX:+DisableAttachMechanism`: SIGQUIT would then print a thread dump).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use object::{Object as _, ObjectSymbol as _};

use crate::process::files::BoundedReader;
use crate::process::{Binary, ProcessMaps};

/// Largest single read of `libjvm.so` while looking for its symbols.
const MAX_READ: u64 = 64 << 20;
/// Bytes read from one `libjvm.so` at most.
const READ_BUDGET: u64 = 128 << 20;
/// Binaries whose verdict is remembered (by build ID).
const MAX_REMEMBERED: usize = 256;
/// Threads looked at for the signal dispatcher.
const MAX_THREADS: usize = 16_384;
/// Bytes of `/proc/<pid>/cmdline` and of `/proc/<pid>/environ` read.
const MAX_ARGS: u64 = 256 << 10;
/// A symbol every HotSpot `libjvm.so` exports (its signal handler's entry point).
const HOTSPOT_SYMBOL: &str = "JVM_handle_linux_signal";
/// The name HotSpot gives its signal dispatcher thread (15 bytes of "Signal Dispatcher").
const SIGNAL_DISPATCHER: &str = "Signal Dispatch";
/// Variables the `java` launcher and the JVM read options from.
const OPTION_VARIABLES: [&str; 3] = ["JAVA_TOOL_OPTIONS", "JDK_JAVA_OPTIONS", "_JAVA_OPTIONS"];

/// The HotSpot library mapped by `maps`: a `libjvm.so` exporting [`HOTSPOT_SYMBOL`].
pub fn hotspot_library(maps: &ProcessMaps, tgid: u32) -> Option<Arc<Binary>> {
    let bin = maps.ranges.iter().find_map(|r| {
        let bin = r.binary.as_ref()?;
        (bin.path.rsplit('/').next() == Some("libjvm.so")).then(|| bin.clone())
    })?;
    is_hotspot(&bin, tgid).then_some(bin)
}

/// Whether `bin` exports [`HOTSPOT_SYMBOL`], remembered by build ID.
fn is_hotspot(bin: &Binary, tgid: u32) -> bool {
    static SEEN: Mutex<Option<HashMap<String, bool>>> = Mutex::new(None);
    let key = (!bin.build_id.is_empty()).then(|| bin.build_id.clone());
    if let Some(k) = &key
        && let Some(v) = SEEN
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(HashMap::new)
            .get(k)
    {
        return *v;
    }
    let found = exports_hotspot_symbol(bin, tgid);
    if let Some(k) = key {
        let mut seen = SEEN.lock().unwrap_or_else(PoisonError::into_inner);
        let seen = seen.get_or_insert_with(HashMap::new);
        if seen.len() >= MAX_REMEMBERED {
            seen.clear();
        }
        seen.insert(k, found);
    }
    found
}

fn exports_hotspot_symbol(bin: &Binary, tgid: u32) -> bool {
    let Ok(file) = bin.open(tgid) else {
        return false;
    };
    let Ok(reader) = BoundedReader::new(&file, MAX_READ, READ_BUDGET) else {
        return false;
    };
    let Ok(elf) = object::File::parse(&reader) else {
        return false;
    };
    elf.dynamic_symbols()
        .any(|s| s.is_definition() && matches!(s.name(), Ok(HOTSPOT_SYMBOL)))
}

/// What `/proc/<pid>/status` says of a process's signals and owner.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SignalState {
    /// A handler is installed for SIGQUIT.
    pub catches_quit: bool,
    /// SIGQUIT is ignored.
    pub ignores_quit: bool,
    /// Effective user and group IDs (in the agent's user namespace).
    pub uid: u32,
    /// Effective group ID.
    pub gid: u32,
}

/// Reads the signal dispositions and effective IDs of `tgid`.
pub fn signal_state(tgid: u32) -> std::io::Result<SignalState> {
    let status = std::fs::read_to_string(format!("/proc/{tgid}/status"))?;
    Ok(parse_status(&status))
}

fn parse_status(status: &str) -> SignalState {
    let quit = 1u64 << (libc::SIGQUIT - 1);
    let mask = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    // Real, effective, saved, filesystem: the effective ID is the second.
    let id = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(u32::MAX)
    };
    SignalState {
        catches_quit: mask("SigCgt:") & quit != 0,
        ignores_quit: mask("SigIgn:") & quit != 0,
        uid: id("Uid:"),
        gid: id("Gid:"),
    }
}

/// Whether one of the threads of `tgid` is HotSpot's signal dispatcher.
pub fn has_signal_dispatcher(tgid: u32) -> bool {
    thread_named(tgid, SIGNAL_DISPATCHER)
}

/// Whether one of the threads of `tgid` (at most [`MAX_THREADS`] looked at) is named
/// `name`.
fn thread_named(tgid: u32, name: &str) -> bool {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{tgid}/task")) else {
        return false;
    };
    dir.take(MAX_THREADS)
        .flatten()
        .any(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name))
}

/// The JVM options of `tgid` that the agent can see without asking it: its command line
/// and the variables the launcher and the JVM read options from. (Options in `@argfiles`
/// or `-XX:Flags=` files are not seen.)
pub fn visible_options(tgid: u32) -> Vec<String> {
    let read = |what: &str| {
        std::fs::File::open(format!("/proc/{tgid}/{what}"))
            .and_then(|f| crate::process::files::read_bounded(&f, MAX_ARGS))
            .unwrap_or_default()
    };
    let mut out: Vec<String> = read("cmdline")
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    for var in read("environ").split(|&b| b == 0) {
        let var = String::from_utf8_lossy(var);
        if let Some((key, value)) = var.split_once('=')
            && OPTION_VARIABLES.contains(&key)
        {
            out.extend(value.split_whitespace().map(str::to_owned));
        }
    }
    out
}

/// The last setting of boolean flag `-XX:±name` among `options`, if any.
pub fn flag(options: &[String], name: &str) -> Option<bool> {
    options.iter().rev().find_map(|o| {
        let rest = o.strip_prefix("-XX:")?;
        match rest.strip_prefix('+').or_else(|| rest.strip_prefix('-')) {
            Some(n) if n == name => Some(rest.starts_with('+')),
            _ => None,
        }
    })
}

/// Whether `options` turn HotSpot's signal handling down (`-Xrs`).
pub fn reduces_signals(options: &[String]) -> bool {
    options.iter().any(|o| o == "-Xrs") || flag(options, "ReduceSignalUsage") == Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_masks_and_ids_from_status() {
        let s = parse_status(
            "Name:\tjava\nUid:\t1000\t1001\t1000\t1000\nGid:\t50\t51\t50\t50\n\
             SigBlk:\t0000000000000000\nSigIgn:\t0000000000000002\nSigCgt:\t0000000101005ccd\n",
        );
        assert!(s.catches_quit && !s.ignores_quit);
        assert_eq!((s.uid, s.gid), (1001, 51));
        // -Xrs: SIGQUIT keeps its default action (the process would die).
        let xrs = parse_status("SigIgn:\t0\nSigCgt:\t0000000101001cc8\n");
        assert!(!xrs.catches_quit);
    }

    #[test]
    fn the_last_setting_of_a_flag_wins() {
        let o: Vec<String> = [
            "-XX:+PreserveFramePointer",
            "-Xmx1g",
            "-XX:-PreserveFramePointer",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(flag(&o, "PreserveFramePointer"), Some(false));
        assert_eq!(flag(&o, "Preserve"), None);
        assert!(!reduces_signals(&o));
        assert!(reduces_signals(&["-Xrs".to_owned()]));
    }

    #[test]
    fn this_process_is_not_a_jvm() {
        let me = std::process::id();
        assert!(!has_signal_dispatcher(me));
        let catalog = crate::process::ProcessCatalog::new();
        assert!(catalog.snapshot(me));
        let maps = catalog.lookup(me).unwrap();
        assert!(hotspot_library(&maps, me).is_none());
    }
}
