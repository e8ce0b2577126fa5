//! What the running kernel offers the capture engines, found at load time by probing (a
//! helper or map type is tried with the kernel's own verifier through libbpf) and from the
//! kernel's BTF (kfuncs, link types, struct fields), never from the version number; which
//! mechanism each engine uses as a result; and load failures translated into what the
//! kernel lacks.
//!
//! The agent logs the result once at start and exports it on `/metrics`
//! (`flamefleet_agent_kernel_feature`, `flamefleet_agent_capture_mechanism`).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::OnceLock;

use libbpf_rs::btf::{Btf, types};
use libbpf_rs::libbpf_sys as sys;

/// One thing the engines may use, whether this kernel has it, and since which Linux
/// version mainline has it (for messages only: the answer comes from probing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Feature {
    /// Short name, as in logs and the metric's `feature` label.
    pub name: &'static str,
    /// The first mainline release that has it.
    pub since: &'static str,
    /// What it is, for messages.
    pub what: &'static str,
    /// Whether this kernel has it.
    pub found: bool,
}

/// The features the engines choose their mechanisms by.
#[derive(Debug, Clone)]
pub struct KernelFeatures {
    /// `uname -r`.
    pub release: String,
    /// Kernel BTF (`/sys/kernel/btf/vmlinux`): every engine needs it (CO-RE).
    pub btf: Feature,
    /// `bpf_loop()` in perf-event programs: the CFI frame walk runs one frame per callback.
    pub bpf_loop: Feature,
    /// `bpf_get_current_task_btf()`: task fields as plain loads.
    pub task_btf: Feature,
    /// `bpf_task_pt_regs()`: the user registers of a task sampled in the kernel.
    pub task_pt_regs: Feature,
    /// Task-local storage maps: per-thread state of heap sampling and runqlat's own clock.
    pub task_storage: Feature,
    /// Cgroup-local storage maps: the per-cgroup cache of target lookups.
    pub cgrp_storage: Feature,
    /// The `bpf_rdonly_cast` kfunc: runqlat reads PSI's stamp of a switch after idle.
    pub rdonly_cast: Feature,
    /// `uprobe_multi` links: heap uprobes attached as BPF links (CAP_BPF + CAP_PERFMON).
    pub uprobe_multi: Feature,
    /// Session uprobes (`bpf_session_is_return`): no return trap for unsampled calls.
    pub uprobe_session: Feature,
    /// BPF memory charged to the memory cgroup instead of RLIMIT_MEMLOCK.
    pub memcg_accounting: Feature,
    /// Whether this process may open perf-event uprobes, the heap sampler's probes where
    /// the kernel has no `uprobe_multi` links.
    pub perf_uprobes: PerfUprobeAccess,
}

/// Whether the kernel lets this process open perf-event uprobes (`perf_event_open` on the
/// `uprobe` PMU). Mainline opened them to CAP_PERFMON in 5.8 and took that back in 6.16
/// ("perf: Revert to requiring CAP_SYS_ADMIN for uprobes", CVE-2025-38466: a uprobe placed
/// in the middle of an instruction corrupts the processes that run it), and so did the
/// stable releases 5.10.240, 5.15.189, 6.1.146, 6.6.99 and 6.12.39: whether a 6.1 node's
/// kernel asks for CAP_SYS_ADMIN depends on its point release and its distribution's
/// patches, so it is probed. `uprobe_multi` links (6.6+) are not affected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PerfUprobeAccess {
    /// Not probed: the kernel has `uprobe_multi` links, which need only CAP_BPF and
    /// CAP_PERFMON.
    NotNeeded,
    /// The kernel let this process open one.
    Allowed,
    /// The kernel refused it (EACCES or EPERM).
    Denied {
        /// `kernel.perf_event_paranoid` when probed: above 2, distribution kernels
        /// (Debian's, Ubuntu's) refuse every `perf_event_open` without CAP_SYS_ADMIN.
        paranoid: Option<i32>,
        /// Whether this process holds CAP_SYS_ADMIN (then something else refused it, such
        /// as a security module).
        sys_admin: bool,
    },
    /// The kernel has no `uprobe` PMU (`/sys/bus/event_source/devices/uprobe`): libbpf
    /// then creates uprobes through tracefs, whose permissions decide.
    NoPmu,
}

