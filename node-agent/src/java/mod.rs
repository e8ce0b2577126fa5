//! Java frames of HotSpot JVMs (OpenJDK 17+): named from the perf map the JVM itself
//! writes when asked (`jcmd PID Compiler.perfmap`), which the agent asks for through the
//! JVM's attach listener when it builds a profile of the JVM's samples.
//!
//! Why the perf map and not HotSpot's own metadata read in BPF (as the OpenTelemetry
//! profiler does): the perf map names every JIT-compiled method (`package.Class.method`)
//! with no per-version layout tables to keep, and the BPF walk is unchanged (compiled
//! frames are walked by frame pointer, the JVM's own code by its CFI). What it costs the
//! user: `-XX:+PreserveFramePointer` for callers of compiled frames (without it a compiled
//! frame's callers are lost, the leaf is still named), interpreted frames show as
//! `Interpreter`, and the JVM runs an attach listener thread once asked. The capture's
//! summary says, per JVM, what its frames got and what is missing (`JvmStatus`).
//!
//! `detect` decides whether a process is a HotSpot JVM that may be signalled; `attach`
//! speaks the attach protocol inside the JVM's root.

pub mod attach;
pub mod detect;

use std::time::{Duration, Instant};

use crate::process::ProcessMaps;
use crate::process::handle::ProcessHandle;

/// How long the agent waits for a JVM's attach listener after SIGQUIT.
pub const LISTENER_WAIT: Duration = Duration::from_secs(2);
/// How long one diagnostic command may take (writing the perf map of a large code cache
/// takes tens of milliseconds).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// What a profile's JVM got: one line of the capture summary's `runtimes`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JvmStatus {
    /// The process.
    pub tgid: u32,
    /// The JDK version, as the JVM reports it (`VM.version`).
    pub version: Option<String>,
    /// Whether the JVM keeps frame pointers in compiled code (`-XX:+PreserveFramePointer`),
    /// when known (from the JVM, else from its visible options).
    pub frame_pointers: Option<bool>,
    /// The JVM wrote its perf map for this profile.
    pub perf_map_written: bool,
    /// Entries of the perf map read (0: none found).
    pub perf_map_entries: usize,
    /// Why the agent did not ask the JVM for its perf map.
    pub not_attached: Option<String>,
    /// Time spent attaching and running the commands.
    pub setup: Duration,
}

impl std::fmt::Display for JvmStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "java")?;
        if let Some(v) = &self.version {
            write!(f, " {v}")?;
        }
        write!(f, " (pid {}): ", self.tgid)?;
        if self.perf_map_entries == 0 {
            write!(f, "Java frames unnamed")?;
            match &self.not_attached {
                Some(why) => write!(f, ": {why}")?,
                None => write!(f, ": the JVM's perf map was not found")?,
            }
            return Ok(());
        }
        if self.perf_map_written {
            write!(
                f,
                "compiled Java frames named from the JVM's perf map ({} code objects; \
                 interpreted frames show as Interpreter)",
                self.perf_map_entries
            )?;
        } else {
            write!(
                f,
                "Java frames named from a perf map the agent did not ask for ({} code objects; \
                 code compiled since it was written is unnamed)",
                self.perf_map_entries
            )?;
            if let Some(why) = &self.not_attached {
                write!(f, ": {why}")?;
            }
        }
        match self.frame_pointers {
            Some(true) => Ok(()),
            Some(false) => write!(
                f,
                "; -XX:+PreserveFramePointer is off: the callers of compiled Java frames are \
                 lost (start the JVM with -XX:+PreserveFramePointer)"
            ),
            None => write!(
                f,
                "; whether -XX:+PreserveFramePointer is on is unknown (without it the callers \
                 of compiled Java frames are lost)"
            ),
        }
    }
}

/// The status of process `tgid` (snapshot `maps`) if it runs a HotSpot JVM, after asking
/// it to write its perf map when `attach` allows: the JVM's `/tmp/perf-<PID>.map` then
/// names the code it has compiled now. `None` for any other process.
pub fn prepare(tgid: u32, maps: &ProcessMaps, attach: bool) -> Option<JvmStatus> {
    detect::hotspot_library(maps, tgid)?;
    let started = Instant::now();
    let options = detect::visible_options(tgid);
    let mut status = JvmStatus {
        tgid,
        frame_pointers: detect::flag(&options, "PreserveFramePointer"),
        ..JvmStatus::default()
    };
    if !attach {
        status.not_attached = Some(
            "the agent does not ask JVMs for their perf map here (heap profiles, or agent \
             --java-attach=false: chart value agent.javaAttach)"
                .into(),
        );
        return Some(status);
    }
    if let Err(why) = ask(tgid, &options, &mut status) {
        status.not_attached = Some(why);
    }
    status.setup = started.elapsed();
    Some(status)
}

