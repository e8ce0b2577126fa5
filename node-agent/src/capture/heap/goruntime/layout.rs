//! The Go versions this source can read, and the layout of the runtime's
//! heap profile records in each.
//!
//! Every entry was checked by hand against `src/runtime/mprof.go` of that
//! release (the `bucket`, `memRecord`, `memRecordCycle` and
//! `mProfCycleHolder` types, `maxProfStackDepth`, and how `mProf_Malloc`
//! records stacks). A version missing from the table is refused: reading a
//! changed layout would give a plausible-looking, wrong profile.

use std::fmt;

/// A Go release, as `runtime.Version()` / the build info spell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct GoVersion {
    /// Major version (1).
    pub major: u32,
    /// Minor version (e.g. 24 for go1.24.3).
    pub minor: u32,
    /// Patch (0 for release candidates and betas).
    pub patch: u32,
}

impl fmt::Display for GoVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "go{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl GoVersion {
    /// Parses `go1.24.3`, `go1.24`, `go1.25rc1`, `go1.26.0 X:nocoverageredesign`;
    /// `None` for anything else (e.g. `devel go1.27-abcdef`, whose layout
    /// cannot be known from its name).
    pub fn parse(text: &str) -> Option<Self> {
        let word = text.split_whitespace().next()?;
        let rest = word.strip_prefix("go")?;
        // Pre-releases (rc, beta) share their release's layout.
        let numeric_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (numbers, suffix) = rest.split_at(numeric_end);
        if !(suffix.is_empty() || suffix.starts_with("rc") || suffix.starts_with("beta")) {
            return None;
        }
        let mut parts = numbers.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        let patch = match parts.next() {
            Some(p) => p.parse().ok()?,
            None => 0,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(Self {
            major,
            minor,
            patch,
        })
    }
}

/// Offsets and bounds of the heap profile records of one range of Go
/// versions (amd64/arm64: 8-byte pointers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// First minor version of `go1.X` with this layout.
    pub first_minor: u32,
    /// Last minor version verified.
    pub last_minor: u32,
    /// Size of `bucket` (next, allnext, typ, hash, size, nstk).
    pub bucket_header: u64,
    /// Offset of `typ` in `bucket`.
    pub typ_offset: u64,
    /// Offset of `size` in `bucket`.
    pub size_offset: u64,
    /// Offset of `nstk` in `bucket`.
    pub nstk_offset: u64,
    /// Offset of `allnext` in `bucket`.
    pub allnext_offset: u64,
    /// `memProfile` in `bucketType`.
    pub mem_profile_type: u64,
    /// `maxProfStackDepth`: the runtime throws above it, so more is corruption.
    pub max_stack: u64,
    /// Number of `future` cycles in `memRecord` (the active one comes first).
    pub future_cycles: u64,
    /// Size of one `memRecordCycle` (allocs, frees, alloc_bytes, free_bytes).
    pub cycle_size: u64,
}

/// go1.23 to go1.26: `bucket` is `{_ NotInHeap; next, allnext *bucket; typ
/// bucketType; hash, size, nstk uintptr}` followed by `nstk` return PCs (from
/// `callers`) and a `memRecord{active memRecordCycle; future
/// [3]memRecordCycle}`; `mProfCycle` holds `cycle << 1 | flushed`.
const GO_1_23: Layout = Layout {
    first_minor: 23,
    last_minor: 26,
    bucket_header: 48,
    allnext_offset: 8,
    typ_offset: 16,
    size_offset: 32,
    nstk_offset: 40,
    mem_profile_type: 1,
    max_stack: 1024,
    future_cycles: 3,
    cycle_size: 32,
};

/// Every layout known, oldest first.
pub const LAYOUTS: &[Layout] = &[GO_1_23];

/// Why a version cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The version string does not name a release.
    #[error(
        "Go version {0:?} is not a release this agent knows (expected go1.X[.Y]; development \
         builds have no fixed layout); supported: {range}",
        range = supported_range()
    )]
    Unparsable(String),
    /// A release outside the verified table.
    #[error(
        "Go version {0} is not supported by the Go runtime heap source (supported: {range}); its \
         profile buckets were not verified, so they are not read; use the pprof endpoint source",
        range = supported_range()
    )]
    Unsupported(GoVersion),
}

/// `go1.23–go1.26`, from the table.
pub fn supported_range() -> String {
    match (LAYOUTS.first(), LAYOUTS.last()) {
        (Some(a), Some(b)) => format!("go1.{}–go1.{}", a.first_minor, b.last_minor),
        _ => "none".into(),
    }
}

/// The layout of `version` (as found in the build info), or why there is none.
pub fn layout_for(version: &str) -> Result<(GoVersion, &'static Layout), LayoutError> {
    let v = GoVersion::parse(version).ok_or_else(|| LayoutError::Unparsable(version.into()))?;
    LAYOUTS
        .iter()
        .find(|l| v.major == 1 && (l.first_minor..=l.last_minor).contains(&v.minor))
        .map(|l| (v, l))
        .ok_or(LayoutError::Unsupported(v))
}

impl Layout {
    /// Size of `memRecord`.
    pub fn record_size(&self) -> u64 {
        self.cycle_size * (1 + self.future_cycles)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_release_names() {
        let v = GoVersion::parse("go1.24.3").unwrap();
        assert_eq!((v.major, v.minor, v.patch), (1, 24, 3));
        assert_eq!(GoVersion::parse("go1.25").unwrap().minor, 25);
        assert_eq!(GoVersion::parse("go1.26rc1").unwrap().minor, 26);
        assert_eq!(
            GoVersion::parse("go1.26.0 X:nocoverageredesign")
                .unwrap()
                .patch,
            0
        );
        assert_eq!(GoVersion::parse("devel go1.27-abcdef"), None);
        assert_eq!(GoVersion::parse("go1.x"), None);
        assert_eq!(GoVersion::parse("go1.24.1.2"), None);
        assert_eq!(GoVersion::parse(""), None);
    }

    #[test]
    fn supported_versions_have_a_layout_and_others_are_refused() {
        for v in ["go1.23.12", "go1.24.0", "go1.25.0", "go1.26.8", "go1.26rc2"] {
            let (_, l) = layout_for(v).unwrap_or_else(|e| panic!("{v}: {e}"));
            assert_eq!(l.bucket_header, 48);
            assert_eq!(l.record_size(), 128);
        }
        let e = layout_for("go1.27.0").unwrap_err();
        assert_eq!(
            e,
            LayoutError::Unsupported(GoVersion {
                major: 1,
                minor: 27,
                patch: 0
            })
        );
        let msg = e.to_string();
        assert!(
            msg.contains("go1.27.0") && msg.contains("go1.23–go1.26"),
            "{msg}"
        );
        assert!(matches!(
            layout_for("go1.22.5"),
            Err(LayoutError::Unsupported(_))
        ));
        assert!(matches!(
            layout_for("go2.0.0"),
            Err(LayoutError::Unsupported(_))
        ));
        let e = layout_for("devel go1.27-0123abcd").unwrap_err();
        assert!(matches!(e, LayoutError::Unparsable(_)), "{e}");
        assert!(e.to_string().contains("devel"), "{e}");
    }
}