impl PerfUprobeAccess {
    /// The name logs and metrics use.
    pub fn name(self) -> &'static str {
        match self {
            Self::NotNeeded => "not-needed",
            Self::Allowed => "allowed",
            Self::Denied { .. } => "denied",
            Self::NoPmu => "no-pmu",
        }
    }
}

/// How the CPU sampler and the heap sampler walk user stacks with CFI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameWalk {
    /// One frame per `bpf_loop()` callback in a global function (Linux 5.17+).
    BpfLoop,
    /// A bounded loop unrolled by the verifier, reading tasks through probe helpers
    /// (kernels without `bpf_loop`, `bpf_get_current_task_btf` or `bpf_task_pt_regs`).
    Bounded,
}

impl FrameWalk {
    /// The name logs and metrics use.
    pub fn name(self) -> &'static str {
        match self {
            Self::BpfLoop => "bpf_loop",
            Self::Bounded => "bounded-loop",
        }
    }
}

impl KernelFeatures {
    /// The running kernel's features, probed once per process.
    pub fn get() -> &'static Self {
        static FEATURES: OnceLock<KernelFeatures> = OnceLock::new();
        FEATURES.get_or_init(Self::probe)
    }

    fn probe() -> Self {
        // The probes below create BPF programs and maps, charged to RLIMIT_MEMLOCK before
        // 5.11: a low soft limit must not make a feature look missing.
        raise_memlock_soft_limit();
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|r| r.trim().to_owned())
            .unwrap_or_default();
        let btf = Btf::from_vmlinux().ok();
        let has_func = |name: &str| {
            btf.as_ref()
                .and_then(|b| b.type_by_name::<types::Func<'_>>(name))
                .is_some()
        };
        let has_enum_value = |ty: &str, value: &str| {
            btf.as_ref()
                .and_then(|b| b.type_by_name::<types::Enum<'_>>(ty))
                .is_some_and(|e| {
                    e.iter()
                        .any(|m| m.name.is_some_and(|n| n == std::ffi::OsStr::new(value)))
                })
        };
        let has_member = |ty: &str, member: &str| {
            btf.as_ref()
                .and_then(|b| b.type_by_name::<types::Struct<'_>>(ty))
                .is_some_and(|s| {
                    s.iter()
                        .any(|m| m.name.is_some_and(|n| n == std::ffi::OsStr::new(member)))
                })
        };
        let feature = |name, since, what, found| Feature {
            name,
            since,
            what,
            found,
        };
        let uprobe_multi = has_enum_value("bpf_attach_type", "BPF_TRACE_UPROBE_MULTI");
        Self {
            release,
            btf: feature(
                "btf",
                "5.2",
                "kernel BTF (CONFIG_DEBUG_INFO_BTF)",
                btf.is_some(),
            ),
            bpf_loop: feature(
                "bpf_loop",
                "5.17",
                "the bpf_loop() helper",
                probe_helper(sys::BPF_PROG_TYPE_PERF_EVENT, sys::BPF_FUNC_loop),
            ),
            task_btf: feature(
                "get_current_task_btf",
                "5.11",
                "the bpf_get_current_task_btf() helper",
                probe_helper(
                    sys::BPF_PROG_TYPE_PERF_EVENT,
                    sys::BPF_FUNC_get_current_task_btf,
                ),
            ),
            task_pt_regs: feature(
                "task_pt_regs",
                "5.15",
                "the bpf_task_pt_regs() helper",
                probe_helper(sys::BPF_PROG_TYPE_PERF_EVENT, sys::BPF_FUNC_task_pt_regs),
            ),
            task_storage: feature(
                "task_storage",
                "5.11",
                "task-local storage maps (BPF_MAP_TYPE_TASK_STORAGE)",
                probe_map(sys::BPF_MAP_TYPE_TASK_STORAGE),
            ),
            cgrp_storage: feature(
                "cgrp_storage",
                "6.2",
                "cgroup-local storage maps (BPF_MAP_TYPE_CGRP_STORAGE)",
                probe_map(sys::BPF_MAP_TYPE_CGRP_STORAGE),
            ),
            rdonly_cast: feature(
                "rdonly_cast",
                "6.2",
                "the bpf_rdonly_cast() kfunc",
                has_func("bpf_rdonly_cast"),
            ),
            uprobe_multi: feature(
                "uprobe_multi",
                "6.6",
                "uprobe_multi BPF links",
                uprobe_multi,
            ),
            uprobe_session: feature(
                "uprobe_session",
                "6.13",
                "session uprobes (the bpf_session_is_return() kfunc)",
                has_func("bpf_session_is_return")
                    && has_enum_value("bpf_attach_type", "BPF_TRACE_UPROBE_SESSION"),
            ),
            memcg_accounting: feature(
                "memcg_accounting",
                "5.11",
                "BPF memory charged to the memory cgroup (not RLIMIT_MEMLOCK)",
                has_member("bpf_map", "memcg") || has_member("bpf_map", "objcg"),
            ),
            perf_uprobes: if uprobe_multi {
                PerfUprobeAccess::NotNeeded
            } else {
                probe_perf_uprobe()
            },
        }
    }

    /// Every feature, in a fixed order.
    pub fn all(&self) -> [Feature; 10] {
        [
            self.btf,
            self.bpf_loop,
            self.task_btf,
            self.task_pt_regs,
            self.task_storage,
            self.cgrp_storage,
            self.rdonly_cast,
            self.uprobe_multi,
            self.uprobe_session,
            self.memcg_accounting,
        ]
    }

    /// How user stacks are walked on this kernel.
    pub fn frame_walk(&self) -> FrameWalk {
        if self.bpf_loop.found && self.task_btf.found && self.task_pt_regs.found {
            FrameWalk::BpfLoop
        } else {
            FrameWalk::Bounded
        }
    }

    /// How targets are looked up: cached per cgroup, or an ancestry walk per event.
    pub fn target_lookup(&self) -> &'static str {
        if self.cgrp_storage.found {
            "cgroup-storage-cache"
        } else {
            "ancestry-walk"
        }
    }

    /// Why eBPF heap sampling cannot run here (`None`: it can): it keeps per-thread state
    /// in task storage and walks stacks under `bpf_loop()` from uprobes, which it must be
    /// allowed to attach.
    pub fn heap_ebpf_refusal(&self) -> Option<String> {
        const OTHER_SOURCES: &str = "Go programs (runtime buckets) and processes serving a pprof heap endpoint still get heap profiles";
        let missing: Vec<String> = [self.task_storage, self.bpf_loop, self.task_btf]
            .iter()
            .filter(|f| !f.found)
            .map(|f| format!("{} (Linux {})", f.what, f.since))
            .collect();
        if !missing.is_empty() {
            return Some(format!(
                "eBPF heap sampling needs {}, which kernel {} lacks; {OTHER_SOURCES}",
                missing.join(" and "),
                self.release
            ));
        }
        let PerfUprobeAccess::Denied {
            paranoid,
            sys_admin,
        } = self.perf_uprobes
        else {
            return None;
        };
        let why = if sys_admin {
            "refuses them to this process although it holds CAP_SYS_ADMIN (a security module may forbid them)".to_owned()
        } else {
            let paranoid = match paranoid {
                Some(p) if p > 2 => format!(
                    " (and kernel.perf_event_paranoid is {p} here: above 2, distribution kernels such as Debian's refuse every perf_event_open without CAP_SYS_ADMIN)"
                ),
                _ => String::new(),
            };
            format!(
                "opens them only to CAP_SYS_ADMIN, which the agent lacks{paranoid}: grant it SYS_ADMIN (the chart's agent.capabilities; docs/security.md says what that costs) on nodes older than Linux 6.6 where eBPF heap profiles are wanted"
            )
        };
        Some(format!(
            "eBPF heap sampling attaches perf-event uprobes on kernel {} (it lacks {}, which Linux {} and later have, where CAP_BPF and CAP_PERFMON suffice), and this kernel {why}; {OTHER_SOURCES}",
            self.release, self.uprobe_multi.what, self.uprobe_multi.since
        ))
    }

    /// Why off-CPU profiles cannot run here (`None`: they can): the program walks user
    /// stacks under `bpf_loop()` from `sched_switch` with the blocking task's saved
    /// registers, and keeps each block's stamp in task storage.
    pub fn offcpu_refusal(&self) -> Option<String> {
        let missing: Vec<String> = [self.bpf_loop, self.task_pt_regs, self.task_storage]
            .iter()
            .filter(|f| !f.found)
            .map(|f| format!("{} (Linux {})", f.what, f.since))
            .collect();
        (!missing.is_empty()).then(|| {
            format!(
                "off-CPU profiles need {}, which kernel {} lacks; CPU profiles and runqlat still run here",
                missing.join(" and "),
                self.release
            )
        })
    }

    /// How heap uprobes are attached on this kernel.
    pub fn heap_probes(&self) -> &'static str {
        if self.uprobe_session.found {
            "session-uprobes"
        } else if self.uprobe_multi.found {
            "uprobe_multi-links"
        } else {
            "perf-event-uprobes"
        }
    }

    /// The mechanism of each engine, as (engine, mechanism) pairs.
    pub fn mechanisms(&self) -> Vec<(&'static str, String)> {
        let runqlat = if self.task_storage.found {
            "hybrid (own clock: task storage)"
        } else {
            "hybrid (own clock: hash map)"
        };
        let psi = if self.rdonly_cast.found {
            "psi-stamps"
        } else {
            "clock-read-after-idle"
        };
        vec![
            ("cpu.frame_walk", self.frame_walk().name().to_owned()),
            ("targets", self.target_lookup().to_owned()),
            ("runqlat", runqlat.to_owned()),
            ("runqlat.after_idle", psi.to_owned()),
            (
                "heap_ebpf.perf_uprobes",
                self.perf_uprobes.name().to_owned(),
            ),
            (
                "heap_ebpf",
                match self.heap_ebpf_refusal() {
                    Some(_) => "refused".to_owned(),
                    None => self.heap_probes().to_owned(),
                },
            ),
            (
                "offcpu",
                match self.offcpu_refusal() {
                    Some(_) => "refused".to_owned(),
                    None => "tp_btf-sched_switch".to_owned(),
                },
            ),
        ]
    }

    /// One line for the agent's start: each feature found or missing, and the mechanisms.
    pub fn summary(&self) -> String {
        let features: Vec<String> = self
            .all()
            .iter()
            .map(|f| format!("{}={}", f.name, if f.found { "yes" } else { "no" }))
            .collect();
        let mechanisms: Vec<String> = self
            .mechanisms()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!(
            "kernel {}: features {}; mechanisms {}",
            self.release,
            features.join(" "),
            mechanisms.join(" ")
        )
    }

    /// The features and mechanisms as Prometheus gauges.
    pub fn render_metrics(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::from(
            "# HELP flamefleet_agent_kernel_feature Whether the node's kernel has a feature the capture engines use (1) or not (0); `since` is the mainline release that added it.\n\
             # TYPE flamefleet_agent_kernel_feature gauge\n",
        );
        for f in self.all() {
            let _ = writeln!(
                out,
                "flamefleet_agent_kernel_feature{{kernel=\"{}\",feature=\"{}\",since=\"{}\"}} {}",
                self.release,
                f.name,
                f.since,
                u8::from(f.found)
            );
        }
        out.push_str(
            "# HELP flamefleet_agent_capture_mechanism The mechanism each capture engine uses on this node's kernel (always 1).\n\
             # TYPE flamefleet_agent_capture_mechanism gauge\n",
        );
        for (engine, mechanism) in self.mechanisms() {
            let _ = writeln!(
                out,
                "flamefleet_agent_capture_mechanism{{engine=\"{engine}\",mechanism=\"{mechanism}\"}} 1"
            );
        }
        out
    }
}

