//! Bounded maps under continuous use: a CPU sampler that lives on (another capture holds
//! it) keeps no stacks, counters or targets of captures that ended, however many ran on it.

mod support;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use flamefleet_agent::capture::cpu::{CpuMapFill, CpuOptions};
use flamefleet_agent::capture::{CaptureTarget, SamplerConfig, Samplers};
use support::{TestCgroup, compile_c, require_root, serial};

/// Recursion of a depth that changes with every call: many distinct user stacks.
const MANY_STACKS: &str = r#"
static volatile unsigned long sink;
__attribute__((noinline)) void ff_depth(int n) {
    if (n > 0) { ff_depth(n - 1); sink++; return; }
    for (int i = 0; i < 20000; i++) sink += i;
}
int main(void) { for (unsigned i = 0;; i++) ff_depth(i % 64); }
"#;

#[test]
fn stacks_of_finished_captures_leave_the_maps_while_the_sampler_lives() {
    require_root();
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let program = compile_c(dir.path(), "ffmanystacks", MANY_STACKS);
    // An empty cgroup holds the sampler for the whole test, as a long capture of a quiet
    // pod does in continuous operation.
    let quiet = TestCgroup::new("maplife-quiet");
    let mut busy = TestCgroup::new("maplife-busy");
    busy.spawn(&mut Command::new(&program));
    let samplers = Arc::new(Samplers::new(SamplerConfig::default()));
    let options = CpuOptions {
        frequency: 499,
        ..CpuOptions::default()
    };
    let hold = samplers
        .start_cpu(&[CaptureTarget::raw(quiet.cgroup.clone())], &options)
        .expect("the holding capture");
    let sampler = Arc::clone(hold.sampler());
    let mut during = Vec::new();
    for round in 0..3 {
        let capture = samplers
            .start_cpu(&[CaptureTarget::raw(busy.cgroup.clone())], &options)
            .expect("a capture of the busy cgroup");
        assert!(
            Arc::ptr_eq(capture.sampler(), &sampler),
            "round {round}: the captures share the sampler"
        );
        busy.wait_cpu(Duration::from_millis(300));
        let fill = sampler.map_fill();
        let result = capture.finish().expect("finish");
        assert!(result.total() > 0, "round {round}: no samples");
        assert!(
            fill.kernel_stacks + fill.user_stacks > 0,
            "round {round}: {fill:?}"
        );
        during.push(fill);
        // Finished: nothing of it is left, only the holding capture's (empty) target.
        assert_eq!(
            sampler.map_fill(),
            CpuMapFill {
                targets: 1,
                ..CpuMapFill::default()
            },
            "round {round}: left behind after the capture (during it: {fill:?})"
        );
    }
    eprintln!("map fill during the three captures: {during:?}");
    drop(hold);
}