/// Attaches to the JVM (starting its listener if it is safe to) and has it write its perf
/// map; fills in what the JVM says of itself. The checks run as the agent; the attach
/// itself, for a JVM of another user, as that user ([`attach::as_user`]).
fn ask(tgid: u32, options: &[String], status: &mut JvmStatus) -> Result<(), String> {
    // Held from before the checks: a PID reused meanwhile is never signalled.
    let handle = ProcessHandle::open(tgid).map_err(|e| format!("process gone: {e}"))?;
    let state = detect::signal_state(tgid).map_err(|e| format!("reading its status: {e}"))?;
    let nspid = crate::perf_map::ns_pid(tgid).unwrap_or(tgid);
    let jvm = attach::Jvm::open(handle, nspid, state.uid, state.gid).map_err(|e| e.to_string())?;
    let listening = jvm.listening().map_err(|e| e.to_string())?;
    if !listening {
        may_signal(tgid, options, state)?;
    }
    let talk = |status: &mut JvmStatus| -> Result<(), String> {
        if !listening {
            jvm.start_listener(LISTENER_WAIT)
                .map_err(|e| e.to_string())?;
        }
        run_commands(&jvm, status)
    };
    if state.uid == nix::unistd::geteuid().as_raw() {
        talk(status)
    } else {
        attach::as_user(tgid, state.uid, state.gid, || talk(status)).map_err(|e| e.to_string())?
    }
}

/// `VM.version`, `VM.flags` (into `status`), then `Compiler.perfmap`.
fn run_commands(jvm: &attach::Jvm, status: &mut JvmStatus) -> Result<(), String> {
    if let Ok(v) = jvm.jcmd("VM.version", COMMAND_TIMEOUT) {
        status.version = v
            .lines()
            .find_map(|l| l.strip_prefix("JDK "))
            .map(|v| v.trim().chars().take(40).collect());
    }
    if let Ok(flags) = jvm.jcmd("VM.flags", COMMAND_TIMEOUT) {
        // VM.flags prints the flags set on the command line or by ergonomics; the flag is
        // off by default.
        status.frame_pointers = Some(
            detect::flag(
                &flags
                    .split_whitespace()
                    .map(str::to_owned)
                    .collect::<Vec<_>>(),
                "PreserveFramePointer",
            ) == Some(true),
        );
    }
    jvm.jcmd("Compiler.perfmap", COMMAND_TIMEOUT)
        .map_err(|e| e.to_string())?;
    status.perf_map_written = true;
    Ok(())
}

/// Whether the JVM `tgid` may be sent SIGQUIT (see [`detect`]'s module docs); why not.
fn may_signal(tgid: u32, options: &[String], state: detect::SignalState) -> Result<(), String> {
    if detect::reduces_signals(options) || !state.catches_quit || state.ignores_quit {
        return Err(
            "not attached: the process does not handle SIGQUIT, which would end it (a JVM \
             still starting; a JVM under -Xrs starts its attach listener at startup instead)"
                .into(),
        );
    }
    if detect::flag(options, "DisableAttachMechanism") == Some(true) {
        return Err("not attached: the JVM runs with -XX:+DisableAttachMechanism".into());
    }
    if !detect::has_signal_dispatcher(tgid) {
        return Err(
            "not attached: the JVM's signal dispatcher thread is not running yet (the JVM is \
             starting)"
                .into(),
        );
    }
    Ok(())
}

/// The `package.Class.method` of a HotSpot perf-map name (`RET package.Class.method(ARGS)`);
/// other names (`Interpreter`, stubs) as they are.
pub fn method_name(raw: &str) -> &str {
    let Some((head, _)) = raw.split_once('(') else {
        return raw;
    };
    match head.rsplit(' ').next() {
        Some(name) if !name.is_empty() && name.contains('.') => name,
        _ => raw,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_names_from_hotspot_perf_map_lines() {
        assert_eq!(
            method_name("long dev.flamefleet.burn.Burn.alpha(long)"),
            "dev.flamefleet.burn.Burn.alpha"
        );
        assert_eq!(
            method_name(
                "java.lang.Object jdk.internal.misc.Unsafe.getReferenceVolatile(java.lang.Object, long)"
            ),
            "jdk.internal.misc.Unsafe.getReferenceVolatile"
        );
        assert_eq!(
            method_name("void java.lang.Object.<init>()"),
            "java.lang.Object.<init>"
        );
        assert_eq!(method_name("Interpreter"), "Interpreter");
        assert_eq!(method_name("StubRoutines (1)"), "StubRoutines (1)");
        assert_eq!(
            method_name("I2C/C2I adapters(0xbe)"),
            "I2C/C2I adapters(0xbe)"
        );
    }

    #[test]
    fn summary_lines_say_what_is_missing() {
        let mut s = JvmStatus {
            tgid: 7,
            version: Some("17.0.15".into()),
            frame_pointers: Some(false),
            perf_map_written: true,
            perf_map_entries: 290,
            ..JvmStatus::default()
        };
        let line = s.to_string();
        assert!(line.starts_with("java 17.0.15 (pid 7): compiled Java frames named"));
        assert!(line.contains("-XX:+PreserveFramePointer is off"), "{line}");
        s.frame_pointers = Some(true);
        assert!(!s.to_string().contains("PreserveFramePointer"));
        s.perf_map_entries = 0;
        s.not_attached = Some("not attached: -Xrs".into());
        assert!(
            s.to_string()
                .ends_with("Java frames unnamed: not attached: -Xrs")
        );
    }
}