/// RLIMIT_MEMLOCK of this process as (soft, hard), in bytes (`u64::MAX`: unlimited).
pub(crate) fn memlock_limits() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } == 0)
        .then_some((lim.rlim_cur, lim.rlim_max))
}

/// Raises this process's RLIMIT_MEMLOCK soft limit to its hard one, once, before the first
/// BPF object (the feature probes included). Kernels before 5.11 charge BPF memory to that
/// limit; raising the soft limit up to the hard one needs no capability, so under a
/// container runtime that leaves the hard limit high (LimitMEMLOCK=infinity) the agent
/// needs no CAP_SYS_RESOURCE. (libbpf then tries to lift both to unlimited, which only
/// CAP_SYS_RESOURCE allows where the hard limit is lower, and goes on without it.) On later
/// kernels the limit only bounds mlock(2), which the agent does not call.
pub(crate) fn raise_memlock_soft_limit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Some((soft, hard)) = memlock_limits() else {
            return;
        };
        if soft >= hard {
            return;
        }
        let lim = libc::rlimit {
            rlim_cur: hard,
            rlim_max: hard,
        };
        // SAFETY: setrlimit reads the struct it is given.
        let raised = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } == 0;
        tracing::debug!(
            soft = %limit_text(soft),
            hard = %limit_text(hard),
            raised,
            "RLIMIT_MEMLOCK soft limit raised to the hard one (kernels before 5.11 charge BPF memory to it)"
        );
    });
}

/// A limit for messages: bytes, or "unlimited".
pub(crate) fn limit_text(bytes: u64) -> String {
    if bytes == libc::RLIM_INFINITY {
        "unlimited".to_owned()
    } else {
        format!("{} KiB", bytes / 1024)
    }
}

/// Asks the kernel for a perf-event uprobe on this process's own executable at an offset
/// past the end of any file: the kernel checks the caller's privileges first
/// (`perf_event_open`'s paranoid checks, then the uprobe PMU's capability check) and
/// refuses the offset before it places any breakpoint, so EACCES or EPERM says "not
/// allowed" and any other answer "allowed".
fn probe_perf_uprobe() -> PerfUprobeAccess {
    let Some(pmu) = std::fs::read_to_string("/sys/bus/event_source/devices/uprobe/type")
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
    else {
        return PerfUprobeAccess::NoPmu;
    };
    let path = c"/proc/self/exe";
    // SAFETY: perf_event_attr is plain data; all-zero is its documented default.
    let mut attr: sys::perf_event_attr = unsafe { std::mem::zeroed() };
    attr.size = std::mem::size_of::<sys::perf_event_attr>() as u32;
    attr.type_ = pmu;
    attr.__bindgen_anon_3.uprobe_path = path.as_ptr() as u64;
    // Positive as the kernel's signed file offset, and beyond any file's size.
    attr.__bindgen_anon_4.probe_offset = 1 << 62;
    // SAFETY: valid attr and path pointers for the call; pid -1 with cpu 0, as libbpf opens
    // uprobes.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const sys::perf_event_attr,
            -1i32,
            0i32,
            -1i32,
            super::perf_event::PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd >= 0 {
        // SAFETY: a descriptor the call just returned, closed once.
        unsafe { libc::close(fd as i32) };
        return PerfUprobeAccess::Allowed;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EACCES | libc::EPERM) => PerfUprobeAccess::Denied {
            paranoid: std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
                .ok()
                .and_then(|p| p.trim().parse().ok()),
            sys_admin: has_capability(CAP_SYS_ADMIN),
        },
        _ => PerfUprobeAccess::Allowed,
    }
}

fn probe_helper(prog_type: sys::bpf_prog_type, helper: sys::bpf_func_id) -> bool {
    // SAFETY: probing takes no pointers besides the (null) options.
    unsafe { sys::libbpf_probe_bpf_helper(prog_type, helper, std::ptr::null()) == 1 }
}

fn probe_map(map_type: sys::bpf_map_type) -> bool {
    // SAFETY: as above.
    unsafe { sys::libbpf_probe_bpf_map_type(map_type, std::ptr::null()) == 1 }
}

/// Lines of libbpf's messages kept per thread while [`LoadLog::capture`] runs.
const LOAD_LOG_LINES: usize = 400;

thread_local! {
    static LOAD_LOG: RefCell<Option<VecDeque<String>>> = const { RefCell::new(None) };
}

/// libbpf's messages (the verifier's log among them) while a BPF object loads on this
/// thread, so that a failure can say why.
pub(crate) struct LoadLog;

impl LoadLog {
    /// Runs `load`, keeping libbpf's messages meanwhile; returns them with its result.
    pub(crate) fn capture<T>(load: impl FnOnce() -> T) -> (T, Vec<String>) {
        super::route_libbpf_logs();
        LOAD_LOG.with(|l| *l.borrow_mut() = Some(VecDeque::new()));
        let out = load();
        let lines = LOAD_LOG.with(|l| l.borrow_mut().take().unwrap_or_default());
        (out, lines.into())
    }

    /// Called with every libbpf message.
    pub(crate) fn record(message: &str) {
        LOAD_LOG.with(|l| {
            if let Some(buf) = l.borrow_mut().as_mut() {
                for line in message.lines() {
                    if buf.len() == LOAD_LOG_LINES {
                        buf.pop_front();
                    }
                    buf.push_back(line.to_owned());
                }
            }
        });
    }
}

/// What a load failure's messages say the kernel lacks, as (what, which kernel has it);
/// `None` when no known refusal is recognised.
pub(crate) fn lacking(lines: &[String]) -> Option<(String, &'static str)> {
    // (pattern in a libbpf or verifier line, what is missing, since)
    const KNOWN: &[(&str, &str, &str)] = &[
        ("bpf_loop", "the bpf_loop() helper", "Linux 5.17"),
        (
            "number of funcs in func_info doesn't match number of subprogs",
            "BPF callbacks (bpf_loop)",
            "Linux 5.17",
        ),
        (
            "get_current_task_btf",
            "the bpf_get_current_task_btf() helper",
            "Linux 5.11",
        ),
        (
            "task_pt_regs",
            "the bpf_task_pt_regs() helper",
            "Linux 5.15",
        ),
        (
            "task_storage",
            "task-local storage (BPF_MAP_TYPE_TASK_STORAGE)",
            "Linux 5.11",
        ),
        (
            "cgrp_storage",
            "cgroup-local storage (BPF_MAP_TYPE_CGRP_STORAGE)",
            "Linux 6.2",
        ),
        ("rdonly_cast", "the bpf_rdonly_cast() kfunc", "Linux 6.2"),
        (
            "R3 type=mem expected=",
            "plain memory as a map value (bpf_map_update_elem)",
            "Linux 6.2",
        ),
        (
            "arg#0 pointer type",
            "pointer arguments of global BPF functions",
            "Linux 5.12",
        ),
        ("uprobe_multi", "uprobe_multi BPF links", "Linux 6.6"),
    ];
    for line in lines.iter().rev() {
        for (pattern, what, since) in KNOWN {
            if line.contains(pattern) {
                return Some(((*what).to_owned(), since));
            }
        }
    }
    None
}

/// The last lines of the verifier's log (between libbpf's BEGIN/END PROG LOAD LOG
/// markers), or of libbpf's messages when there is none.
pub(crate) fn verifier_tail(lines: &[String], n: usize) -> Vec<String> {
    let end = lines
        .iter()
        .rposition(|l| l.contains("-- END PROG LOAD LOG --"));
    let begin = end.and_then(|e| {
        lines[..e]
            .iter()
            .rposition(|l| l.contains("-- BEGIN PROG LOAD LOG --"))
    });
    let body: &[String] = match (begin, end) {
        (Some(b), Some(e)) => &lines[b + 1..e],
        _ => lines,
    };
    // The verifier's closing statistics line says nothing about the cause.
    let body: Vec<&String> = body
        .iter()
        .filter(|l| !l.starts_with("processed ") && !l.trim().is_empty())
        .collect();
    body[body.len().saturating_sub(n)..]
        .iter()
        .map(|l| (*l).clone())
        .collect()
}

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Whether this process's effective set holds capability `cap`, from `/proc/self/status`.
fn has_capability(cap: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|eff| eff & (1u64 << cap) != 0)
}

/// Whether this process holds the capabilities loading BPF needs (CAP_BPF and
/// CAP_PERFMON, or CAP_SYS_ADMIN).
pub(crate) fn has_bpf_privileges() -> bool {
    has_capability(CAP_SYS_ADMIN) || (has_capability(CAP_BPF) && has_capability(CAP_PERFMON))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_owned).collect()
    }

    #[test]
    fn a_verifier_refusal_names_what_is_missing_and_the_kernel_that_has_it() {
        let log = lines(
            "libbpf: prog 'on_cpu_sample': BPF program load failed: -EINVAL\n\
             libbpf: prog 'on_cpu_sample': -- BEGIN PROG LOAD LOG --\n\
             number of funcs in func_info doesn't match number of subprogs\n\
             processed 0 insns (limit 1000000) max_states_per_insn 0 total_states 0 peak_states 0 mark_read 0\n\
             -- END PROG LOAD LOG --\n\
             libbpf: prog 'on_cpu_sample': failed to load: -EINVAL",
        );
        let (what, since) = lacking(&log).expect("recognised");
        assert_eq!(what, "BPF callbacks (bpf_loop)");
        assert_eq!(since, "Linux 5.17");
        assert_eq!(
            verifier_tail(&log, 5),
            vec!["number of funcs in func_info doesn't match number of subprogs".to_owned()]
        );
    }

    #[test]
    fn an_unknown_refusal_keeps_the_last_lines() {
        let log = lines("a\nb\nc\nd");
        assert_eq!(lacking(&log), None);
        assert_eq!(verifier_tail(&log, 2), vec!["c".to_owned(), "d".to_owned()]);
    }

    #[test]
    fn perf_event_uprobes_are_allowed_to_cap_sys_admin() {
        // The probe's one "allowed" answer that does not depend on the kernel build: the
        // capability every kernel opens perf-event uprobes to (the tests run as root).
        assert!(
            has_capability(CAP_SYS_ADMIN),
            "run the agent's tests as root (scripts/test.sh)"
        );
        let access = probe_perf_uprobe();
        assert!(
            matches!(access, PerfUprobeAccess::Allowed | PerfUprobeAccess::NoPmu),
            "{access:?}"
        );
        if Path::new("/sys/bus/event_source/devices/uprobe/type").exists() {
            assert_eq!(access, PerfUprobeAccess::Allowed);
        }
    }

    #[test]
    fn the_running_kernel_is_described_in_one_line_and_in_gauges() {
        let f = KernelFeatures::get();
        let line = f.summary();
        assert!(line.contains("bpf_loop="), "{line}");
        assert!(line.contains("cpu.frame_walk="), "{line}");
        let metrics = f.render_metrics();
        assert_eq!(
            metrics
                .lines()
                .filter(|l| l.starts_with("flamefleet_agent_kernel_feature{"))
                .count(),
            10
        );
    }
}
